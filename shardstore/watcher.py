"""Ingesting a checkpoint while it arrives: each unit file is taken as soon as its format says it is
complete (`Format.arrivals`, read/arrival.py: rank files, or a DCP folder's .distcp files once its .metadata
is there). Ranks already committed to the store are not read again.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import CheckpointError, ShardstoreError
from .ingest import Ingested, IngestOptions, _worker, create_store
from .locations import StorageOptions
from .read.arrival import Looks
from .read.discover import arriving
from .read.layouts import name_rank
from .read.source import Source
from .runner import Pool, default_jobs
from .store.store import Store


@dataclass(frozen=True)
class Watching:
    """How `watch` waits: `expect` is the world size to wait for (default: the world size the first file
    declares); after `timeout` seconds a CheckpointError names the ranks still missing; the folder is
    looked at every `poll` seconds. `tag`, `jobs`, `storage_options` (the store's) and `strict` as for
    `ingest`."""

    expect: int | None = None
    timeout: float | None = None
    poll: float = 0.5
    tag: str | None = None
    jobs: int | None = None
    storage_options: StorageOptions | None = None
    strict: bool = False


def watch(location: str | os.PathLike[str], src_dir: str | os.PathLike[str], how: Watching = Watching(),
          on_done: Callable[[Ingested], None] | None = None,
          on_world_size: Callable[[int], None] | None = None) -> Store:
    """Ingest rank files from `src_dir` (a local folder) as they appear until the store is complete;
    returns the store. `on_done` hears each unit as it is committed, `on_world_size` the world size once
    the first file says it."""
    expect, timeout, poll, tag = how.expect, how.timeout, how.poll, how.tag
    storage_options, strict = how.storage_options, how.strict
    deadline = None if timeout is None else time.monotonic() + timeout
    looks = Looks()
    submitted: dict[str, Future[list[Ingested]]] = {}
    store: Store | None = None
    try:
        store = Store.open(location, storage_options)
        done_ranks = set(store.records())
    except ShardstoreError:
        done_ranks = set()
    pool = Pool(how.jobs or default_jobs(), processes=True)  # files are taken while the next ones still arrive
    try:
        while True:
            for path, fut in list(submitted.items()):
                if fut.done():
                    result, = fut.result()  # a worker's error ends the watch, naming the file
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
            arrived = arriving(os.fspath(src_dir), tag, looks)
            source = arrived.source
            for path, rank in arrived.ready:
                if path in submitted or rank in done_ranks:
                    continue
                if store is None:
                    store = create_store(location, Source(source.format, source.units, storage_options), strict)
                    store.sweep_temporaries()
                    if expect is not None and expect != store.manifest.world_size:
                        raise CheckpointError(f"{path}: holds a checkpoint of world size "
                                              f"{store.manifest.world_size}, not the {expect} expected")
                    if on_world_size:
                        on_world_size(store.manifest.world_size)
                submitted[path] = pool.submit(_worker, store.location, [path],
                                              IngestOptions(strict=strict, format=source.format), storage_options)
            if deadline is not None and time.monotonic() > deadline:
                expected = expect or (store.manifest.world_size if store else None)
                missing = sorted(set(range(expected)) - done_ranks) if expected else []
                waiting = ", ".join(sorted(Path(p).name for p in looks.seen if p not in submitted
                                           and p.endswith(".pt") and name_rank(p) not in done_ranks))
                raise CheckpointError(
                    f"{src_dir}: timed out after {timeout:g} s; "
                    + (f"ranks still missing: {', '.join(map(str, missing[:50]))}" if expected else "no rank file arrived")
                    + (f" (incomplete or unreadable: {waiting})" if waiting else ""))
            time.sleep(poll)
    finally:
        pool.close()
