"""Ingesting a checkpoint while it arrives: rank files (or a DCP folder's .distcp files, once its
.metadata is there) are taken as soon as each one is complete.

A file counts as complete when it is a whole torch zip (its central directory, written last, is there)
and its size and mtime have not changed since the previous look; a file still being written or copied
is left alone until then. Files copied under a temporary name and renamed into place are only seen once
they have their final name. Ranks already committed to the store are not read again.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from .errors import CheckpointError, ShardstoreError
from .ingest import IngestOptions, Ingested, _worker, create_store
from .runner import Pool, default_jobs
from .locations import StorageOptions
from .read.container import TorchZip
from .read.dcp import METADATA, DcpCheckpoint, read_checkpoint
from .read.layouts import name_rank, refuse_mixed, scan
from .read.dcp import dcp_folder
from .read.folder import FolderFormat
from .read.registry import fallback, formats
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
    parsed: dict[tuple[int, int], DcpCheckpoint] = {}  # a DCP folder's .metadata, by its size and mtime
    store: Store | None = None
    try:
        store = Store.open(location, storage_options)
        done_ranks = set(store.records())
    except ShardstoreError:
        done_ranks = set()
    pool = Pool(jobs or default_jobs(), processes=True)  # files are taken while the next ones still arrive
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
            source, ready = _arrivals(src_dir, tag, seen, parsed)
            for path, rank in ready:
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
                submitted[path] = pool.submit(_worker, store.location, os.fspath(path),
                                              IngestOptions(strict=strict, format=source.format), storage_options)
            if deadline is not None and time.monotonic() > deadline:
                world = expect or (store.manifest.world_size if store else None)
                missing = sorted(set(range(world)) - done_ranks) if world else []
                waiting = ", ".join(sorted(p.name for p in seen if p not in submitted and p.suffix == ".pt"
                                           and name_rank(p) not in done_ranks))
                raise CheckpointError(
                    f"{src_dir}: timed out after {timeout:g} s; "
                    + (f"ranks still missing: {', '.join(map(str, missing[:50]))}" if world else "no rank file arrived")
                    + (f" (incomplete or unreadable: {waiting})" if waiting else ""))
            time.sleep(poll)
    finally:
        pool.close()


def _arrivals(src_dir: str | os.PathLike[str], tag: str | None, seen: dict[Path, tuple[int, int]],
              parsed: dict[tuple[int, int], DcpCheckpoint]) -> tuple[Source, list[tuple[Path, int]]]:
    """The checkpoint arriving in `src_dir`, and its unit files that are whole: (path, unit number) each.

    A DCP folder counts once its .metadata reads (torch writes it last; a copy may bring it first) and
    then each .distcp file once it reaches the end of the last item .metadata places in it. Rank files
    count when they are whole zips. Either way a file must also have held still since the last look."""
    found = dcp_folder(os.fspath(src_dir), tag, None, None)
    if found is not None:
        folder = Path(found)
        ckpt = _metadata(folder, parsed)
        if ckpt is None:
            return Source("dcp", []), []  # still being written: look again
        ends: dict[str, int] = {}
        for item in ckpt.items:
            ends[item.file] = max(ends.get(item.file, 0), item.offset + item.length)
        units = [folder / f for f in ckpt.files]
        return Source("dcp", [str(u) for u in units]), [
            (path, i) for i, path in enumerate(units) if _still(path, seen, lambda p, size: size >= ends[p.name])]
    for fmt in formats():
        if isinstance(fmt, FolderFormat) and fmt.module.detect(os.fspath(src_dir)):
            raise CheckpointError(f"{src_dir}: a checkpoint in the {fmt.title} format; watch takes rank files or a DCP folder "
                                  f"(ingest this one with `shardstore ingest` or `unshard` once it is complete)")
    groups = scan(src_dir, tag)
    refuse_mixed(src_dir, groups, how="--tag")
    ready = [(path, rank) for ranks in groups.values() for rank, path in ranks.items()
             if _still(path, seen, lambda p, size: _complete(p))]
    first = [str(p) for p, _ in ready[:1]]  # rank files of ShardedTensors, or of DTensors (plain FSDP2)
    return (fallback().of_files(first, None) if first else Source(fallback().name, [])), ready


def _metadata(folder: Path, parsed: dict[tuple[int, int], DcpCheckpoint]) -> DcpCheckpoint | None:
    """The folder's .metadata, parsed once per version of the file (it can be tens of MB at scale), or
    None while it does not read yet."""
    try:
        st = (folder / METADATA).stat()
    except FileNotFoundError:
        return None
    stamp = (st.st_size, st.st_mtime_ns)
    if stamp not in parsed:
        try:
            parsed.clear()
            parsed[stamp] = read_checkpoint(folder)
        except CheckpointError:
            return None
    return parsed[stamp]


def _still(path: Path, seen: dict[Path, tuple[int, int]], whole: Callable[[Path, int], bool]) -> bool:
    """Whether `path` has the same size and mtime as at the last look, and is `whole`."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    stamp = (st.st_size, st.st_mtime_ns)
    ready = seen.get(path) == stamp and whole(path, st.st_size)
    seen[path] = stamp
    return ready
