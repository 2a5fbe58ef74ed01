"""OLMo-core 0.1 checkpoints, written by ai2-olmo-core 0.1.0's own `save_model_and_optim_state` in real
gloo processes: FSDP1 flat parameters (`flattened_offsets`) and FSDP2 DTensors (`local_shape` /
`global_offset`). The answer is OLMo-core's own unsharder (`unshard_model_state`, `unshard_optim_state`),
which must agree with torch's gather; shardstore's output must equal both, bit for bit."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from tests.conftest import assert_bitwise_equal, copy_checkpoint
from tests.read.conformance import FormatTests
from tests.test_cli import error_line

CASES = [("flat", 3), ("dtensor", 4), ("dtensor-hsdp", 4)]  # FSDP1; FSDP2; FSDP2 over 2 replica groups


def _olmo_core_unshard(src: Path) -> tuple[dict, dict]:
    from olmo_core.distributed.checkpoint import unshard_model_state, unshard_optim_state

    return unshard_model_state(src, no_dist=True), unshard_optim_state(src, no_dist=True)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("variant,world", CASES)
def test_olmo_core_unshards_like_olmo_core_itself(variant: str, world: int, olmo_checkpoints, tmp_path: Path) -> None:
    src = olmo_checkpoints("olmo_core", variant, world)
    model_want, optim_want = _olmo_core_unshard(src)
    gathered = torch.load(src / "expected.pt.ref", weights_only=False)["model"]
    assert_bitwise_equal(model_want, {k: _plain(v) for k, v in gathered.items()}, "OLMo-core vs torch")

    shardstore.unshard(src, tmp_path / "pt", store=tmp_path / "store", format="torch", jobs=2)
    model = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert list(model) == list(model_want)  # the same order, too
    assert_bitwise_equal(model, model_want, "model")
    optim = torch.load(tmp_path / "pt" / "optim.pt", weights_only=True)
    assert list(optim["state"]) == list(optim_want["state"])
    assert_bitwise_equal(optim["state"], optim_want["state"], "optim/state")
    assert optim["param_groups"] == optim_want["param_groups"]
    train = torch.load(tmp_path / "pt" / "train.pt", weights_only=False)
    assert train.keys() == torch.load(src / "train" / "rank0.pt", weights_only=False).keys()
    assert (tmp_path / "pt" / "config.yaml").read_bytes() == (src / "config.yaml").read_bytes()

    shardstore.export(tmp_path / "store", tmp_path / "st")
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), model_want, "safetensors")
    assert shardstore.open(tmp_path / "store").manifest.facts.format == "olmo-core"


def test_a_step_stored_by_one_rank_only_is_a_scalar(olmo_checkpoints, tmp_path: Path) -> None:
    """`step` of a parameter rank 0 does not hold is in the first rank holding it, as [1]; it comes back []."""
    src = olmo_checkpoints("olmo_core", "flat", 3)
    meta = json.loads((src / "optim" / "metadata.json").read_text())["tensors"]
    name, spec = next((n, t) for n, t in meta.items() if n.endswith(".__step")
                      and "rank_0.safetensors" not in t["shard_spec_per_file"])
    assert spec["shape"] == []
    shardstore.ingest(tmp_path / "store", [src], jobs=1)
    store = shardstore.open(tmp_path / "store")
    param = name[len("state."):-len(".__step")]
    pid = next(pid for p, pid in store.manifest.facts.reader["olmo_core"]["ids"] if p == param)
    step = store[f"optim/state/{pid}/step"]
    assert isinstance(step, torch.Tensor) and step.shape == () and step.item() == 1.0


def test_offsets_outside_the_tensor_are_refused(olmo_checkpoints, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(olmo_checkpoints("olmo_core", "flat", 3), tmp_path / "ckpt")
    path = ckpt / "model" / "metadata.json"
    meta = json.loads(path.read_text())
    t = meta["tensors"]["transformer.wte.weight"]
    t["shard_spec_per_file"]["rank_2.safetensors"]["flattened_offsets"] = [[64128, 10**12]]
    path.write_text(json.dumps(meta))
    line = error_line("unshard", str(ckpt), str(tmp_path / "out"), "-q")
    assert "model/metadata.json" in line and "transformer.wte.weight in rank_2.safetensors" in line


def test_a_file_that_holds_less_than_its_metadata_says_is_refused(olmo_checkpoints, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(olmo_checkpoints("olmo_core", "flat", 3), tmp_path / "ckpt")
    path = ckpt / "model" / "metadata.json"
    meta = json.loads(path.read_text())
    spec = meta["tensors"]["transformer.wte.weight"]["shard_spec_per_file"]
    spec["rank_1.safetensors"]["flattened_offsets"] = [[32064, 64000]]
    spec["rank_2.safetensors"]["flattened_offsets"] = [[64000, 96000]]
    path.write_text(json.dumps(meta))
    line = error_line("unshard", str(ckpt), str(tmp_path / "out"), "-q")
    assert re.search(r"model/rank_[12]\.safetensors: no tensor|model/rank_[12]\.safetensors: transformer\.wte\.weight is", line), line
    assert "the metadata says" in line or "which its metadata.json lists" in line


def test_a_safetensors_header_with_overlapping_tensors_is_refused(olmo_checkpoints, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(olmo_checkpoints("olmo_core", "flat", 3), tmp_path / "ckpt")
    path = ckpt / "model" / "rank_1.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    names = [k for k in header if k != "__metadata__" and header[k]["data_offsets"][1] > header[k]["data_offsets"][0]]
    a, b = names[0], names[1]
    size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + size]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (n - len(blob)) if len(blob) <= n else b""
    assert len(blob) == n
    path.write_bytes(raw[:8] + blob + raw[8 + n:])
    line = error_line("unshard", str(ckpt), str(tmp_path / "out"), "-q")
    assert "rank_1.safetensors" in line and "overlap" in line


def test_a_truncated_shard_file_is_refused(olmo_checkpoints, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(olmo_checkpoints("olmo_core", "dtensor", 4), tmp_path / "ckpt")
    path = ckpt / "optim" / "rank_3.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    line = error_line("unshard", str(ckpt), str(tmp_path / "out"), "-q")
    assert "optim/rank_3.safetensors" in line and "truncated" in line


class TestOlmoCoreConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, olmo_checkpoints) -> Path:
        return olmo_checkpoints("olmo_core", "flat", 3)

    @pytest.fixture
    def foreign(self, olmo_checkpoints) -> Path:
        return olmo_checkpoints("olmo_core", "dtensor", 3) / "model" / "rank_1.safetensors"


def test_a_trainer_state_of_another_step_is_refused(tmp_path: Path) -> None:
    """OLMo-core's trainer names step{N}/ by the global_step train/rank{r}.pt records: its step1 copied as
    step2 is refused in one line naming rank 0's file, nothing left; as step1 it unshards."""
    from tests.refusals import assert_step_is_checked

    trainer = Path(__file__).parents[2] / "fixtures" / "data" / "olmo-core-trainer" / "step1"
    assert_step_is_checked(trainer, tmp_path, 1, "train/rank0.pt")
