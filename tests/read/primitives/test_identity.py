"""A file's identity: its content's the same for a copy, another for any changed tensor, and the same
whether read from its path (the coordinator) or from the zip a worker already opened; its stamp another
for any file the file system saw change, even where the content identity cannot see it."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

import shardstore
from shardstore.read.primitives.container import TorchZip
from shardstore.read.primitives.identity import content, file_identity, file_stamp, stamp, zip_identity
from tests.conftest import sigkill_mid_way
from tests.fixtures.forge import records, write_zip

CORPUS = Path(__file__).parents[2] / "corpus" / "data"


def test_zip_identity_follows_the_content(tmp_path: Path) -> None:
    src = CORPUS / "olmo-legacy-t2.0-shardgradop-w3" / "rank0.pt"
    shutil.copy(src, tmp_path / "copy.pt")
    assert content(file_identity(src)) == content(file_identity(tmp_path / "copy.pt"))
    assert file_identity(src).startswith("zip:")
    assert stamp(file_identity(src)) != stamp(file_identity(tmp_path / "copy.pt"))  # another inode
    with TorchZip(src) as zf:
        assert zip_identity(zf) == file_identity(src)
    entries = records(src)
    write_zip(tmp_path / "a.pt", entries)
    i = next(i for i, (name, data) in enumerate(entries) if "/data/" in name and data)
    entries[i] = (entries[i][0], bytes([entries[i][1][0] ^ 1]) + entries[i][1][1:])  # one bit of one tensor
    write_zip(tmp_path / "b.pt", entries)
    assert (tmp_path / "a.pt").stat().st_size == (tmp_path / "b.pt").stat().st_size
    assert file_identity(tmp_path / "a.pt") != file_identity(tmp_path / "b.pt")
    assert file_identity(src) != file_identity(CORPUS / "olmo-legacy-t2.0-shardgradop-w3" / "rank1.pt")


def test_a_distcp_file_is_sampled_not_read_as_its_last_items_zip(tmp_path: Path) -> None:
    """A .distcp file ends with its last item's zip: that zip alone must not stand for the file."""
    (first, *_) = sorted((CORPUS / "torchtitan-dcp-t2.13-w2" / "step-2").glob("*.distcp"))
    assert file_identity(first).startswith("sample:")
    data = bytearray(first.read_bytes())
    data[100] ^= 1  # inside the first item, far from the last item's zip
    (tmp_path / first.name).write_bytes(data)
    assert file_identity(tmp_path / first.name) != file_identity(first)


def test_a_stamp_moves_when_a_file_changes_in_its_middle_where_the_sample_cannot_see(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(1 << 20))
    before, before_stamp = file_identity(path), file_stamp(path)
    assert stamp(before) == before_stamp
    with open(path, "r+b") as f:
        f.seek(1 << 19)
        f.write(b"\x01")
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1000))  # however coarse the clock
    after = file_identity(path)
    assert content(after) == content(before) and stamp(after) != stamp(before) == before_stamp


def test_a_file_changed_in_place_between_a_killed_run_and_its_resume_is_read_again(tmp_path: Path) -> None:
    """Same size, same first and last 64 KiB: only the file system's stamp tells; the rerun starts over."""
    from safetensors.torch import load_file, save_file

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    want = {}
    for i in range(6):
        tensors = {f"w{i}": torch.arange(100_000, dtype=torch.float32) + i}
        save_file(tensors, src / f"model-{i + 1:05d}-of-00006.safetensors")
        want.update(tensors)
    cmd = [sys.executable, "-m", "shardstore", "unshard", str(src), str(out), "-j", "1", "-q"]
    sigkill_mid_way(cmd, shardstore.scratch_location(out), 6, 1, reset=out)
    ranks = shardstore.scratch_location(out) / "__shardstore__" / "ranks"
    changed = src / json.loads(next(ranks.glob("*.json")).read_text())["file"]
    name = next(iter(load_file(changed)))
    with open(changed, "r+b") as f:  # element 50,000 of the tensor, in the middle of the file
        f.seek(os.path.getsize(changed) - 200_000)
        f.write(b"\x00\x00\x80\x7f")  # +inf
    os.utime(changed, ns=(os.stat(changed).st_atime_ns, os.stat(changed).st_mtime_ns + 1000))
    want[name] = load_file(changed)[name]
    assert torch.isinf(want[name]).sum() == 1
    shardstore.unshard(src, out, jobs=1)
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
