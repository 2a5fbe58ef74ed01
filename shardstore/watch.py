"""Ingesting a checkpoint while it arrives: rank files are taken as soon as each one is complete.

A file counts as complete when it is a whole torch zip (its central directory, written last, is there)
and its size and mtime have not changed since the previous look; a file still being written or copied
is left alone until then. Files copied under a temporary name and renamed into place are only seen once
they have their final name. Ranks already committed to the store are not read again.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Callable

from .errors import CheckpointError, ShardstoreError
from .ingest import _SPAWN, IngestOptions, Ingested, _worker, create_store, default_jobs
from .locations import StorageOptions
from .read.container import TorchZip
from .read.layouts import name_rank, refuse_mixed, scan
from .read.source import Source
from .store.store import Store


def _complete(path: Path) -> bool:
    try:
        TorchZip(path).close()
        return True
    except ShardstoreError:
        return False


def watch(location: str | os.PathLike[str], src_dir: str | os.PathLike[str], expect: int | None = None,
          timeout: float | None = None, jobs: int | None = None, poll: float = 0.5, tag: str | None = None,
          on_done: Callable[[Ingested], None] | None = None,
          on_world_size: Callable[[int], None] | None = None, storage_options: StorageOptions | None = None,
          strict: bool = False) -> Store:
    """Ingest rank files from `src_dir` as they appear until the store is complete; returns the store.

    `expect` is the world size to wait for (default: the world size the first file declares); after
    `timeout` seconds a CheckpointError names the ranks still missing. `src_dir` is a local folder; the
    store may be anywhere (`storage_options` as for `ingest`).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    seen: dict[Path, tuple[int, int]] = {}
    submitted: dict[Path, Future[Ingested]] = {}
    store: Store | None = None
    try:
        store = Store.open(location, storage_options)
        done_ranks = set(store.records())
    except ShardstoreError:
        done_ranks = set()
    pool = ProcessPoolExecutor(max_workers=jobs or default_jobs(), mp_context=_SPAWN)
    try:
        while True:
            for path, fut in list(submitted.items()):
                if fut.done():
                    result = fut.result()  # a worker's error ends the watch, naming the file
                    done_ranks.add(result.rank)
                    del submitted[path]
                    if on_done:
                        on_done(result)
                    assert store is not None
                    store.assemble_ready()
            if store is not None:
                world = expect or store.manifest.world_size
                if not submitted and store.status().ok and len(done_ranks) >= world:
                    return store
            for path in _ready(src_dir, tag, seen):
                rank = name_rank(path)
                if path in submitted or rank in done_ranks:
                    continue
                if store is None:
                    store = create_store(location, Source("torch-save", [os.fspath(path)], storage_options), strict)
                    store.sweep_temporaries()
                    if expect is not None and expect != store.manifest.world_size:
                        raise CheckpointError(f"{path}: holds a checkpoint of world size "
                                              f"{store.manifest.world_size}, not the {expect} expected")
                    if on_world_size:
                        on_world_size(store.manifest.world_size)
                submitted[path] = pool.submit(_worker, store.location, os.fspath(path), IngestOptions(strict=strict),
                                              storage_options)
            if deadline is not None and time.monotonic() > deadline:
                world = expect or (store.manifest.world_size if store else None)
                missing = sorted(set(range(world)) - done_ranks) if world else []
                waiting = ", ".join(sorted(p.name for p in seen if p not in submitted and name_rank(p) not in done_ranks))
                raise CheckpointError(
                    f"{src_dir}: timed out after {timeout:g} s; "
                    + (f"ranks still missing: {', '.join(map(str, missing[:50]))}" if world else "no rank file arrived")
                    + (f" (incomplete or unreadable: {waiting})" if waiting else ""))
            time.sleep(poll)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _ready(src_dir: str | os.PathLike[str], tag: str | None, seen: dict[Path, tuple[int, int]]) -> list[Path]:
    """Files whose size and mtime held still since the last look and that are whole zips."""
    groups = scan(src_dir, tag)
    refuse_mixed(src_dir, groups, how="--tag")
    ready = []
    for ranks in groups.values():
        for path in ranks.values():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            stamp = (st.st_size, st.st_mtime_ns)
            if seen.get(path) == stamp and _complete(path):
                ready.append(path)
            seen[path] = stamp
    return ready
