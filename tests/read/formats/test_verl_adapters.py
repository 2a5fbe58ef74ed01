"""veRL's legacy Megatron LoRA adapter files (shardstore/read/formats/verl_adapters.py), as veRL's own
`save_adapter_checkpoint` wrote them at TP=2, PP=2 (tests/fixtures/megatron_lora_legacy.py): merged as
Megatron-LM's own files are, against megatron-core's single-process load of the same live model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import shardstore
from tests.conftest import assert_bitwise_equal
from tests.read.conformance import FormatTests
from tests.refusals import assert_refused, cli

DATA = Path(__file__).parents[2] / "fixtures" / "data" / "megatron" / "core0.19.2"
RUN, LEGACY = DATA / "tp2-pp2-lora-verl-legacy", DATA / "tp2-pp2-lora-legacy"
FILES = "global_step_10/actor/adapter_checkpoint"


def test_the_adapter_files_merge_as_megatron_core_loads_them(tmp_path: Path) -> None:
    """Every adapter's four rank parts joined (A on r or on its input, B on its rows, the stages' layers
    renumbered), bit for bit megatron-core's load; its peft adapter is the one the same model's
    Megatron-LM files give."""
    from safetensors.torch import load_file

    assert shardstore.rank_files(RUN)[0].endswith(f"{FILES}/mp_rank_00_000_adapter.pt")
    shardstore.unshard(RUN, tmp_path / "st", jobs=1)
    ref = torch.load(f"{RUN}.expected.pt.ref", weights_only=True)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), ref["model"], "adapters")
    shardstore.unshard(RUN, tmp_path / "a", format="hf", adapter=True, lora_alpha=8.0, jobs=1)
    shardstore.unshard(LEGACY, tmp_path / "b", format="hf", adapter=True, lora_alpha=8.0, jobs=1)
    assert_bitwise_equal(load_file(tmp_path / "a" / "adapter_model.safetensors"),
                         load_file(tmp_path / "b" / "adapter_model.safetensors"), "adapter")


def test_a_missing_rank_file_is_refused_naming_it(tmp_path: Path) -> None:
    run = shutil.copytree(RUN, tmp_path / "run")
    (run / FILES / "mp_rank_01_001_adapter.pt").unlink()
    assert_refused(cli("unshard", run, tmp_path / "out", "-q"), "mp_rank_01_001")
    assert not (tmp_path / "out").exists()


class TestVerlAdaptersConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        return RUN / "global_step_10"

    @pytest.fixture
    def foreign(self, tmp_path: Path) -> Path:
        return LEGACY / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt"
