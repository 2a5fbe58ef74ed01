"""Ingestion: idempotent, parallel or not, and a rank file from another checkpoint is refused untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import shardstore
from shardstore.errors import CheckpointError
from tests.conftest import sigkill_mid_way


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


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_new_store_reads_rank_0_once(checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       jobs: int) -> None:
    """Planning opens rank 0 whole; this process then ingests it from there (beside the workers, with
    jobs=2) instead of a worker reading it again, and closes it when done."""
    import importlib
    import os

    from shardstore.read.formats import rankfile

    ingest_module = importlib.import_module("shardstore.ingest")  # the package's `ingest` is the function

    opened: list[str] = []
    here: list[tuple[str, bool]] = []
    read, ingest_files = rankfile.read_rank_file, ingest_module.ingest_files

    def counting_read(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        opened.append(Path(path).name)
        return read(path, *args, **kwargs)

    def noting_ingest(store, paths, options, unit=None):  # type: ignore[no-untyped-def]
        here.extend((Path(path).name, unit is not None and i == 0) for i, path in enumerate(paths))
        return ingest_files(store, paths, options, unit)

    monkeypatch.setattr(rankfile, "read_rank_file", counting_read)
    monkeypatch.setattr(ingest_module, "ingest_files", noting_ingest)
    files = sorted(checkpoints(3).glob("rank*.pt"))
    shardstore.ingest(tmp_path / "s", files, jobs=jobs)
    if jobs == 1:
        assert sorted(opened) == ["rank0.pt", "rank1.pt", "rank2.pt"]
        assert here == [("rank0.pt", True), ("rank1.pt", False), ("rank2.pt", False)]
    else:  # the workers read ranks 1 and 2 in their own processes
        assert opened == ["rank0.pt"] and here == [("rank0.pt", True)]
    assert not [f for f in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{f}") == str(files[0])]
    shardstore.ingest(tmp_path / "other", files[::-1], jobs=1)  # rank 0 read by its own open
    assert content(tmp_path / "s") == content(tmp_path / "other")
    assert shardstore.open(tmp_path / "s").status().ok


def test_the_coordinator_keeps_the_records_its_workers_committed(checkpoints, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker hands back the commit records it wrote; the coordinator, assembling the staged arrays
    after the run, reads none of them back (on object storage, a request per rank file)."""
    from shardstore.store.store import Store

    loaded: list[str] = []
    decode = Store._decode_record

    def counting_decode(self, raw, key):  # type: ignore[no-untyped-def]
        loaded.append(key)  # (in the forked workers too, but into their own copy of the list)
        return decode(self, raw, key)

    monkeypatch.setattr(Store, "_decode_record", counting_decode)
    files = sorted(checkpoints(4).glob("rank*.pt"))
    store = shardstore.ingest(tmp_path / "s", files, jobs=2)
    assert loaded == []
    assert sorted(store.records()) == [0, 1, 2, 3] and store.status().ok
    assert sorted(Store.open(tmp_path / "s").records()) == [0, 1, 2, 3] and loaded  # the store's own, read back


