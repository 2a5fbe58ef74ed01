"""`--format dcp`: a legacy rank-file checkpoint resumes at another world size through torch's own dcp.load."""

from __future__ import annotations

from pathlib import Path

import torch

import shardstore
from shardstore.export import dcp as dcp_export
from tests.conftest import assert_bitwise_equal, expected
from tests.fixtures.dcp import resume


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


def test_every_item_is_a_zip_whose_crcs_match_its_bytes(checkpoints, tmp_path: Path) -> None:
    """torch's loader does not check the CRC-32s in the zips a .distcp file holds, so only this does: each
    record's CRC is its bytes' (a tensor split into cells gets each cell's own, never the whole array's)."""
    import io
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    store = shardstore.ingest(tmp_path / "store", sorted(checkpoints(3).glob("rank*.pt")), jobs=1)
    assert any(len(store.cells_present(p)) > 1 for p in store.manifest.arrays)  # some tensors are several chunks
    shardstore.export(store, tmp_path / "dcp", format="dcp", jobs=1)
    storage = FileSystemReader(str(tmp_path / "dcp")).read_metadata().storage_data
    for index, info in storage.items():
        with open(tmp_path / "dcp" / info.relative_path, "rb") as f:
            f.seek(info.offset)
            item = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
        assert item.testzip() is None, (index.fqn, index.offset)


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
