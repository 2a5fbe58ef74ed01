"""`--format safetensors`: the model weights, HF-style, streamed tensor by tensor.

All shapes are known up front, so each file's header is written first and the data follows; without a
dtype cast, bytes go from the store's shard files to the output kernel-side (copy_file_range). Files
above `max_shard_size` are split `model-00001-of-0000N.safetensors` with a `model.safetensors.index.json`
written last, as transformers' `save_pretrained` does. In one pass (`plan_direct`) the same files are
laid out before any unit is read, and the workers write every tensor's bytes where the header says.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .. import dtypes, jsonin
from ..errors import ExportError
from ..patterns import matcher, nearest
from ..ranges import blocks
from ..runner import Pool
from ..sink.layout import Layout, Target, new_layout, prepare
from ..sink.output import OutputFile
from ..store.store import Store
from ..tree import Node
from . import quantized
from .contract import Arrays, DirectExport, ExportRequest, OutputFormat, Planned, Progress, Written
from .notes import flat_buckets
from .resolve import ArrayRef, Rows, build, leaves, tensors_only



@dataclass
class Item:
    key: str
    source: Any  # ArrayRef, or a torch.Tensor decoded from the store
    dtype: str  # output dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.info(self.dtype).itemsize


def collect(store: Store, node: Node, strip_prefix: str | None, cast: Callable[[str], str | None],
            arrays: Arrays | None = None) -> tuple[list[Item], list[str]]:
    """The tensors below `node` with their output keys, and the non-tensor leaves that were left out."""
    items, skipped, seen = [], [], set()
    for keys, path in leaves(node):
        key = ".".join(str(k) for k in keys)
        if strip_prefix and key.startswith(strip_prefix):
            key = key[len(strip_prefix):]
        item = tensor_item(store, key, path, cast(key), arrays=arrays)
        if item is None:
            skipped.append(path)
            continue
        if key in seen:
            raise ExportError(f"two tensors would both be named {key!r} in the output")
        seen.add(key)
        items.append(item)
    if not items:
        raise ExportError("no tensors to export in the selected subtree")
    return items, skipped


def tensor_item(store: Store, key: str, path: str, cast: str | None, rows: Rows | None = None,
                arrays: Arrays | None = None) -> Item | None:
    """Output tensor `key` from the store's leaf `path` (only those blocks of its `rows`, one after another,
    if given), or None when the leaf is not a tensor. Floating tensors are cast to `cast`; a sharded one's
    bytes come from `arrays` where it is given (`ExportRequest.arrays`)."""
    if path in store.manifest.facts.not_tensors:
        return None
    entry = store.manifest.arrays.get(path)
    if rows is not None and (not rows or entry is not None and not all(
            0 <= a < b <= entry.shape[0] for a, b in rows)):
        raise ExportError(f"{path}: rows {list(rows)} are not blocks of its {entry.shape[0] if entry else 0} rows")
    if entry is not None:
        shape = entry.shape if rows is None else (sum(b - a for a, b in rows),) + tuple(entry.shape[1:])
        source: Any = ArrayRef(path, entry.dtype, shape, rows)
        dtype = entry.dtype
    else:
        source = build(store, Node("leaf", path))
        torch = sys.modules.get("torch")  # decoding a plain tensor imports torch; nothing else needs it
        if torch is None or not isinstance(source, torch.Tensor):
            return None
        if rows is not None:
            source = torch.cat([source[a:b] for a, b in rows])
        dtype, shape = str(source.dtype).removeprefix("torch."), tuple(source.shape)
    if key == "__metadata__":
        raise ExportError(f"{path}: would be named '__metadata__', which safetensors reserves for its header; "
                          f"choose another --select or --strip-prefix")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise ExportError(f"{path}: its key {key!r:.80} is not valid Unicode, which a safetensors header "
                          f"must be") from None
    if dtypes.info(dtype).safetensors is None:
        raise ExportError(f"{path}: torch.{dtype} has no safetensors dtype")
    out = cast if cast and dtype in dtypes.CASTABLE else dtype
    return Item(key, arrays(source, out) if arrays is not None and entry is not None else source, out, shape)


@dataclass(frozen=True)
class Stacked:
    """An output tensor the checkpoint holds as several of one shape and dtype (GPT-OSS's experts, one Hugging
    Face tensor per layer): stacked on a new leading axis, each one's rows first dealt out `interleave` ways
    (row i of its block b becomes row i * interleave + b: [gate; up] as gate, up, gate, up...) and then its
    last two axes swapped (`transpose`). Streamed one at a time: memory holds one of them, twice (as read and
    as moved), never the stack; each output byte is written once, in order."""

    items: tuple[Item, ...]
    interleave: int = 1
    transpose: bool = False

    @property
    def dtype(self) -> str:
        return self.items[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        one = self.items[0].shape
        return (len(self.items),) + (one[:-2] + (one[-1], one[-2]) if self.transpose else one)

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[memoryview]:
        raw = dtypes.info(self.dtype).raw  # the bits as they are: the move is exact for every dtype
        for it in self.items:
            values = np.frombuffer(b"".join(blocks(tensor_bytes(store, it, allow_partial))), raw).reshape(it.shape)
            rows = values.shape[0]
            moved = values.reshape(self.interleave, rows // self.interleave, *values.shape[1:]).swapaxes(0, 1)
            moved = moved.reshape(values.shape)
            moved = np.ascontiguousarray(moved.swapaxes(-1, -2) if self.transpose else moved)
            yield moved.reshape(-1).view(np.uint8).data


def stacked_item(store: Store, key: str, paths: list[str], cast: str | None, interleave: int = 1,
                 transpose: bool = False, arrays: Arrays | None = None) -> Item:
    """Output tensor `key` from the store's leaves `paths` (see `Stacked`), floating ones cast to `cast` (each
    as it is read: the stacking moves them exactly); each must be a tensor of the first one's shape and
    dtype, whose rows `interleave` divides."""
    items: list[Item] = []
    for path in paths:
        it = tensor_item(store, key, path, cast, arrays=arrays)
        if it is None:
            raise ExportError(f"{path}: not a tensor, but {key} is stacked from it")
        first = items[0] if items else it
        if (it.shape, it.dtype) != (first.shape, first.dtype):
            raise ExportError(f"{path}: {it.dtype} {list(it.shape)}, but {paths[0]} is {first.dtype} "
                              f"{list(first.shape)}; {key} stacks them")
        items.append(it)
    one = items[0].shape if items else ()
    if not items or not one or one[0] % interleave or transpose and len(one) < 2:
        raise ExportError(f"{paths[0] if paths else key}: shape {list(one)} cannot be stacked into {key} "
                          f"({interleave}-way rows{', transposed' if transpose else ''})")
    source = Stacked(tuple(items), interleave, transpose)
    return Item(key, source, source.dtype, source.shape)


def header(items: list[Item], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
    offset = 0
    for it in items:
        header[it.key] = {"dtype": dtypes.info(it.dtype).safetensors, "shape": list(it.shape),
                          "data_offsets": [offset, offset + it.nbytes]}
        offset += it.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def tensor_bytes(store: Store, it: Item, allow_partial: bool = False) -> Iterator[Any]:
    """The bytes an export writes for `it`: streamed from the store, cast where its dtype is another."""
    if not isinstance(it.source, (ArrayRef, Stacked)):  # a plain tensor decoded from the store (so torch is loaded)
        import torch

        t = it.source.to(getattr(torch, it.dtype)).contiguous()
        if t.numel():
            yield t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return
    parts = it.source.parts(store, allow_partial)
    if it.dtype == it.source.dtype:
        yield from parts
        return
    yield from dtypes.cast(parts, dtypes.info(it.source.dtype), it.dtype)


def _split(items: list[Item], max_shard_size: int) -> list[list[Item]]:
    files: list[list[Item]] = [[]]
    size = 0
    for it in items:
        if files[-1] and size + it.nbytes > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(it)
        size += it.nbytes
    return files


def write_file(store: Store, path: Path, group: list[Item], partial: dict[str, str] | None,
               progress: Callable[[int], None] | None = None, metadata: dict[str, str] | None = None) -> Path:
    """One safetensors file: header first, then every tensor streamed from the store."""
    with OutputFile(path, progress) as out:
        out.write(header(group, {**(metadata or {}), **(partial or {})}))
        for it in group:
            out.write_parts(tensor_bytes(store, it, partial is not None))
    return path


def _write_file_task(location: str, storage_options: dict[str, Any], path: str, group: list[Item],
                     partial: dict[str, str] | None, metadata: dict[str, str]) -> Path:
    return write_file(Store.open(location, storage_options), Path(path), group, partial, metadata=metadata)


INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


@dataclass
class SafetensorsPlan:
    """What a safetensors export will write, known before the first byte: file names and their tensors."""

    names: list[str]
    groups: list[list[Item]]
    skipped: list[str]
    metadata: dict[str, str] = field(default_factory=dict)  # every header's, beside "format"

    @property
    def files(self) -> list[str]:
        return self.names + ([INDEX] if len(self.groups) > 1 else [])

    @property
    def nbytes(self) -> int:
        return sum(it.nbytes for group in self.groups for it in group)


def plan_safetensors(store: Store, node: Node, request: ExportRequest) -> SafetensorsPlan:
    """The store's tensors below `node`; those of an FP8 model with block scales dequantized into `--dtype`
    (export/fp8.py: its config.json kept beside the checkpoint gives the blocks)."""
    items, skipped = collect(store, node, request.strip_prefix, request.cast_of, request.arrays)
    kept = store.manifest.facts.side_files.get("config.json")
    config = jsonin.loads(base64.b64decode(kept), "config.json") if kept and request.dtype else None
    return plan_items(quantized.dequantize(items, config if isinstance(config, dict) else None, request.dtype), skipped,
                      request)


def plan_items(items: list[Item], skipped: list[str], request: ExportRequest) -> SafetensorsPlan:
    """Files for `items` in order, a new file whenever the next tensor would pass the request's
    `max_shard_size`; a `--keep-dtype` pattern that keeps none of them refused (`check_keep_dtype`)."""
    check_keep_dtype(request, [it.key for it in items])
    groups = _split(items, request.max_shard_size)
    names = ([SINGLE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    return SafetensorsPlan(names, groups, skipped, request.metadata())


def check_keep_dtype(request: ExportRequest, keys: list[str]) -> None:
    """A `--keep-dtype` pattern that matches no output tensor is a typo (`*nrom*`), not a choice: it would
    leave every tensor cast without a word. Refused before anything is written, naming the nearest name."""
    for pattern in request.keep_dtype:
        match = matcher(pattern, "--keep-dtype", ExportError)
        if not any(match(key) for key in keys):
            raise ExportError(f"--keep-dtype {pattern!r}: matches no tensor of the output; the nearest output "
                              f"name is {nearest(pattern, keys)!r}")


def export_safetensors(store: Store, out_dir: Path, plan: SafetensorsPlan, progress: Callable[[int], None] | None = None,
                       partial: dict[str, str] | None = None, scheduler: str | None = None,
                       jobs: int = 1) -> list[Path]:
    """Write the planned files. `partial` (metadata describing holes) allows an incomplete store.

    With `scheduler`, each output file is one Dask task (OUT must be reachable from the workers).
    """
    names, groups = plan.names, plan.groups
    items = [it for group in groups for it in group]
    if scheduler is None:
        written = [write_file(store, out_dir / name, group, partial, progress, plan.metadata)
                   for name, group in zip(names, groups)]
    else:
        args = [(store.location, store.storage_options, str(out_dir / name), group, partial, plan.metadata)
                for name, group in zip(names, groups)]
        written = []
        with Pool(jobs, scheduler) as pool:
            pool.run(_write_file_task, args, [f"export-{n}" for n in names], lambda path: written.append(Path(path)))
        written.sort()
        if progress:
            progress(sum(it.nbytes for it in items))
    return written + write_index(out_dir, plan)


def write_index(out_dir: Path, plan: SafetensorsPlan) -> list[Path]:
    """model.safetensors.index.json where the export is split, as transformers' save_pretrained writes it
    (total_parameters since transformers 4.47)."""
    if len(plan.groups) == 1:
        return []
    items = [it for group in plan.groups for it in group]
    index = {"metadata": {"total_parameters": sum(math.prod(it.shape) for it in items),
                          "total_size": sum(it.nbytes for it in items)},
             "weight_map": {it.key: name for name, group in zip(plan.names, plan.groups) for it in group}}
    with OutputFile(out_dir / INDEX) as out:
        out.write(json.dumps(index, indent=2).encode() + b"\n")
    return [out_dir / INDEX]


# ---------------------------------------------------------------------------------------------- one pass
@dataclass(frozen=True)
class SafetensorsDirect(DirectExport):
    layout: Layout
    plan: SafetensorsPlan

    @property
    def files(self) -> list[str]:
        return self.plan.files

    @property
    def skipped(self) -> list[str]:
        return self.plan.skipped

    @property
    def notes(self) -> list[str]:
        return flat_buckets(it.key for it in self.tensors)

    @property
    def tensors(self) -> list[Any]:
        return [it for group in self.plan.groups for it in group]

    def finish(self, store: Store, out: Path) -> list[Path]:
        return write_index(out, self.plan)


def direct_layout(store: Store, plan: SafetensorsPlan) -> Layout:
    """The files of `plan`, laid out and prepared: every tensor an array of the store's plan (the caller
    made sure), the header first, every tensor's bytes where it says; a row block of a split weight
    (`att_proj` -> q, k, v) a box of the fused array."""
    targets: dict[str, list[Target]] = {}
    sizes, heads = [], []
    for i, group in enumerate(plan.groups):
        head = header(group, plan.metadata)
        offset = len(head)
        for item in group:
            ref = item.source
            assert isinstance(ref, ArrayRef), item.key  # plain values never reach a one-pass plan
            if ref.rows is None:
                targets.setdefault(ref.path, []).append(Target(i, offset, None, item.dtype))
                offset += item.nbytes
                continue
            shape = store.manifest.arrays[ref.path].shape
            row = item.nbytes // ref.shape[0] if ref.shape[0] else 0  # one row, in the output's dtype
            for first, stop in ref.rows:  # each block where the ones before it end
                box = ((first,) + (0,) * (len(shape) - 1), (stop - first,) + shape[1:])
                targets.setdefault(ref.path, []).append(Target(i, offset, box, item.dtype))
                offset += (stop - first) * row
        sizes.append(offset)
        heads.append([(0, head)])
    lay = new_layout(store, plan.names, sizes, targets)
    prepare(store, lay, heads)
    return lay


def plan_direct(store: Store, plan: SafetensorsPlan) -> SafetensorsDirect:
    return SafetensorsDirect(direct_layout(store, plan), plan)


def _plan(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    return planned_safetensors(store, plan_safetensors(store, node, request))


def planned_safetensors(store: Store, plan: SafetensorsPlan, notes: list[str] | None = None) -> Planned:
    """The export of `plan`'s tensors; its notes `notes` and which tensors' names are spelt alike."""
    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        files = export_safetensors(store, out, plan, progress, partial, scheduler, jobs)
        return files, plan.skipped, (notes or []) + flat_buckets(it.key for group in plan.groups for it in group)

    return Planned(plan.files, plan.nbytes, write, [it for group in plan.groups for it in group])


def _direct(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> DirectExport | None:
    if not tensors_only(store, node):
        return None
    plan = plan_safetensors(store, node, request)
    if any(isinstance(it.source, quantized.COMPUTED) for group in plan.groups for it in group):
        return None  # values computed from two arrays: written from the store
    return plan_direct(store, plan)


FILE_NAMES = r"model(-[0-9]{5}-of-[0-9]{5})?\.safetensors|model\.safetensors\.index\.json"
FORMAT = OutputFormat("safetensors", subtree=True, may_write=FILE_NAMES, config_beside=True, resume_beside=False,
                      describes_model=False, single_file=False, takes_scheduler=True, plan=_plan, direct=_direct,
                      recognises=lambda out: True)  # what any other output is checked as
