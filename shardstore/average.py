"""`average CKPT... OUT`: the (weighted) mean of several checkpoints of one run, written once.

Each checkpoint is read through the same readers and checks as `unshard` (any format it reads, any world
size each), its model's tensors into a scratch store beside OUT that is removed afterwards; their tensor
names, shapes and dtypes must agree. The export is then planned on the last one (its names, its Hugging
Face description) and written by the usual writer, each floating tensor's bytes being the mean of the
checkpoints' bytes, computed block by block in bounded memory:

    acc = w[0] * x[0];  acc = acc + w[1] * x[1];  ...  (in the order the checkpoints are given)

with w the weights normalised to sum to 1 (in float64, then as the accumulator), the accumulator float64
for float32 and float64 tensors and float32 otherwise, each product and sum rounded as IEEE arithmetic
rounds it, and the result rounded to nearest even into the tensor's dtype (or `dtype`'s). Tensors of
other dtypes (integer buffers) are the last checkpoint's, and said so.

A torch or DCP output (`--format torch`, `--format dcp`) is the whole last checkpoint, as `unshard`
writes it, with the model's floating tensors averaged in place (in DCP, each averaged tensor one chunk): the optimizer's state, step counters, RNG states and every other
value are the last checkpoint's, and said so. With `include_optimizer` every floating sharded tensor is
averaged, the optimizer's moments too; step counters and other small tensors still come from the last.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from . import dtypes
from .errors import ExportError
from .export import model_subtree, planned, registry
from .export.resolve import ArrayRef, leaves
from .export.safetensors import Stacked
from .ingest import ingest
from .run import model_store
from .paths import under
from .locations import nearest_existing
from .ranges import BLOCK, Part, blocks
from .read.discover import open_source
from .store.store import Store

MEAN_BLOCK = 4 << 20  # bytes of each checkpoint's tensor held at a time


@dataclass(frozen=True)
class MeanRef(ArrayRef):
    """An array of the output whose bytes are the weighted mean of the same array in several stores."""

    stores: tuple[Store, ...] = ()
    weights: tuple[float, ...] = ()
    stored: str = ""  # the stores' dtype of the array (`dtype` is the output's: rounded into once)

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[Part]:
        one = ArrayRef(self.path, self.stored, self.shape, self.rows)
        size = MEAN_BLOCK - MEAN_BLOCK % dtypes.info(self.stored).itemsize
        for raw in zip(*(_exact(one.parts(s), size) for s in self.stores)):
            yield mean(raw, self.weights, self.stored, self.dtype)

    def stored_crc(self, store: Store) -> int | None:
        return None


def mean(raw: Sequence[bytes | bytearray | memoryview], weights: Sequence[float], dtype: str, out: str) -> bytes:
    """The weighted mean of the same elements from each checkpoint (`raw`, in `dtype`), in `out`, as the
    module says."""
    info = dtypes.info(dtype)
    acc_type = np.float64 if dtype in ("float32", "float64") else np.float32
    total = float(np.sum(np.asarray(weights, dtype=np.float64)))
    acc = None
    for w, data in zip(weights, raw):
        x = dtypes.as_numbers(np.frombuffer(data, dtype=info.raw), dtype).astype(acc_type)
        term = np.multiply(np.asarray(np.float64(w) / total, dtype=acc_type), x)
        acc = term if acc is None else np.add(acc, term)
    assert acc is not None
    return dtypes.rounded(acc, out)


def _exact(parts: Iterator[Part], size: int) -> Iterator[bytes]:
    """The bytes of `parts` in blocks of exactly `size` (the last one shorter): the stores of different
    world sizes cut the same array at different places."""
    pending = bytearray()
    for block in blocks(parts, min(size, BLOCK)):
        pending += block
        while len(pending) >= size:
            yield bytes(pending[:size])
            del pending[:size]
    if pending:
        yield bytes(pending)


@dataclass
class AverageResult:
    files: list[Path]
    averaged: int  # tensors
    kept: list[str]  # tensors taken from the last checkpoint (not floating; for torch, the optimizer's too)
    values: int = 0  # other leaves taken from the last checkpoint (torch output: counters, RNG states, ...)


# the export's options `average` takes (the others do not apply to a new folder of averaged tensors)
OPTIONS = frozenset({"format", "select", "strip_prefix", "dtype", "hf_config", "max_shard_size"})


def average(checkpoints: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str],
            weights: Sequence[float] | None = None, *, include_optimizer: bool = False, jobs: int | None = None,
            **options: Any) -> AverageResult:
    """The weighted mean of `checkpoints` (folders, each as `unshard` takes them) into `out_dir`, as a
    safetensors or Hugging Face export (`options`, `OPTIONS`, as `unshard`'s), or as the torch files of the
    whole last checkpoint with the model's tensors (all floating tensors, `include_optimizer`) averaged."""
    registry.known(options, OPTIONS)
    if len(checkpoints) < 2:
        raise ExportError("average takes two checkpoints or more")
    weights = tuple(float(w) for w in (weights or [1.0] * len(checkpoints)))
    if len(weights) != len(checkpoints) or not all(w >= 0 for w in weights) or sum(weights) <= 0:
        raise ExportError(f"--weights: {len(checkpoints)} non-negative numbers, not all zero, one per checkpoint")
    request = registry.request(**options)  # an unknown format refused here
    format, select, whole = request.format, request.select, not request.output.subtree
    if include_optimizer and not whole:
        raise ExportError(f"--include-optimizer: a {format} output holds the model only; use --format torch or dcp")
    if whole and (request.dtype or request.strip_prefix or request.hf_config):
        raise ExportError(f"--format {format} writes the last checkpoint as it is: --dtype, --strip-prefix and "
                          "--hf-config are for safetensors and hf outputs")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out}: not empty; average writes into a new or empty folder")
    sources = [open_source(c) for c in checkpoints]
    scratch = Path(tempfile.mkdtemp(prefix=".shardstore-average-", dir=nearest_existing(out.absolute())))

    try:
        # what is averaged, from every checkpoint; a torch output's everything else from the last one
        stores = [ingest(scratch / str(i), source, jobs) if include_optimizer or (whole and i == len(sources) - 1)
                  else model_store(scratch / str(i), source, jobs, select) for i, source in enumerate(sources)]
        averaged = "" if include_optimizer else select if select is not None else model_subtree(stores[-1])
        _same_tensors(stores, [str(c) for c in checkpoints], averaged)
        means = _Means(tuple(stores), weights, averaged)
        plan = planned(stores[-1], replace(request, arrays=means))
        for it in plan.tensors:
            if not all(isinstance(one.source, ArrayRef) for one in (it.source.items if isinstance(it.source, Stacked)
                                                                    else (it,))):
                raise ExportError(f"{it.key}: a small plain tensor; average reads sharded tensors only")
        out.mkdir(parents=True, exist_ok=True)
        files, _, _ = plan.write(out, None, None, None, 1)
        if not whole:  # counted by the output's tensors
            kept = [it.key for it in plan.tensors if it.source.dtype not in dtypes.CASTABLE]
            return AverageResult(files, len(plan.tensors) - len(kept), kept)
        last = stores[-1].manifest
        values = sum(1 for _, path in leaves(last.tree) if path not in last.arrays)
        return AverageResult(files, len(means.averaged), sorted(set(means.kept)), values)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _Means:
    """Where an export of the last store reads each sharded array's bytes (`ExportRequest.arrays`): the
    stores' weighted mean, rounded once into the output's dtype, for a floating array under `averaged`
    ("" for all); the last store's own bytes for the rest (`kept`). One reference per array and dtype: a
    tied tensor stays one storage."""

    def __init__(self, stores: tuple[Store, ...], weights: tuple[float, ...], averaged: str):
        self.stores, self.weights, self.under = stores, weights, averaged
        self.refs: dict[tuple[ArrayRef, str], ArrayRef] = {}
        self.averaged: set[str] = set()
        self.kept: list[str] = []

    def __call__(self, ref: ArrayRef, dtype: str) -> ArrayRef:
        if (ref, dtype) not in self.refs:
            if ref.dtype in dtypes.CASTABLE and under(ref.path, self.under):
                self.refs[ref, dtype] = MeanRef(ref.path, dtype, ref.shape, ref.rows, self.stores, self.weights,
                                                ref.dtype)
                self.averaged.add(ref.path)
            else:
                self.refs[ref, dtype] = ref
                self.kept.append(ref.path)
        return self.refs[ref, dtype]


def _same_tensors(stores: list[Store], names: list[str], subtree: str) -> None:
    """Refuse checkpoints whose tensors under `subtree` ("" for all) differ in name, shape or dtype, naming
    the first."""
    def tensors(st: Store) -> dict[str, Any]:
        return {p: (a.dtype, a.shape) for p, a in st.manifest.arrays.items() if under(p, subtree)}

    last = tensors(stores[-1])
    for st, name in zip(stores[:-1], names):
        mine = tensors(st)
        for path in sorted(set(mine) | set(last)):
            if mine.get(path) != last.get(path):
                def said(t: Any) -> str:
                    return "no such tensor" if t is None else f"{t[0]}{list(t[1])}"
                raise ExportError(f"{name}: {path} is {said(mine.get(path))} here but {said(last.get(path))} in "
                                  f"{names[-1]}; average takes checkpoints of one model")
