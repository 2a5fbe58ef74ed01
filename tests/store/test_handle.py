"""Lazy reads: a small slice reads a small fraction of the tensor's bytes, and nothing that hasn't arrived."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.errors import StoreError
from tests.conftest import assert_bitwise_equal
from tests.fixtures.layouts import expected


def bytes_read() -> int:
    """Bytes this process has read through read(2) and friends so far (the kernel's own count)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_four_rows_of_a_large_tensor_read_a_small_fraction(layout_checkpoints, tmp_path: Path) -> None:
    src = layout_checkpoints("big-w2", 2, "big")
    want = expected("big")["model"]["big"]
    shardstore.ingest(tmp_path / "store", sorted(src.glob("rank*.pt")), jobs=1)
    store = shardstore.open(tmp_path / "store")
    handle = store["model/big"]
    handle[0:1]  # open the array (metadata) outside the measurement
    before = bytes_read()
    got = handle[5000:5004]
    used = bytes_read() - before
    assert_bitwise_equal(got, want[5000:5004])
    assert used < handle.nbytes / 20, f"read {used} bytes of a {handle.nbytes}-byte tensor for 4 rows"
    stats = handle.stats()
    assert stats["count"] == want.numel() and stats["nan"] == 0
    assert stats["max"] == float(want.max()) and stats["min"] == float(want.min())
    assert stats["mean"] == pytest.approx(float(want.double().mean()), rel=1e-9)
    assert stats["norm"] == pytest.approx(float(want.double().norm()), rel=1e-9)
    assert stats["std"] == pytest.approx(float(want.double().std(correction=0)), rel=1e-6)


def test_rows_that_have_not_arrived_are_refused(layout_checkpoints, tmp_path: Path) -> None:
    src = layout_checkpoints("big-w2", 2, "big")
    want = expected("big")["model"]["big"]
    store = shardstore.ingest(tmp_path / "store", [src / "rank1.pt"], jobs=1)
    handle = store["model/big"]
    assert handle.ranks == [1]
    assert_bitwise_equal(handle[-3:], want[-3:])  # rank 1's rows are readable before rank 0 arrives
    with pytest.raises(StoreError, match="rows 0-4095 have not arrived"):
        handle[10:12]
    shardstore.ingest(tmp_path / "store", [src / "rank0.pt"], jobs=1)
    assert_bitwise_equal(handle[10:12], want[10:12])  # the same handle sees the newly committed rank
    assert torch.equal(handle[4095:4097], want[4095:4097])


def test_a_small_tensors_rows_are_read_from_the_ranks_that_have_arrived(layout_checkpoints, tmp_path: Path) -> None:
    """Small tensors wait in the ranks' staging files until every rank is in: what has arrived reads."""
    src = layout_checkpoints("olmo-w3", 3, "olmo")
    want = expected("olmo")["model"]["wte.weight"]  # 97 rows: rank 1 holds rows 33-65
    store = shardstore.ingest(tmp_path / "store", [src / "rank1.pt"], jobs=1)
    handle = store["model/wte.weight"]
    assert handle.entry.staged
    assert_bitwise_equal(handle[33:66], want[33:66])
    assert_bitwise_equal(handle[40], want[40])
    assert handle.numpy(slice(33, 35)).tolist() == want[33:35].tolist()
    with pytest.raises(StoreError, match=r"wte.weight: rows 0-32, 66-96 have not arrived yet"):
        handle[30:40]
    shardstore.ingest(tmp_path / "store", [src / "rank0.pt", src / "rank2.pt"], jobs=1)
    assert_bitwise_equal(handle[...], want)  # assembled now: read from its cell
