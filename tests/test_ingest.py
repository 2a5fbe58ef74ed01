"""Ingestion: idempotent, parallel or not, and a rank file from another checkpoint is refused untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import shardstore
from shardstore.errors import CheckpointError, StoreError


def content(store: Path) -> dict[str, str]:
    """Digest of every data and metadata file (commit records aside: they name the source file)."""
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file() and "/ranks/" not in str(p) and "manifest" not in p.name}


def test_reingest_in_any_order_and_parallel_is_identical(checkpoints, tmp_path: Path) -> None:
    files = sorted(checkpoints(6).glob("rank*.pt"))
    shardstore.ingest(tmp_path / "a", files, jobs=1)
    shardstore.ingest(tmp_path / "b", files[::-1], jobs=2)
    shardstore.ingest(tmp_path / "b", files[2:4], jobs=1)  # again: same bytes
    assert content(tmp_path / "a") == content(tmp_path / "b")
    assert shardstore.open(tmp_path / "b").status().ok


def test_rank_file_from_another_checkpoint_is_refused(checkpoints, tmp_path: Path) -> None:
    shardstore.ingest(tmp_path / "s", [checkpoints(2) / "rank0.pt"], jobs=1)
    before = content(tmp_path / "s")
    with pytest.raises(StoreError, match="world size 2, not 3"):
        shardstore.ingest(tmp_path / "s", [checkpoints(3) / "rank1.pt"], jobs=1)
    with pytest.raises(StoreError, match="different keys"):
        shardstore.ingest(tmp_path / "s", [checkpoints(2, kind="hf") / "rank1.pt"], jobs=1)
    assert content(tmp_path / "s") == before
    assert shardstore.open(tmp_path / "s").status().ranks_done == [0]


def test_partial_store_reads_what_has_arrived(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(3)
    store = shardstore.ingest(tmp_path / "s", [src / "rank2.pt"], jobs=1)
    status = store.status()
    assert status.ranks_missing == [0, 1] and not status.ok
    assert 0 < status.partial["model/wte.weight"] < 1
    assert store["model/wte.weight"].ranks == [2]
    with pytest.raises(CheckpointError, match="no rank files to ingest"):
        shardstore.ingest(tmp_path / "s", [])


def test_two_processes_ingesting_into_one_new_store_at_once(checkpoints, tmp_path: Path) -> None:
    import subprocess
    import sys

    src = checkpoints(6)
    files = [str(f) for f in sorted(src.glob("rank*.pt"))]
    shardstore.ingest(tmp_path / "clean", files, jobs=1)
    script = "import sys, shardstore; shardstore.ingest(sys.argv[1], sys.argv[2:], jobs=1)"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "both"), *files[i::2], *files])
             for i in range(2)]  # each creates the store, ingests its half first, then everything again
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert content(tmp_path / "both") == content(tmp_path / "clean")
    assert shardstore.open(tmp_path / "both").status().ok
