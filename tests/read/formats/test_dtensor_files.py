"""Per-rank `torch.save` files of a plain FSDP2 run (DTensor state dicts under `*rank<N>.pt` names),
against what the writing processes gathered, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.errors import CheckpointError
from shardstore.read.discover import open_source
from tests.conftest import assert_bitwise_equal, exported
from tests.read.conformance import FormatTests
from tests.refusals import cli as run

T26_TP = Path(__file__).parents[2] / "fixtures" / "data" / "fsdp2-tp" / "t2.6"


@pytest.mark.parametrize("kind, world", [("fsdp2", 3), ("hsdp", 4), ("tp", 4), ("t2.6-tp", 4)])
def test_plain_fsdp2_rank_files_unshard_bit_exactly(kind: str, world: int, fsdp2_files, tmp_path: Path) -> None:
    """Over tensor parallelism too ("tp": `_StridedShard` + `Shard`, `Shard` on two dimensions, DTensors
    of the dp sub-mesh naming only their own dp group; torch 2.13's files, and 2.6's kept as data)."""
    from safetensors.torch import load_file

    src = T26_TP if kind == "t2.6-tp" else fsdp2_files(kind, world)
    assert open_source(src).format == "dtensor-files"
    want = dict(torch.load(f"{src}.expected.pt.ref", weights_only=True))
    shardstore.unshard(src, tmp_path / "torch", format="torch", jobs=2)
    assert_bitwise_equal(torch.load(tmp_path / "torch" / "checkpoint.pt", weights_only=True), want, "torch",
                         ordered=True)
    shardstore.unshard(src, tmp_path / "st", jobs=2)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), want, "safetensors")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    shardstore.unshard(src, tmp_path / "dcp", format="dcp", jobs=2)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    assert_bitwise_equal(torch.load(tmp_path / "dcp.pt", weights_only=False), want, "dcp")


@pytest.mark.parametrize("kind, world", [("fsdp2", 3), ("tp", 4)])
def test_hf_export_with_the_models_config(kind: str, world: int, fsdp2_files, tmp_path: Path) -> None:
    """Plain rank files carry no model description: --hf-config names it, and the weights load with the
    gathered model's logits."""
    from transformers import AutoModelForCausalLM

    from tests.fixtures.fsdp2_files import TP_DIMS
    from tests.fixtures.verl import IDS, _model

    src = fsdp2_files(kind, world)
    dims = TP_DIMS if kind == "tp" else None
    config = tmp_path / "config"
    _model(dims).config.save_pretrained(config)
    shardstore.unshard(src, tmp_path / "hf", format="hf", hf_config=config, jobs=2)
    reference = _model(dims)
    reference.load_state_dict(torch.load(f"{src}.expected.pt.ref", weights_only=True))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(input_ids=IDS).logits
        assert torch.equal(got, reference.eval()(input_ids=IDS).logits)


def test_a_runs_own_config_json_describes_its_model_in_the_dtype_exported(fsdp2_files, tmp_path: Path) -> None:
    """A user's FSDP2 run of a Hugging Face model: `model.config.save_pretrained(run)` once, then per-rank
    state dicts in run/step<N>/. `unshard run out --format hf --dtype bf16` takes the run's config.json (no
    --hf-config), and every dtype field of the config written says bfloat16, so transformers loads the
    model in the dtype its files hold."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from tests.fixtures.verl import _model

    run = tmp_path / "run"
    shutil.copytree(fsdp2_files("fsdp2", 3), run / "step4")
    _model(None).config.save_pretrained(run)
    assert json.loads((run / "config.json").read_text()).get("dtype", "float32") == "float32"
    shardstore.unshard(run, tmp_path / "hf", format="hf", dtype="bfloat16", jobs=2)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert [config[k] for k in ("dtype", "torch_dtype") if k in config] in (["bfloat16"], ["bfloat16", "bfloat16"])
    want = torch.load(f"{fsdp2_files('fsdp2', 3)}.expected.pt.ref", weights_only=True)
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto").state_dict()
    assert {v.dtype for v in got.values()} == {torch.bfloat16}
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items() if k in got)
    assert set(want) - set(got) <= {"lm_head.weight"}  # tied to the embedding: transformers loads it as one


def test_a_scripts_model_and_optim_files_export_in_their_own_nesting(tmp_path: Path) -> None:
    """A plain script's per-rank `torch.save({"model": ..., "optim": ...})` of DTensors is no OLMo run:
    `--format torch` writes one checkpoint.pt in the files' nesting (what the README promises for rank
    files of any other trainer), not OLMo's model.pt, optim.pt and an empty train.pt. The files are torch's
    own DTensor pickles, each rank's made in a fake process group of two with its piece of known tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(0)
    full = {"w": torch.randn(6, 4), "b": torch.randn(5)}
    src = tmp_path / "ckpt"
    src.mkdir()
    for rank in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,))
            model = {k: DTensor.from_local(v.tensor_split(2)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                           shape=v.shape, stride=v.stride()) for k, v in full.items()}
            optim = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": model["w"]}},
                     "param_groups": [{"lr": 0.1, "params": [0]}]}
            torch.save({"model": model, "optim": optim}, src / f"model_rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    listing = run("ls", src)
    assert listing.returncode == 0 and "layout: generic" in listing.stdout, listing.stdout + listing.stderr
    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=1)
    assert exported(tmp_path / "pt") == ["checkpoint.pt"]
    want = {"model": full, "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": full["w"]}},
                                     "param_groups": [{"lr": 0.1, "params": [0]}]}}
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=True), want)


def test_a_missing_rank_file_is_named_before_anything_is_read(fsdp2_files, tmp_path: Path) -> None:
    src = shutil.copytree(fsdp2_files("fsdp2", 3), tmp_path / "src")
    (src / "model_rank1.pt").unlink()
    with pytest.raises(CheckpointError, match="missing for ranks 1"):
        shardstore.unshard(src, tmp_path / "out", jobs=1)


def test_a_renamed_tensor_parallel_file_is_refused(fsdp2_files, tmp_path: Path) -> None:
    """Rank 1's file copied over rank 3's: a DTensor of the dp sub-mesh places both at dp coordinate 0 of
    their own groups, but torch >= 2.10 pickles the rank that saved each mesh: refused by name."""
    src = shutil.copytree(fsdp2_files("tp", 4), tmp_path / "src")
    shutil.copy(src / "model_rank1.pt", src / "model_rank3.pt")
    with pytest.raises(CheckpointError, match="model_rank3.pt: .*named rank 3, but saved by rank 1"):
        shardstore.unshard(src, tmp_path / "out", jobs=1)


class TestDTensorFilesConformance(FormatTests):
    @pytest.fixture(params=["hsdp", "tp"])
    def checkpoint(self, request, fsdp2_files) -> Path:
        return fsdp2_files(request.param, 4)

    @pytest.fixture
    def foreign(self, fsdp2_files) -> Path:
        return fsdp2_files("fsdp2", 3) / "model_rank1.pt"
