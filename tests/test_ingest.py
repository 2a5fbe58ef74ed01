"""Ingestion: idempotent, parallel or not, and a rank file from another checkpoint is refused untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import shardstore
from shardstore.errors import CheckpointError


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
    # the store is not planned again: each file is checked against the plan it has
    with pytest.raises(CheckpointError, match="rank1.pt: sharded over groups of 3 ranks, but the store holds a checkpoint sharded over 2"):
        shardstore.ingest(tmp_path / "s", [checkpoints(3) / "rank1.pt"], jobs=1)
    with pytest.raises(CheckpointError, match="rank1.pt: its keys differ from the checkpoint in the store"):
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


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_sigkill_at_any_moment_then_rerun_equals_a_clean_ingest(checkpoints, tmp_path: Path, seed: int) -> None:
    import random
    import signal
    import subprocess
    import sys
    import time

    src = checkpoints(6)
    files = [str(f) for f in sorted(src.glob("rank*.pt"))]
    shardstore.ingest(tmp_path / "clean", files, jobs=1)
    cmd = [sys.executable, "-m", "shardstore.cli", "ingest", str(tmp_path / "s"), *files, "-j", "1", "-q"]
    proc = subprocess.Popen(cmd)
    time.sleep(random.Random(seed).uniform(0.3, 1.6))  # from start-up to done: the kill lands anywhere
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if (tmp_path / "s" / "__shardstore__" / "manifest.json").exists():
        store = shardstore.open(tmp_path / "s")
        for rank, record in store.records().items():  # whatever is marked done is really there, whole
            for path, cells in record.cells.items():
                entry = store.manifest.arrays[path]
                for flat in cells:
                    key = store.cell_key(path, entry.cell_index(flat))
                    assert (tmp_path / "s" / key).read_bytes() == (tmp_path / "clean" / key).read_bytes(), key
            if record.staged:
                staged = (tmp_path / "s" / "__shardstore__" / "staging" / f"{rank}.bin").read_bytes()
                assert len(staged) == max(start + n for pieces in record.staged.values() for *_, start, n in pieces)
    assert subprocess.run(cmd).returncode == 0
    assert content(tmp_path / "s") == content(tmp_path / "clean")
    assert not list((tmp_path / "s").rglob("*.tmp"))
    assert shardstore.open(tmp_path / "s").status().ok


def test_full_disk_leaves_the_rank_not_done_and_a_rerun_completes(checkpoints, tmp_path: Path) -> None:
    import subprocess
    import sys

    src = checkpoints(6)
    files = [str(f) for f in sorted(src.glob("rank*.pt"))]
    shardstore.ingest(tmp_path / "clean", files, jobs=1)
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                             text=True)  # a real, tiny disk
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()[:100]}); needs root")
    try:
        cmd = [sys.executable, "-m", "shardstore.cli", "ingest", str(disk / "s"), *files, "-j", "1", "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert "no space left on device" in proc.stderr and proc.stderr.count("\n") == 1
        done = shardstore.open(disk / "s").status()
        assert not done.ok and done.ranks_missing
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # free space
        assert subprocess.run(cmd).returncode == 0
        assert content(disk / "s") == content(tmp_path / "clean")
    finally:
        subprocess.run(["umount", str(disk)], check=True)
