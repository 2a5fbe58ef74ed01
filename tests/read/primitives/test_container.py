"""The zip container: storages are located, not copied; damage is reported with the file's name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore.errors import CheckpointError
from shardstore.read.primitives.container import TorchZip


def test_records_are_zero_copy_views_of_aligned_storages(tmp_path: Path) -> None:
    t = torch.arange(1000, dtype=torch.int64)
    torch.save({"t": t}, tmp_path / "f.pt")
    with TorchZip(tmp_path / "f.pt") as z:
        assert z.prefix == "f/"
        assert bytes(z.record("data/0")) == t.numpy().tobytes()
        assert z.storage_offset("0") % 64 == 0
        z.verify("data/0")


def test_damage_is_named(tmp_path: Path) -> None:
    torch.save({"t": torch.ones(100000)}, tmp_path / "f.pt")
    data = (tmp_path / "f.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:-5000])
    with pytest.raises(CheckpointError, match="cut.pt: not a torch checkpoint or truncated"):
        TorchZip(tmp_path / "cut.pt")
    flipped = bytearray(data)
    with TorchZip(tmp_path / "f.pt") as z:
        at = z.entries["data.pkl"].offset + 5
    flipped[at] ^= 0xFF
    (tmp_path / "flip.pt").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="flip.pt"):
        with TorchZip(tmp_path / "flip.pt") as z:
            z.verify("data.pkl")
    with pytest.raises(CheckpointError, match="no such file"):
        TorchZip(tmp_path / "missing.pt")
