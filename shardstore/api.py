"""The Python API: the four things a user does. The CLI is a thin layer over exactly these."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

from . import export as _export
from . import ingest as _ingest
from .errors import CheckpointError
from .locations import StorageOptions
from .read.layouts import discover, missing_ranks
from .store.store import Store

PathLike = str | os.PathLike[str]


def open(location: PathLike, storage_options: StorageOptions | None = None) -> Store:  # noqa: A001
    """Open an existing store for reading (lazy tensors, values, status). `location` may be a URL."""
    return Store.open(location, storage_options)


def ingest(store: PathLike, files: Sequence[PathLike], jobs: int | None = None,
           on_done: Callable[[_ingest.Ingested], None] | None = None, verify_replicas: bool = False,
           storage_options: StorageOptions | None = None, scheduler: str | None = None) -> Store:
    """Ingest rank files into `store` (created on first use); any subset, in any order, any number of times.

    With hybrid sharding (HSDP) each shard is written once; `verify_replicas` checks the other copies match.
    `store` and `files` may be URLs (s3://...); `scheduler` ("dask", or a Dask scheduler address) runs one
    task per rank file on a Dask cluster instead of local worker processes.
    """
    return _ingest.ingest(store, files, jobs=jobs, on_done=on_done, verify_replicas=verify_replicas,
                          storage_options=storage_options, scheduler=scheduler)


def export(store: Store | PathLike, out_dir: PathLike, format: str = "safetensors", select: str | None = None,
           strip_prefix: str | None = None, dtype: str | None = None, max_shard_size: int = 5_000_000_000,
           progress: Callable[[int], None] | None = None, allow_partial: bool = False,
           storage_options: StorageOptions | None = None, scheduler: str | None = None,
           jobs: int | None = None) -> _export.ExportResult:
    """Write the unsharded checkpoint: `format="safetensors"` (model weights, HF-style) or `"torch"`.

    An incomplete store is refused unless `allow_partial` (holes become NaN, or zero for integers, and the
    output's metadata says so)."""
    st = store if isinstance(store, Store) else Store.open(store, storage_options)
    return _export.export(st, out_dir, format=format, select=select, strip_prefix=strip_prefix, dtype=dtype,
                          max_shard_size=max_shard_size, progress=progress, allow_partial=allow_partial,
                          scheduler=scheduler, jobs=jobs or _ingest.default_jobs())


def watch(store: PathLike, src_dir: PathLike, expect: int | None = None, timeout: float | None = None,
          jobs: int | None = None, poll: float = 0.5, tag: str | None = None,
          on_done: Callable[[_ingest.Ingested], None] | None = None,
          on_world_size: Callable[[int], None] | None = None) -> Store:
    """Ingest rank files as they arrive in `src_dir` until the store is complete (or `timeout` passes)."""
    from .watch import watch as _watch

    return _watch(store, src_dir, expect=expect, timeout=timeout, jobs=jobs, poll=poll, tag=tag, on_done=on_done,
                  on_world_size=on_world_size)


def rank_files(src_dir: PathLike, tag: str | None = None, step: int | None = None,
               storage_options: StorageOptions | None = None) -> list[Path]:
    """The rank files of the checkpoint in `src_dir` (or of the one `tag`/`step` names), by rank."""
    return discover(src_dir, tag, step, storage_options)


def unshard(src_dir: PathLike, out_dir: PathLike, store: PathLike | None = None, tag: str | None = None,
            step: int | None = None, jobs: int | None = None, verify_replicas: bool = False,
            on_ingested: Callable[[_ingest.Ingested], None] | None = None,
            storage_options: StorageOptions | None = None, scheduler: str | None = None,
            **export_options: object) -> _export.ExportResult:
    """Ingest every rank file in `src_dir`, then export. Without `store`, a scratch store inside
    `out_dir` is used and removed afterwards (same file system, so copies stay kernel-side)."""
    files = discover(src_dir, tag, step, storage_options)
    out = Path(out_dir)
    location = store if store is not None else out / ".shardstore-scratch"  # may be a URL: no Path()
    def all_ranks_present(st: Store) -> None:
        missing = missing_ranks(files, st.manifest.world_size)
        if missing:
            raise CheckpointError(f"{src_dir}: world size is {st.manifest.world_size} but rank files are missing "
                                  f"for ranks {', '.join(map(str, missing[:20]))}{' ...' if len(missing) > 20 else ''}")

    try:
        def exported_subtree(st: Store) -> str | None:
            # A scratch store only feeds this export: for safetensors, write just the tensors it takes
            # (the model, not the optimizer state, which is usually twice its size).
            if store is not None or export_options.get("format", "safetensors") != "safetensors":
                return None
            select = export_options.get("select")
            return str(select) if select is not None else _export.model_subtree(st)

        st = _ingest.ingest(location, files, jobs=jobs, on_done=on_ingested, verify_replicas=verify_replicas,
                            on_created=all_ranks_present, storage_options=storage_options, scheduler=scheduler,
                            only=exported_subtree)
        fmt_is_safetensors = export_options.get("format", "safetensors") == "safetensors"
        return export(st, out, scheduler=scheduler if fmt_is_safetensors else None, jobs=jobs,
                      **export_options)  # type: ignore[arg-type]
    finally:
        if store is None:  # a scratch store is never left behind, finished or not (it is always local)
            shutil.rmtree(location, ignore_errors=True)


__all__ = ["open", "ingest", "watch", "export", "unshard", "rank_files"]
