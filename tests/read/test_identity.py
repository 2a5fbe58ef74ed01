"""A file's identity: the same for a copy, another for any changed tensor, and the same whether read from
its path (the coordinator) or from the zip a worker already opened."""

from __future__ import annotations

import shutil
from pathlib import Path

from shardstore.read.container import TorchZip
from shardstore.read.identity import file_identity, zip_identity
from tests.fixtures.forge import records, write_zip

CORPUS = Path(__file__).parents[1] / "corpus" / "data"


def test_zip_identity_follows_the_content(tmp_path: Path) -> None:
    src = CORPUS / "olmo-legacy-t2.0-shardgradop-w3" / "rank0.pt"
    shutil.copy(src, tmp_path / "copy.pt")
    assert file_identity(src) == file_identity(tmp_path / "copy.pt") and file_identity(src).startswith("zip:")
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
