"""torch's own DCP test configurations (torch/testing/_internal/distributed/checkpoint_utils.py and
test/distributed/checkpoint/: ZStandard streams, empty saves, flatten_state_dict=False, every dtype, 0-d,
expanded and transposed tensors, tensors in lists and tuples, DTensor placements, HF storage), each saved
with torch's own writer in the test and read back by torch's own reader, compared with shardstore's
exports bit for bit."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardstore
from shardstore.errors import CheckpointError
from tests.conftest import assert_bitwise_equal


def _save(state: dict[str, Any], folder: Path, **writer: Any) -> Path:
    dcp.save(state, storage_writer=FileSystemWriter(folder, **writer))
    return folder


def _torch_reads(folder: Path) -> dict[str, Any]:
    """What torch's own reader makes of the folder: dcp_to_torch_save's one file (beside the folder)."""
    dcp_to_torch_save(folder, f"{folder}.torch-reads.pt")
    return torch.load(f"{folder}.torch-reads.pt", weights_only=False)


def _exported(folder: Path, tmp_path: Path, fmt: str = "torch") -> dict[str, Any]:
    """shardstore's export of the folder, read back: --format torch's checkpoint.pt, or --format dcp's folder
    through torch's own reader."""
    out = tmp_path / f"out-{fmt}"
    shardstore.unshard(folder, out, format=fmt, jobs=1)
    if fmt == "dcp":
        return _torch_reads(out)
    return torch.load(out / "checkpoint.pt", weights_only=False)


def _mixed_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=gen), "zeros": torch.zeros(4096),
                      "ids": torch.arange(10), "half": torch.randn(3, 5, generator=gen).to(torch.bfloat16)},
            "step": 3, "extra": {"lr": 0.1, "count": torch.tensor(5.0), "names": ["a", "b"]}}


# ------------------------------------------------------------------------------------------ ZStandard


def _zstd_checkpoint(tmp_path: Path) -> Path:
    from torch.distributed.checkpoint._extension import ZStandard

    return _save(_mixed_state(), tmp_path / "zstd", _extensions=[ZStandard()])


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_zstandard_items_read_as_torch_reads_them(fmt: str, tmp_path: Path) -> None:
    src = _zstd_checkpoint(tmp_path)
    md = pickle.loads((src / ".metadata").read_bytes())
    assert all(info.transform_descriptors == ["stream.zstd/1"] for info in md.storage_data.values())
    assert_bitwise_equal(_exported(src, tmp_path, fmt), _torch_reads(src), fmt)


def _rewritten(src: Path, edit) -> Path:
    """The checkpoint with its .metadata rewritten by torch's own pickle after `edit(metadata, folder)`."""
    md = pickle.loads((src / ".metadata").read_bytes())
    edit(md, src)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    return src


def _item(md: Any, fqn: str) -> Any:
    return next(info for index, info in md.storage_data.items() if index.fqn == fqn)


def _bomb(md: Any, folder: Path) -> None:
    """model.ids' item pointed at a small zstd stream of 64 MiB of zeros appended to its file."""
    info = _item(md, "model.ids")
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    with open(folder / info.relative_path, "ab") as f:
        info.offset = f.tell()
        f.write(bomb)
    info.length = len(bomb)


@pytest.mark.parametrize("edit, needle", [
    (lambda md, _: setattr(_item(md, "model.w"), "length", _item(md, "model.w").length // 2),
     r"__0_0\.distcp: model\.w at \[0, 0\] \(decompressed\): not a torch checkpoint or truncated"),
    (lambda md, _: setattr(_item(md, "model.w"), "transform_descriptors", ["stream.zstd/2"]),
     "which torch's own reader does not read either"),
    (lambda md, _: setattr(_item(md, "model.w"), "transform_descriptors", "stream.zstd/1"), "not a list of names"),
    (lambda md, _: setattr(_item(md, "model.w"), "offset", _item(md, "model.w").offset + 1),
     "not the ZStandard stream its metadata says"),
    (_bomb, "decompresses to more than"),
])
def test_a_forged_or_cut_zstandard_item_is_one_line(edit, needle: str, tmp_path: Path) -> None:
    src = _rewritten(_zstd_checkpoint(tmp_path), edit)
    with pytest.raises(CheckpointError, match=needle) as exc:
        shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_a_truncated_zstandard_file_is_refused_by_its_items_ends(tmp_path: Path) -> None:
    src = _zstd_checkpoint(tmp_path)
    distcp = src / "__0_0.distcp"
    distcp.write_bytes(distcp.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*truncated"):
        shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)
    assert not (tmp_path / "out").exists()


def test_without_zstandard_the_refusal_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    from shardstore.read.primitives import transforms

    src = _zstd_checkpoint(tmp_path)
    monkeypatch.setattr(transforms, "_zstandard", lambda: None)
    with pytest.raises(CheckpointError, match=r"stream\.zstd/1.*pip install 'shardstore\[zstd\]'"):
        shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ empty saves
class _Nothing:
    """A Stateful whose state is empty (torch's tests save such an app state)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state == {}


@pytest.mark.parametrize("case", ["empty", "stateful", "empty-module", "metadata-only"])
@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_an_empty_save_exports_what_torch_loads(case: str, fmt: str, tmp_path: Path) -> None:
    """torch loads a save of nothing as {} (a nested empty dict is dropped as it flattens the state); so do
    the exports. A copy with its empty .distcp file gone, as --format dcp writes one, torch loads the same."""
    state = {"empty": {}, "stateful": {"app": _Nothing()}, "empty-module": {"model": {}, "step": 7},
             "metadata-only": {}}[case]
    src = _save(state, tmp_path / "src")
    if case == "metadata-only":
        for distcp in src.glob("*.distcp"):
            distcp.unlink()
    want = _torch_reads(src)
    assert want == ({"step": 7} if case == "empty-module" else {})
    assert_bitwise_equal(_exported(src, tmp_path, fmt), want, case)
