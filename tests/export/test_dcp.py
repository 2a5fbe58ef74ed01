"""`--format dcp`: a legacy rank-file checkpoint resumes at another world size through torch's own dcp.load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.export import dcp as dcp_export
from tests.conftest import assert_bitwise_equal, expected
from tests.fixtures.dcp import item_zips, resume


def test_a_legacy_checkpoint_resumes_on_fewer_ranks_with_dcp_load(checkpoints, tmp_path: Path, monkeypatch) -> None:
    src = checkpoints(3)  # saved by 3 FSDP1 ranks, legacy ShardedTensor rank files
    want = expected(src)
    monkeypatch.setattr(dcp_export, "INLINE_BYTES", 0)  # workers even for this small a checkpoint,
    monkeypatch.setattr(dcp_export, "FILE_BYTES", 1 << 20)  # each writing files of about 1 MiB
    result = shardstore.unshard(src, tmp_path / "dcp", format="dcp", jobs=2)
    names = sorted(p.name for p in result.files)
    assert names == [".metadata"] + [f"__{i}_0.distcp" for i in range(len(names) - 1)] and len(names) > 3
    got = resume(tmp_path / "dcp", 2, tmp_path / "gathered.pt")  # FSDP2 DTensors at world size 2
    assert_bitwise_equal(got["model"], want["model"], "model")
    for fqn, moments in want["optim"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(got["optim"]["state"][fqn][name], moments[name], f"{fqn}/{name}")
        assert float(got["optim"]["state"][fqn]["step"]) == float(moments["step"])
    assert got["optim"]["param_groups"][0]["lr"] == want["optim"]["param_groups"][0]["lr"]


def test_dcp_output_reads_back_through_shardstore_and_torch(checkpoints, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = checkpoints(2)
    store = shardstore.ingest(tmp_path / "store", sorted(src.glob("rank*.pt")), jobs=1)
    shardstore.export(store, tmp_path / "dcp", format="dcp", jobs=1)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "torch.pt")
    theirs = torch.load(tmp_path / "torch.pt", weights_only=False)
    assert_bitwise_equal(theirs["model"], expected(src)["model"], "dcp_to_torch_save")
    again = shardstore.unshard(tmp_path / "dcp", tmp_path / "st", store=tmp_path / "again", jobs=1)
    from safetensors.torch import load_file

    assert_bitwise_equal(load_file(again.files[0]), expected(src)["model"], "shardstore reading its own DCP")
    assert shardstore.open(tmp_path / "again")["global_step"] == 1


@pytest.mark.parametrize("one_pass", [False, True])
def test_every_item_is_a_zip_whose_crcs_match_its_bytes(checkpoints, tmp_path: Path, one_pass: bool) -> None:
    """torch's loader does not check the CRC-32s in the zips a .distcp file holds, so only this does: each
    record's CRC is its bytes' (a tensor split into cells gets each cell's own, never the whole array's).
    Each item has its own serialization id, as each torch.save has, also where the one pass laid out the
    items of one dtype and shape from one template (`dcp.Templates`), and where the store's were written
    from one."""
    files = sorted(checkpoints(3).glob("rank*.pt"))
    store = shardstore.ingest(tmp_path / "store", files, jobs=1)
    assert any(len(store.cells_present(p)) > 1 for p in store.manifest.arrays)  # some tensors are several chunks
    if one_pass:
        shardstore.unshard(files[0].parent, tmp_path / "dcp", format="dcp", jobs=2)
    else:
        shardstore.export(store, tmp_path / "dcp", format="dcp", jobs=1)
    storage = item_zips(tmp_path / "dcp")
    ids = {item.read("archive/.data/serialization_id") for item in storage.values()}
    shapes = [item.read("archive/data.pkl") for item in storage.values()]
    assert len(ids) == len(storage)
    assert len(set(shapes)) < len(shapes)  # items alike but for their ids: what one sketch serves
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "torch.pt")
    theirs = torch.load(tmp_path / "torch.pt", weights_only=False)
    assert_bitwise_equal(theirs["model"], expected(files[0].parent)["model"], "dcp_to_torch_save")


class _Counted(shardstore.Progress):
    def __init__(self) -> None:
        self.total: int | None = None
        self.steps: list[int] = []

    def start(self, phase: str, total: int | None, done: int = 0) -> None:
        self.total = total

    def advance(self, nbytes: int) -> None:
        self.steps.append(nbytes)


def test_progress_counts_the_same_tensor_bytes_however_many_workers(checkpoints, tmp_path: Path, monkeypatch) -> None:
    """The bar's total is what it counts up to, with one worker or several; several advance it file by
    file, not once at the end."""
    store = shardstore.ingest(tmp_path / "store", sorted(checkpoints(3).glob("rank*.pt")), jobs=1)
    alone, shared = _Counted(), _Counted()
    shardstore.export(store, tmp_path / "one", format="dcp", jobs=1, progress=alone)
    monkeypatch.setattr(dcp_export, "INLINE_BYTES", 0)
    monkeypatch.setattr(dcp_export, "FILE_BYTES", 1 << 20)
    shardstore.export(store, tmp_path / "two", format="dcp", jobs=2, progress=shared)
    assert alone.total == shared.total == sum(alone.steps) == sum(shared.steps) > 0
    assert alone.total >= sum(a.nbytes for a in store.manifest.arrays.values())
    assert len(shared.steps) == len(list((tmp_path / "two").glob("*.distcp"))) > 2


def test_flatten_names_values_as_torchs_flatten_state_dict() -> None:
    """shardstore's `flatten` (no torch) against torch's `flatten_state_dict` on the shapes state dicts
    take: nested dicts, lists of dicts, lists holding tensors, lists and tuples of plain values, empty
    containers, integer keys; tensors as the stand-ins the store gives (TensorValue)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from shardstore.store.handle import TensorValue, tensor_value

    t = torch.arange(3.0)
    state = {"model": {"w": t, "blocks": [{"a": t}, {"b": [t, 1]}]}, "optim": {"state": {0: {"exp": t, "step": 3}},
             "param_groups": [{"lr": 0.1, "params": [0, 1]}]}, "rng": [1, [2, 3], (4, 5)], "empty": {},
             "nothing": [], "mixed": [[t], [1]], "pair": (t, 1), 7: "int key"}

    def lean(v):
        if isinstance(v, torch.Tensor):
            return tensor_value(v)
        if isinstance(v, dict):
            return {k: lean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [lean(x) for x in v]
        return v

    theirs, their_paths = flatten_state_dict(state)
    ours, our_paths = dcp_export.flatten(lean(state))
    assert list(ours) == list(theirs) and our_paths == their_paths
    for fqn, value in theirs.items():
        if isinstance(value, (torch.Tensor, tuple)):  # a tensor, or a tuple kept whole (holding one here)
            assert type(ours[fqn]) is (TensorValue if isinstance(value, torch.Tensor) else tuple), fqn
        else:
            assert ours[fqn] == value, fqn


def test_a_dcp_export_never_imports_torch_in_the_coordinator(checkpoints, tmp_path: Path) -> None:
    """`--format dcp` pickles `.metadata` and flattens the state without torch: an unshard in one process
    (jobs=1) ends with torch never imported, and its output loads with torch's dcp_to_torch_save."""
    import subprocess
    import sys

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = checkpoints(2)
    code = ("import sys, shardstore; shardstore.unshard(sys.argv[1], sys.argv[2], format='dcp', jobs=1); "
            "print('torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "out")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
    dcp_to_torch_save(tmp_path / "out", tmp_path / "torch.pt")
    assert_bitwise_equal(torch.load(tmp_path / "torch.pt", weights_only=False)["model"], expected(src)["model"], "dcp")


def test_a_tied_name_is_a_key_of_the_folder_written_by_workers(tmp_path: Path, monkeypatch) -> None:
    """DeepSpeed's test_shared_weights model (`layer2.weight` is `layer1.weight`, tests/fixtures/
    deepspeed_zero.py) through the two-step export, items written by worker processes: `.metadata` names
    the tied key at its tensor's bytes (written once), and torch's own `dcp.load` of the model's full
    state dict gets every key, equal to DeepSpeed's zero_to_fp32 bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from tests.fixtures.deepspeed_zero import SharedWeights

    src = Path(__file__).parents[1] / "fixtures" / "data" / "deepspeed" / "shared-z2-w3"
    want = torch.load(f"{src}.expected.pt.ref", weights_only=False)["fp32"]
    monkeypatch.setattr(dcp_export, "INLINE_BYTES", 0)  # workers even for this small a checkpoint
    store = shardstore.ingest(tmp_path / "store", src, jobs=1)
    shardstore.export(store, tmp_path / "dcp", format="dcp", jobs=2)
    state = SharedWeights().state_dict()
    dcp.load({"model": state}, checkpoint_id=tmp_path / "dcp")
    assert_bitwise_equal(state, want, "dcp.load")
    storage = FileSystemReader(str(tmp_path / "dcp")).read_metadata().storage_data
    places = {i.fqn: (s.relative_path, s.offset, s.length) for i, s in storage.items()}
    assert places["model.layer2.weight"] == places["model.layer1.weight"]
    assert len(set(places.values())) == len(places) - 1  # every other item its own bytes
