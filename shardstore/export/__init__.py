"""Export: one module per output format, each reading only through the store's API, all streaming."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import ExportError, StoreError
from ..store.store import Status, Store
from .resolve import leaves, node_at
from .safetensors import export_safetensors
from .torch import export_torch

FORMATS = ("safetensors", "torch")
CAST_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class ExportResult:
    files: list[Path]
    skipped: list[str] = field(default_factory=list)  # non-tensor leaves a safetensors file cannot hold
    partial: dict[str, str] | None = None  # set when holes were filled (--allow-partial)


def model_subtree(store: Store) -> str:
    """Where the model weights are, by layout: `model` (OLMo), `state/model` (Composer), else the root."""
    for candidate in ("model", "state/model"):
        try:
            node_at(store.manifest.tree, candidate)
            return candidate
        except ExportError:
            continue
    return ""


def _scoped(status: Status, node: dict) -> Status:
    """The status of just the tensors below `node`: missing ranks matter only if they hold values there."""
    inside = {path for _, path in leaves(node)}
    partial = {p: f for p, f in status.partial.items() if p in inside}
    values_inside = any(p not in status.complete and p not in status.partial for p in inside)
    missing = status.ranks_missing if values_inside else []
    return Status(status.world_size, status.ranks_done, missing, [p for p in status.complete if p in inside], partial)


def export(store: Store, out_dir: str | os.PathLike[str], format: str = "safetensors", select: str | None = None,
           strip_prefix: str | None = None, dtype: str | None = None, max_shard_size: int = 5_000_000_000,
           progress: Callable[[int], None] | None = None, allow_partial: bool = False,
           scheduler: str | None = None, jobs: int = 1) -> ExportResult:
    """Write the unsharded checkpoint from `store` into `out_dir` (see the README for the formats).

    An incomplete store is refused unless `allow_partial`: then missing pieces are holes (NaN, or zero for
    integer dtypes) and the output's metadata says which ranks and tensors were missing. With `scheduler`,
    each safetensors file is written by one Dask task.
    """
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in CAST_DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(CAST_DTYPES)}, not {dtype!r}")
    full = status = store.status()
    node = None
    if format == "safetensors":  # only the exported subtree has to be complete
        node = node_at(store.manifest.tree, model_subtree(store) if select is None else select)
        status = _scoped(full, node)
    partial = None
    if not status.ok and allow_partial:
        if not status.ranks_done:
            raise StoreError(f"{store.location}: no rank has been ingested; nothing to export")
        partial = {"shardstore_partial": "true",
                   "shardstore_missing_ranks": ",".join(map(str, full.ranks_missing)),
                   "shardstore_incomplete_tensors": ",".join(sorted(status.partial))}
    elif not status.ok:
        missing = ", ".join(map(str, full.ranks_missing[:20])) + (" ..." if len(full.ranks_missing) > 20 else "")
        raise StoreError(f"{store.location}: incomplete store, cannot export; ranks missing: {missing or 'none'}"
                         f"; tensors incomplete: {len(status.partial)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if format == "torch":
        if scheduler:
            raise ExportError("--scheduler exports safetensors only (a torch file is one stream)")
        if select or strip_prefix or dtype:
            raise ExportError("--select, --strip-prefix and --dtype apply to safetensors output only")
        return ExportResult(export_torch(store, out, progress, partial), partial=partial)
    assert node is not None
    files, skipped = export_safetensors(store, out, node, strip_prefix, dtype, max_shard_size, progress, partial,
                                        scheduler, jobs)
    return ExportResult(files, skipped, partial)