def test_a_worker_reads_one_committed_record_not_every_one(checkpoints, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker checks its units against one committed unit's values, the lowest rank's (the coordinator
    checks every record as it arrives), and reads its own rank's record only if one is committed: on S3,
    every worker reading every other rank's record was 0.75 requests per rank file at world size 256."""
    from shardstore.ingest import IngestOptions, ingest_files
    from shardstore.store.store import Store

    files = sorted(checkpoints(4).glob("rank*.pt"))
    shardstore.ingest(tmp_path / "s", files[1:3], jobs=1)
    loaded: list[str] = []
    decode = Store._decode_record

    def counting_decode(self, raw, key):  # type: ignore[no-untyped-def]
        loaded.append(key.rsplit("/", 1)[-1])
        return decode(self, raw, key)

    monkeypatch.setattr(Store, "_decode_record", counting_decode)
    worker = Store.open(tmp_path / "s")  # a worker process's own
    ingest_files(worker, [files[3]], IngestOptions())
    assert loaded == ["1.json"]
    ingest_files(worker, [files[0], files[2]], IngestOptions())  # rank 2 again: its record is read, once
    assert loaded == ["1.json", "2.json"]
    assert sorted(Store.open(tmp_path / "s").records()) == [0, 1, 2, 3]


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


@pytest.mark.parametrize("world, seed", [(6, 1), (6, 2), (6, 3), (6, 4), (6, 5), (8, 1), (8, 2)])
def test_sigkill_at_any_moment_then_rerun_equals_a_clean_ingest(checkpoints, tmp_path: Path, world: int,
                                                                seed: int) -> None:
    """At W=6 one worker takes a file a task; at W=8 two (ingest._batches), committed together after
    one sync: a kill mid-batch leaves the batch's written units uncommitted, and nothing half-committed.
    (W=8 is the other tests' world: a world of its own costs more than every kill here.)"""
    import importlib
    import random
    import subprocess
    import sys

    src = checkpoints(world)
    files = [str(f) for f in sorted(src.glob("rank*.pt"))]
    shardstore.ingest(tmp_path / "clean", files, jobs=1)
    cmd = [sys.executable, "-m", "shardstore.cli", "ingest", str(tmp_path / "s"), *files, "-j", "1", "-q"]
    # the kill comes once seed % 5 ranks (W=8: seed batches) are committed, a moment into the next one
    batches = importlib.import_module("shardstore.ingest")._batches  # the package's `ingest` is the function
    assert [len(b) for b in batches(files, 1)] == ([1] * 6 if world == 6 else [2] * 4)
    sigkill_mid_way(cmd, tmp_path / "s", len(files), seed % 5 if world == 6 else 2 * seed,
                    delay=lambda attempt: random.Random(seed + attempt).uniform(0, 0.03) if attempt == 0 else 0)
    store = shardstore.open(tmp_path / "s")
    for rank, record in store.records().items():  # whatever is marked done is really there, whole
        for path, cells in record.cells.items():
            entry = store.manifest.arrays[path]
            for flat in cells:
                key = store.cell_key(path, entry.cell_index(flat))
                assert (tmp_path / "s" / key).read_bytes() == (tmp_path / "clean" / key).read_bytes(), key
        if record.staged:  # in its record (store format 3), or in a staging file
            staged = record.inline if record.inline is not None else (
                tmp_path / "s" / "__shardstore__" / "staging" / f"{rank}.bin").read_bytes()
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


def _steps(src: Path, out: Path) -> tuple[Path, Path]:
    """Two steps of one run, rank files of the same names and byte sizes: step 2 is step 1 with every
    rank's largest tensor storage changed, both written by one zip writer (valid CRCs, same layout)."""
    from tests.fixtures.forge import records, write_zip

    steps = out / "step1", out / "step2"
    for step in steps:
        step.mkdir(parents=True)
    for f in sorted(src.glob("rank*.pt")):
        entries = records(f)
        write_zip(steps[0] / f.name, entries)
        big = max(range(len(entries)), key=lambda i: len(entries[i][1]) if "/data/" in entries[i][0] else -1)
        name, data = entries[big]
        entries[big] = (name, bytes(b ^ 0x01 for b in data))  # a new step: every value moved a little
        write_zip(steps[1] / f.name, entries)
        assert (steps[0] / f.name).stat().st_size == (steps[1] / f.name).stat().st_size
    return steps


def _model(out: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    return {k: v.numpy().tobytes() for k, v in load_file(out / "model.safetensors").items()}


def test_a_store_reused_for_the_next_checkpoint_refuses_it(checkpoints, tmp_path: Path) -> None:
    """`unshard step2 --store S` after `unshard step1 --store S`: same names, same sizes, other contents.
    Refused in one line naming the rank, the file and the store, before any byte is written; the store
    still exports step 1 exactly."""
    step1, step2 = _steps(checkpoints(3), tmp_path)
    shardstore.unshard(step1, tmp_path / "out1", store=tmp_path / "S", jobs=2)
    before = content(tmp_path / "S")
    with pytest.raises(CheckpointError, match=r"step2/rank\d\.pt: .*/S already holds rank \d from another file "
                                              r"\(rank\d\.pt, with other contents\): the store holds another checkpoint"):
        shardstore.unshard(step2, tmp_path / "out2", store=tmp_path / "S", jobs=2)
    assert content(tmp_path / "S") == before and not (tmp_path / "out2" / "model.safetensors").exists()
    shardstore.export(tmp_path / "S", tmp_path / "again")
    assert _model(tmp_path / "again") == _model(tmp_path / "out1")
    shardstore.unshard(step2, tmp_path / "fresh2", store=tmp_path / "S2", jobs=2)
    assert _model(tmp_path / "fresh2") != _model(tmp_path / "out1")  # the steps really differ


def test_files_replaced_in_place_are_never_resumed_into_a_mix(checkpoints, tmp_path: Path) -> None:
    """A run stopped with part of step 1 in its scratch store; the job then saves step 2 over the same
    files (same names and sizes). The rerun starts again and exports step 2 exactly, not a mix."""
    step1, step2 = _steps(checkpoints(3), tmp_path)
    shardstore.unshard(step2, tmp_path / "want", store=tmp_path / "clean", jobs=2)
    folder, out = tmp_path / "latest", tmp_path / "out"
    folder.mkdir()
    for f in step1.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    files = sorted(folder.glob("rank*.pt"))
    shardstore.ingest(shardstore.scratch_location(out), files[:2], jobs=1)  # the run that stopped
    for f in step2.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())  # saved over, in place
    shardstore.unshard(folder, out, jobs=2)
    assert _model(out) == _model(tmp_path / "want")
    # a store of one's own is never silently restarted: the changed file is refused
    shardstore.ingest(tmp_path / "mine", [step1 / "rank0.pt"], jobs=1)
    with pytest.raises(CheckpointError, match="already holds rank 0 from another file"):
        shardstore.ingest(tmp_path / "mine", [step2 / "rank0.pt"], jobs=1)


@pytest.mark.parametrize("world", [1, 2])
def test_a_refused_first_file_leaves_no_store(tmp_path: Path, world: int) -> None:
    """A damaged first file (here: a value the store cannot keep, refused by its worker after the plan was
    made from it) leaves no store behind; the genuine files then ingest into the same path."""
    from tests.fixtures.forge import forge_sharded

    src = tmp_path / "ckpt"
    forge_sharded(src, [("rank0.pt", 0, "unstorable")] + [(f"rank{r}.pt", r, None) for r in range(1, world)], world)
    with pytest.raises(CheckpointError, match=r"rank0\.pt: info: cannot store a value of type ShardParamInfo"):
        shardstore.unshard(src, tmp_path / "out", store=tmp_path / "S", jobs=1)
    assert not (tmp_path / "S").exists()
    forge_sharded(src, [("rank0.pt", 0, None)], world)  # re-downloaded: the genuine file, of other keys
    shardstore.unshard(src, tmp_path / "out", store=tmp_path / "S", jobs=1)
    assert shardstore.open(tmp_path / "S")["step"] == 7 and shardstore.open(tmp_path / "S").status().ok


def test_a_refusal_never_removes_a_store_another_worker_is_committing_to(tmp_path: Path) -> None:
    """With two workers, rank 1 is refused while rank 0 is still being ingested: the store is kept
    (decided only once every running task has ended), with rank 0 committed, and the rerun completes it."""
    from tests.fixtures.forge import forge_sharded

    src = tmp_path / "ckpt"
    forge_sharded(src, [("rank0.pt", 0, None), ("rank1.pt", 1, "unstorable")], 2)
    with pytest.raises(CheckpointError, match=r"rank1\.pt: its keys differ from the checkpoint in the store"):
        shardstore.ingest(tmp_path / "S", [src / "rank0.pt", src / "rank1.pt"], jobs=2)  # planned from rank 0
    assert shardstore.open(tmp_path / "S").status().ranks_done == [0]
    forge_sharded(src, [("rank1.pt", 1, None)], 2)
    assert shardstore.ingest(tmp_path / "S", sorted(src.glob("rank*.pt")), jobs=2).status().ok


def test_a_batch_commits_the_units_written_before_a_refused_one(checkpoints, tmp_path: Path) -> None:
    """A worker's task is a batch of units synced once (ingest_files): a unit that is refused ends the
    batch, and the units written before it are still committed, whole, before the error is raised."""
    import importlib

    ingest_module = importlib.import_module("shardstore.ingest")
    files = sorted(checkpoints(4).glob("rank*.pt"))
    shardstore.ingest(tmp_path / "clean", files, jobs=1)
    store = shardstore.ingest(tmp_path / "s", files[:1], jobs=1)
    foreign = checkpoints(3) / "rank2.pt"  # another checkpoint's file
    with pytest.raises(CheckpointError, match="rank2.pt: sharded over groups of 3 ranks"):
        ingest_module.ingest_files(store, [files[1], files[2], foreign, files[3]])
    assert sorted(store.records()) == [0, 1, 2]  # the two before it, committed; the one after, never read
    clean = shardstore.open(tmp_path / "clean")
    for rank in (1, 2):
        for path, cells in store.records()[rank].cells.items():
            entry = store.manifest.arrays[path]
            for flat in cells:
                key = store.cell_key(path, entry.cell_index(flat))
                assert (tmp_path / "s" / key).read_bytes() == (tmp_path / "clean" / key).read_bytes(), key
    assert not list((tmp_path / "s").rglob("*.tmp"))
    shardstore.ingest(tmp_path / "s", files, jobs=1)
    assert content(tmp_path / "s") == content(tmp_path / "clean") and clean.status().ok


def test_two_files_of_one_rank_in_one_batch_are_refused(checkpoints, tmp_path: Path) -> None:
    import importlib
    import shutil

    ingest_module = importlib.import_module("shardstore.ingest")
    files = sorted(checkpoints(2).glob("rank*.pt"))
    store = shardstore.ingest(tmp_path / "s", files[:1], jobs=1)
    twin = tmp_path / "copy" / "rank1.pt"
    twin.parent.mkdir()
    shutil.copy(files[1], twin)
    with pytest.raises(CheckpointError, match=f"two files hold rank 1: {files[1]} and {twin}"):
        ingest_module.ingest_files(store, [files[1], twin])
    assert sorted(store.records()) == [0, 1]  # the first of the two, committed; the second never written


def test_tasks_batch_small_files_and_leave_large_ones_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of consecutive files: at most BATCH_FILES, at most BATCH_BYTES of them, and at least
    TASKS_PER_WORKER tasks for every worker."""
    import importlib

    ingest_module = importlib.import_module("shardstore.ingest")
    monkeypatch.setattr(ingest_module, "BATCH_BYTES", 1000)
    sizes = [100] * 64 + [5000, 100, 100]
    paths = []
    for i, size in enumerate(sizes):
        (tmp_path / f"rank{i}.pt").write_bytes(b"x" * size)
        paths.append(str(tmp_path / f"rank{i}.pt"))
    batches = ingest_module._batches(paths, 2)
    assert [p for b in batches for p in b] == paths  # every file once, in order
    assert [len(b) for b in batches] == [8] * 8 + [1, 2]  # 67 files // (2 workers * 4): 8 a task
    assert ingest_module._batches(paths, 16) == [[p] for p in paths]  # many workers: one file a task
    monkeypatch.setattr(ingest_module, "BATCH_BYTES", 250)
    assert [len(b) for b in ingest_module._batches(paths[:6], 1)] == [1] * 6  # 6 // 4 = 1
    assert [len(b) for b in ingest_module._batches(paths[:16], 1)] == [2] * 8  # bytes bound them first


def test_reading_ahead_a_batch_never_blocks_or_fails_on_a_file_that_is_not_one(tmp_path: Path) -> None:
    """The read-ahead hint over a batch's later files opens them without blocking: a FIFO in a rank file's
    place (no writer: a blocking open would hang the worker for ever), a missing file and a folder are
    passed over, left for the unit's own read to refuse in one line."""
    import importlib
    import os

    ingest_module = importlib.import_module("shardstore.ingest")
    os.mkfifo(tmp_path / "rank1.pt")
    (tmp_path / "rank2.pt").mkdir()
    (tmp_path / "rank3.pt").write_bytes(b"x" * 4096)
    ingest_module._prefetch([tmp_path / "rank1.pt", tmp_path / "rank2.pt", tmp_path / "missing.pt",
                             str(tmp_path / "rank3.pt"), "s3://bucket/rank4.pt"])
