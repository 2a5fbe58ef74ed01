"""veRL checkpoints (per-rank DTensor files), end to end: every output format against what the writing
processes gathered themselves, bit for bit; the files from torch 2.6 kept in tests/fixtures/data."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.errors import CheckpointError
from shardstore.read.discover import open_source
from tests.conftest import assert_bitwise_equal, reference_logits
from tests.read.conformance import FormatTests

OLD = Path(__file__).parents[2] / "fixtures" / "data" / "verl"
ACTOR = "global_step_7/actor"
# (FSDP strategy and mesh, world size): veRL's default, its HSDP mesh, world size 1, FSDP2 and FSDP2 HSDP.
# use_orig_params=True (veRL's choice when part of a model is frozen; one norm weight is): per-parameter
# optimizer parts of every size, none for the frozen one.
RUNS = [("fsdp1", 3), ("fsdp1-hsdp", 4), ("fsdp1", 1), ("fsdp2", 4), ("fsdp2-hsdp", 4), ("fsdp1-orig", 3),
        ("fsdp1-hsdp-orig", 4)]
OLD_RUNS = ["t2.4/fsdp1-w3", "t2.4/fsdp1-hsdp-w4", "t2.6/fsdp1-w3", "t2.6/fsdp1-hsdp-w4", "t2.6/fsdp2-w4"]


def _source(request: pytest.FixtureRequest, run: str) -> Path:
    if run.startswith("t2."):
        return OLD / run
    kind, world = run.rsplit("-w", 1)
    return request.getfixturevalue("verl_checkpoints")(kind, int(world))


def _expected(src: Path) -> dict:
    return torch.load(f"{src}.expected.pt.ref", weights_only=False)


def _check_torch_export(out: Path, src: Path) -> None:
    want = _expected(src)
    model = torch.load(out / "model.pt", weights_only=True)
    assert_bitwise_equal(model, want["model"], "model", ordered=True)
    optim = torch.load(out / "optim.pt", weights_only=True)
    if "fsdp1" in src.name:  # each (flat) parameter's state, per parameter, keyed by name
        names = set(want["param_names"])  # in the model file's order (the order of torch's gather varies)
        assert list(optim["state"]) == [k for k in want["model"] if k in want["optim"]["state"]]
        assert_bitwise_equal(optim["state"], want["optim"]["state"], "optim/state")
        assert sorted(optim["param_groups"][0]["params"]) == sorted(names)
    else:  # FSDP2: each parameter's moments, keyed by its index as the optimizer keys it
        for index, name in enumerate(want["param_names"]):
            assert_bitwise_equal(optim["state"][index], want["optim"]["state"][name], f"optim/{name}")
        assert optim["param_groups"][0]["params"] == list(range(len(want["param_names"])))
    rank0 = torch.load(src / ACTOR / next(p.name for p in (src / ACTOR).glob("extra_state_*_rank_0.pt")),
                       weights_only=False)
    train = torch.load(out / "train.pt", weights_only=False)
    assert_bitwise_equal(train["extra_state"]["rng"], rank0["rng"], "rng")  # rank 0's, as the store keeps values


@pytest.mark.parametrize("run", [f"{k}-w{w}" for k, w in RUNS] + OLD_RUNS)
def test_torch_export_is_what_the_processes_gathered(run: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    src = _source(request, run)
    shardstore.unshard(src, tmp_path / "out", format="torch", jobs=2)
    _check_torch_export(tmp_path / "out", src)


@pytest.mark.parametrize("run", ["fsdp2-hsdp-w4", "fsdp1-w3", "fsdp1-w1"])
def test_safetensors_and_dcp_exports(run: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = _source(request, run)
    want = _expected(src)["model"]
    shardstore.unshard(src, tmp_path / "st", jobs=2)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), dict(want), "safetensors")
    shardstore.unshard(src, tmp_path / "dcp", format="dcp", jobs=2)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    assert_bitwise_equal(torch.load(tmp_path / "dcp.pt", weights_only=False)["model"], dict(want), "dcp")


@pytest.mark.parametrize("run", ["fsdp2-w4", "fsdp1-hsdp-w4", "fsdp2-hsdp-w4", "fsdp1-w1", "t2.6/fsdp1-w3",
                                 "fsdp1-orig-w3"])
def test_hf_export_loads_with_the_gathered_models_logits(run: str, request: pytest.FixtureRequest,
                                                         tmp_path: Path) -> None:
    """Config, generation config and tokenizer come from veRL's huggingface/ folder with no flag; the
    checkpoint's own dtype is kept (veRL's merger casts to bf16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fixtures.verl import IDS

    src = _source(request, run)
    shardstore.unshard(src, tmp_path / "hf", format="hf", jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits,
                           reference_logits(src / ACTOR / "huggingface", _expected(src)["model"], IDS))
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("w1 w5")["input_ids"] == AutoTokenizer.from_pretrained(src / ACTOR / "huggingface")("w1 w5")["input_ids"]
    assert not (tmp_path / "hf" / "fsdp_config.json").exists()


def test_the_run_the_step_and_the_actor_folder_name_one_checkpoint(verl_checkpoints, tmp_path: Path) -> None:
    run = shutil.copytree(verl_checkpoints("fsdp1", 3), tmp_path / "run")
    older = run / "global_step_3"
    shutil.copytree(run / "global_step_7", older)
    units = open_source(run / "global_step_7").units
    assert len(units) == 9 and units[0].endswith("actor/model_world_size_3_rank_0.pt") \
        and units[-1].endswith("actor/extra_state_world_size_3_rank_2.pt")
    assert open_source(run).units == units  # latest_checkpointed_iteration.txt names step 7
    assert open_source(run / "global_step_7" / "actor").units == units
    assert open_source(run, step=3).units == open_source(older).units != units
    (run / "latest_checkpointed_iteration.txt").unlink()
    assert open_source(run).units == units  # without the pointer: the newest step by its name


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "/ranks/" not in str(p) and "manifest" not in p.name}


