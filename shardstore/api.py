"""The Python API: the things a user does. The CLI is a thin layer over exactly these; each builds its
request once (`RunRequest`, `ExportRequest`) and hands it to run.py or the export."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from . import base_folder
from .export import ExportResult, check_request
from .export import export as _export_store
from .ingest import Ingested
from .ingest import ingest as _ingest_files
from . import run as _run
from .average import average
from .errors import ExportError
from .export import registry
from .follow import Event, Following
from .follow import follow as _follow
from .locations import StorageOptions
from .progress import Progress
from .progress import resolve as _progress
from .read.discover import open_source, source_of_files
from .read.source import Source
from .run import Plan, scratch_location
from .runner import default_jobs
from .store.store import Store
from .verify import verify
from .watcher import Watching
from .watcher import watch as _watch

PathLike = str | os.PathLike[str]
INGEST_OPTIONS = frozenset({"verify_replicas", "scheduler", "strict"})


def open(location: PathLike, storage_options: StorageOptions | None = None) -> Store:  # noqa: A001
    """Open an existing store for reading (lazy tensors, values, status). `location` may be a URL."""
    return Store.open(location, storage_options)


def ingest(store: PathLike, files: Sequence[PathLike] | Source, jobs: int | None = None, *,
           progress: Progress | bool = False, on_done: Callable[[Ingested], None] | None = None,
           storage_options: StorageOptions | None = None, **options: Any) -> Store:
    """Ingest rank files (or a DCP checkpoint's .distcp files, or a `Source`) into `store` (created on first
    use); any subset, in any order, any number of times. `options`: `verify_replicas`, `scheduler`, `strict`.

    With hybrid sharding (HSDP) each shard is written once; `verify_replicas` checks the other copies match.
    `store` and `files` may be URLs (s3://...); `scheduler` ("dask", or a Dask scheduler address) runs one
    task per rank file on a Dask cluster instead of local worker processes. Objects of classes outside
    torch (a trainer's own) are kept as `Opaque` records; `strict` refuses them instead. `progress`: a
    `Progress`, or True for what the CLI shows (a bar per phase on a terminal, else one line per phase);
    `on_done` hears each unit as it is committed.
    """
    if isinstance(files, (str, os.PathLike)):  # one folder (or file), not the characters of its name
        files = [files]
    source = files if isinstance(files, Source) else source_of_files(list(files), storage_options)
    registry.known(options, INGEST_OPTIONS)
    return _ingest_files(store, source, jobs, progress=_progress(progress), on_done=on_done, **options)


def export(store: Store | PathLike, out_dir: PathLike, format: str = "safetensors", *,
           progress: Progress | bool = False, storage_options: StorageOptions | None = None,
           scheduler: str | None = None, jobs: int | None = None, **options: Any) -> ExportResult:
    """Write the unsharded checkpoint: `format="safetensors"` (model weights, HF-style), `"torch"`, `"dcp"`,
    or `"hf"` (a folder transformers loads; `hf_config` for checkpoints that carry no config of their own).
    `options` are `ExportRequest`'s fields (export/contract.py): `format`, `select`, `strip_prefix`,
    `dtype`, `keep_dtype`, `max_shard_size`, `hf_config`, `overwrite`, `allow_partial`, `single_file`, and for a
    PEFT model's adapter `adapter` (the adapter folder peft saves), `merge_adapter` (merged), `lora_alpha`
    and `rslora`.

    An incomplete store is refused unless `allow_partial` (holes become NaN, or zero for integers, and the
    output's metadata says so). Files an earlier export left in `out_dir` that this one would not replace
    are refused unless `overwrite` (which removes them once the new export is complete). `progress` as
    for `ingest`. `single_file`: `format="torch"` as one checkpoint.pt of the whole state in the input's
    nesting (what torch's dcp_to_torch_save writes), not the files the checkpoint's trainer resumes from."""
    request = registry.request(format, **options)
    st = store if isinstance(store, Store) else Store.open(store, storage_options)
    with base_folder.opened(request) as request:
        return _export_store(st, out_dir, request, _progress(progress), scheduler, jobs or default_jobs())


def watch(store: PathLike, src_dir: PathLike, *, on_done: Callable[[Ingested], None] | None = None,
          on_world_size: Callable[[int], None] | None = None, **options: Any) -> Store:
    """Ingest rank files as they arrive in `src_dir` until the store is complete (or `timeout` passes):
    `options` are `watcher.Watching`'s (`expect`, `timeout`, `poll`, `tag`, `jobs`, `storage_options`,
    `strict`)."""
    return _watch(store, src_dir, Watching(**options), on_done, on_world_size)


def rank_files(src_dir: PathLike, tag: str | None = None, step: int | None = None,
               storage_options: StorageOptions | None = None) -> list[str]:
    """The unit files (rank files, or a DCP checkpoint's .distcp files) of the checkpoint in `src_dir` (or
    of the one `tag`/`step` names), in order."""
    return open_source(src_dir, tag, step, storage_options).units


def unshard(src_dir: PathLike, out_dir: PathLike, *, progress: Progress | bool = False, plan: bool = False,
            **options: Any) -> ExportResult | Plan:
    """Ingest every rank file in `src_dir`, then export: `options` are `RunRequest`'s fields (run.py:
    `store`, `tag`, `step`, `jobs`, `verify_replicas`, `storage_options`, `scheduler`, `strict`) and the
    export's, as for `export`. Without `store`, a scratch store inside `out_dir` is used: see
    `scratch_location`. With `plan`, nothing is ingested or written: the `Plan` of the run, read from what
    planning needs, or its refusal."""
    request = _run.request(src_dir, out_dir, **options)
    if plan:
        return _run.dry_run(request)
    shown = _progress(progress)
    with _run.plan_run(request, progress=shown) as planned:
        return _run.execute(planned, shown)


def follow(run: PathLike, out: PathLike, *, every: int | None = None, keep: int | None = None, poll: float = 30.0,
           once: bool = False, on_event: Callable[[Event], None] | None = None,
           **options: Any) -> list[Event]:
    """Follow a running job's RUN folder (local, or on object storage): each checkpoint that becomes complete
    by its trainer's rule (follow.py) is unsharded into OUT/<its name>/, published by one rename, and
    OUT/latest then names it. `every`: only steps that are multiples of it; `keep`: the newest published
    folders kept; `poll`: seconds between looks; `once`: publish what is complete now and return. `options`
    are `unshard`'s (`jobs`, `storage_options`, `strict`, the export's), checked before anything is read;
    `on_event` hears each checkpoint published, skipped, removed. Runs until interrupted, unless `once`."""
    if keep is not None and keep < 1 or every is not None and every < 1 or poll <= 0:
        raise ExportError("keep and every are counts of at least 1, poll a number of seconds above 0")
    for held in ("store", "tag", "step"):
        if held in options:
            raise TypeError(f"follow names each checkpoint itself: {held!r} is not an option of it")
    check_request(out, _run.request(run, out, **options).export)
    how = Following(every, keep, poll, once, storage_options=options.get("storage_options"))

    def one(src: str, folder: Any, step: int) -> Any:
        return unshard(src, folder, step=step, **options)

    def begin(src: str, folder: Any, name: str, files: list[str]) -> tuple[int, int]:
        return _run.begin(_run.request(src, folder, tag=name, **options), files)
    return _follow(run, out, how, one, on_event or (lambda event: None), begin)


__all__ = ["open", "ingest", "watch", "export", "unshard", "verify", "average", "follow", "Plan", "rank_files",
           "scratch_location", "Progress"]
