"""torchtitan's checkpoints: `checkpoint/step-N/`, one DCP of the model's keys at the top level beside
`optimizer`, `lr_scheduler`, `dataloader` and `train_state`, written by torchtitan's own CheckpointManager
under FSDP2 × TP in gloo processes (tests/fixtures/torchtitan_ckpt.py; kept in
tests/fixtures/data/torchtitan/), against what the live ranks gathered.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.read.discover import open_source
from tests.export.conformance import OutputTests
from tests.read.conformance import FormatTests

DATA = Path(__file__).parents[2] / "fixtures" / "data" / "torchtitan"
RUN = DATA / "tt-w4-tp2" / "checkpoint"


def _want() -> dict:
    return torch.load(DATA / "tt-w4-tp2.expected.pt.ref", weights_only=True)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_the_newest_step_is_taken_and_written_whole(tmp_path: Path) -> None:
    """The run's checkpoint/ folder: step-4 is taken (torchtitan's rule: the highest step), --step 2 the
    other. --format torch writes the whole tree as saved: the model's keys at the top and the optimizer's
    flattened state bit for bit what the live ranks gathered (torchtitan's flattening drops torch's
    `param_names`, and only those), the train state and every dp rank's dataloader state."""
    assert open_source(RUN).units[0].startswith(str(RUN / "step-4"))
    assert open_source(RUN, step=2).units[0].startswith(str(RUN / "step-2"))
    want = _want()
    shardstore.unshard(RUN, tmp_path / "pt", format="torch")
    got = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=False)
    assert set(got) == {*want["model"], "optimizer", "lr_scheduler", "dataloader", "train_state"}
    assert all(torch.equal(got[k], v) for k, v in want["model"].items())
    optimizer = _flat(got["optimizer"])
    assert {k for k in want["optimizer"] if k not in optimizer} == {k for k in want["optimizer"]
                                                                      if k.endswith(".param_names")}
    assert set(optimizer) <= set(want["optimizer"])
    for key, value in optimizer.items():
        assert torch.equal(value, want["optimizer"][key]) if isinstance(value, torch.Tensor) \
            else value == want["optimizer"][key], key
    assert got["train_state"] == {"step": 4, "ntokens_seen": 128}
    assert got["dataloader"]["world_size"] == 2 and {"dp_rank_0", "dp_rank_1"} <= set(got["dataloader"])
    assert got["lr_scheduler"]["last_epoch"] == 4


def test_safetensors_and_hf_take_the_model_at_the_top_level(tmp_path: Path) -> None:
    """safetensors writes the model's keys alone (--select model names them too); hf, given the model's
    config, loads in transformers and gives the gathered weights' logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tests.fixtures.torchtitan_ckpt import CONFIG

    want = _want()["model"]
    shardstore.unshard(RUN, tmp_path / "st")
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert set(st) == set(want) and all(torch.equal(st[k], v) for k, v in want.items())
    shardstore.unshard(RUN, tmp_path / "named", select="model")
    assert load_file(tmp_path / "named" / "model.safetensors").keys() == st.keys()
    LlamaConfig(**CONFIG).save_pretrained(tmp_path / "config")
    shardstore.unshard(RUN, tmp_path / "hf", format="hf", hf_config=tmp_path / "config" / "config.json")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    gathered = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    gathered.load_state_dict(want)
    ids = torch.tensor([[5, 9, 13, 40, 2, 77], [1, 8, 21, 3, 66, 30]])
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, gathered(input_ids=ids).logits)


class TestTorchtitanConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        return RUN / "step-4"

    @pytest.fixture
    def foreign(self, tmp_path: Path) -> Path:
        return RUN / "step-2" / "__1_0.distcp"  # the same run's other save


class TestTorchtitanOutputs(OutputTests):
    """torchtitan's DCP under FSDP2 x TP: every output format, one pass against two steps."""

    from tests.fixtures.torchtitan_ckpt import CONFIG as hf_config

    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        return RUN / "step-4"


def test_a_train_state_of_another_step_is_refused(tmp_path: Path) -> None:
    """torchtitan names step-N/ by the step its train_state records: step-2 copied as step-6 is refused in
    one line naming the file, nothing left; every genuine step folder agrees with its name."""
    import shutil

    from tests.refusals import assert_refused, cli

    shutil.copytree(RUN / "step-2", tmp_path / "step-6")
    assert_refused(cli("unshard", tmp_path / "step-6", tmp_path / "out", "-q"), str(tmp_path / "step-6"),
                   "train_state.step: records step 2, but its folder is step-6")
    assert not (tmp_path / "out").exists()
    for step in (2, 4):
        assert cli("unshard", RUN / f"step-{step}", tmp_path / f"ok{step}", "-q").returncode == 0