def test_any_order_or_subset_of_units_gives_the_same_store(verl_checkpoints, tmp_path: Path) -> None:
    src = verl_checkpoints("fsdp2-hsdp", 4) / "global_step_7"
    units = open_source(src).units
    shardstore.ingest(tmp_path / "a", open_source(src), jobs=1)
    shardstore.ingest(tmp_path / "b", [units[5], units[2]], jobs=1)  # two first, the rest later, backwards
    assert not shardstore.open(tmp_path / "b").status().ok
    shardstore.ingest(tmp_path / "b", units[::-1], jobs=2)
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    assert shardstore.open(tmp_path / "b").status().ok


def test_a_file_of_another_kind_or_checkpoint_is_refused_by_name(verl_checkpoints, tmp_path: Path) -> None:
    run = shutil.copytree(verl_checkpoints("fsdp1", 3), tmp_path / "run")
    actor = run / ACTOR
    shutil.copy(actor / "optim_world_size_3_rank_1.pt", actor / "model_world_size_3_rank_1.pt")
    with pytest.raises(CheckpointError, match="model_world_size_3_rank_1.pt: its keys or tensor layouts differ"):
        shardstore.unshard(run, tmp_path / "out", jobs=1)
    (actor / "model_world_size_3_rank_1.pt").unlink()
    with pytest.raises(CheckpointError, match=r"model_world_size_3_rank_1.pt: missing \(the checkpoint is incomplete\)"):
        open_source(run)


@pytest.mark.parametrize("run, says", [("fsdp1-w3", "saved by rank 1"),
                                       ("t2.6/fsdp1-w3", r"its device mesh places it at coordinate \[1\], not \[2\]")])
def test_a_rank_file_claiming_another_ranks_box_is_refused(run: str, says: str, request: pytest.FixtureRequest,
                                                           tmp_path: Path) -> None:
    """Rank 1's model file saved under rank 2's name: the mesh it pickled places it at rank 1 (torch >= 2.10
    also names the rank that saved it), and it is refused before anything is written."""
    src = _source(request, run)
    actor = shutil.copytree(src / ACTOR, tmp_path / "actor")
    shutil.copy(actor / "model_world_size_3_rank_1.pt", actor / "model_world_size_3_rank_2.pt")
    with pytest.raises(CheckpointError, match=f"model_world_size_3_rank_2.pt: .*named rank 2, but {says}"):
        shardstore.ingest(tmp_path / "s", [actor / "model_world_size_3_rank_2.pt"], jobs=1)


class TestVerlConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, verl_checkpoints) -> Path:
        return verl_checkpoints("fsdp2-hsdp", 4)  # Shard(1) and replica groups

    @pytest.fixture
    def foreign(self, verl_checkpoints) -> Path:
        return verl_checkpoints("fsdp1", 3) / ACTOR / "model_world_size_3_rank_1.pt"


class TestVerlFlatOptimizerConformance(TestVerlConformance):
    @pytest.fixture
    def checkpoint(self, verl_checkpoints) -> Path:
        return verl_checkpoints("fsdp1", 3)  # flat-parameter optimizer state split per parameter

    @pytest.fixture
    def foreign(self, verl_checkpoints) -> Path:
        return verl_checkpoints("fsdp2", 4) / ACTOR / "optim_world_size_4_rank_1.pt"


def test_a_lora_only_save_is_exported_as_it_is_and_refused_as_a_model(tmp_path: Path) -> None:
    """A checkpoint of LoRA adapter weights only: safetensors writes them as they are; --format hf says
    why it cannot be a model, before anything is read."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "lora"
    folder.mkdir()
    weights = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.arange(32.).reshape(4, 8),
               "model.layers.0.self_attn.q_proj.lora_B.weight": torch.arange(24.).reshape(6, 4)}
    save_file(weights, folder / "model.safetensors")
    shardstore.unshard(folder, tmp_path / "st", jobs=1)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), weights, "adapter")
    with pytest.raises(shardstore.ExportError, match="holds LoRA adapter weights only"):
        shardstore.unshard(folder, tmp_path / "hf", format="hf", jobs=1,
                           hf_config=Path(__file__).parents[2] / "fixtures" / "data" / "verl" / "t2.6" /
                           "fsdp1-w3" / "global_step_7" / "actor" / "huggingface")


class TestVerlOrigParamsConformance(TestVerlConformance):
    @pytest.fixture
    def checkpoint(self, verl_checkpoints) -> Path:
        return verl_checkpoints("fsdp1-hsdp-orig", 4)  # parts of every size, replica groups, a frozen parameter


def test_an_fsdp1_optimizer_file_copied_over_another_ranks_is_refused_by_name(tmp_path: Path) -> None:
    """FSDP1's flat optimizer shards say nothing of their rank and have every length right."""
    src = shutil.copytree(OLD / "t2.6" / "fsdp1-w3", tmp_path / "src")
    actor = src / ACTOR
    shutil.copy(actor / "optim_world_size_3_rank_0.pt", actor / "optim_world_size_3_rank_1.pt")
    with pytest.raises(CheckpointError, match=r"optim_world_size_3_rank_1\.pt: the same file as "
                                              r"optim_world_size_3_rank_0\.pt"):
        shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)
    assert not (tmp_path / "out").exists()
