"""`--format safetensors`: the model weights, HF-style, streamed tensor by tensor.

All shapes are known up front, so each file's header is written first and the data follows; without a
dtype cast, bytes go from the store's shard files to the output kernel-side (copy_file_range). Files
above `max_shard_size` are split `model-00001-of-0000N.safetensors` with a `model.safetensors.index.json`
written last, as transformers' `save_pretrained` does.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .. import dtypes
from ..errors import ExportError
from ..ranges import blocks
from ..runner import Pool
from ..store.store import Store
from ..tree import Node
from .output import OutputFile
from .resolve import ArrayRef, Rows, build, leaves

CAST_BLOCK_BYTES = 16 << 20
CASTABLE = ("float64", "float32", "float16", "bfloat16")  # what --dtype casts; other dtypes pass unchanged


@dataclass
class Item:
    key: str
    source: Any  # ArrayRef, or a torch.Tensor decoded from the store
    dtype: str  # output dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.info(self.dtype).itemsize


def collect(store: Store, node: Node, strip_prefix: str | None, cast: str | None) -> tuple[list[Item], list[str]]:
    """The tensors below `node` with their output keys, and the non-tensor leaves that were left out."""
    items, skipped, seen = [], [], set()
    for keys, path in leaves(node):
        key = ".".join(str(k) for k in keys)
        if strip_prefix and key.startswith(strip_prefix):
            key = key[len(strip_prefix):]
        item = tensor_item(store, key, path, cast)
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


def tensor_item(store: Store, key: str, path: str, cast: str | None,
                rows: Rows | None = None) -> Item | None:
    """Output tensor `key` from the store's leaf `path` (only those blocks of its `rows`, one after another,
    if given), or None when the leaf is not a tensor. Floating tensors are cast to `cast`."""
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
    return Item(key, source, cast if cast and dtype in CASTABLE else dtype, shape)


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


def _tensor_bytes(store: Store, it: Item, allow_partial: bool) -> Iterator[Any]:
    if not isinstance(it.source, ArrayRef):  # a plain tensor decoded from the store (so torch is loaded)
        import torch

        t = it.source.to(getattr(torch, it.dtype)).contiguous()
        if t.numel():
            yield t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return
    parts = it.source.parts(store, allow_partial)
    if it.dtype == it.source.dtype:
        yield from parts
        return
    src = dtypes.info(it.source.dtype)
    for block in blocks(parts, CAST_BLOCK_BYTES - CAST_BLOCK_BYTES % src.itemsize):
        yield _cast(np.frombuffer(block, dtype=src.raw), src, it.dtype)


def _cast(raw: np.ndarray, src: dtypes.DTypeInfo, dst: str) -> bytes:
    import torch

    t = torch.from_numpy(raw.copy()).view(getattr(torch, src.name))
    return t.to(getattr(torch, dst)).view(torch.uint8).numpy().tobytes()


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
               progress: Callable[[int], None] | None = None) -> Path:
    """One safetensors file: header first, then every tensor streamed from the store."""
    with OutputFile(path, progress) as out:
        out.write(header(group, partial or {}))
        for it in group:
            out.write_parts(_tensor_bytes(store, it, partial is not None))
    return path


def _write_file_task(location: str, storage_options: dict[str, Any], path: str, group: list[Item],
                     partial: dict[str, str] | None) -> Path:
    return write_file(Store.open(location, storage_options), Path(path), group, partial)


INDEX = "model.safetensors.index.json"


@dataclass
class SafetensorsPlan:
    """What a safetensors export will write, known before the first byte: file names and their tensors."""

    names: list[str]
    groups: list[list[Item]]
    skipped: list[str]

    @property
    def files(self) -> list[str]:
        return self.names + ([INDEX] if len(self.groups) > 1 else [])

    @property
    def nbytes(self) -> int:
        return sum(it.nbytes for group in self.groups for it in group)


def plan_safetensors(store: Store, node: Node, strip_prefix: str | None = None, cast: str | None = None,
                     max_shard_size: int = 5_000_000_000) -> SafetensorsPlan:
    items, skipped = collect(store, node, strip_prefix, cast)
    return plan_items(items, skipped, max_shard_size)


def plan_items(items: list[Item], skipped: list[str], max_shard_size: int) -> SafetensorsPlan:
    """Files for `items` in order, a new file whenever the next tensor would pass `max_shard_size`."""
    groups = _split(items, max_shard_size)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    return SafetensorsPlan(names, groups, skipped)


def export_safetensors(store: Store, out_dir: Path, plan: SafetensorsPlan, progress: Callable[[int], None] | None = None,
                       partial: dict[str, str] | None = None, scheduler: str | None = None,
                       jobs: int = 1) -> list[Path]:
    """Write the planned files. `partial` (metadata describing holes) allows an incomplete store.

    With `scheduler`, each output file is one Dask task (OUT must be reachable from the workers).
    """
    names, groups = plan.names, plan.groups
    items = [it for group in groups for it in group]
    if scheduler is None:
        written = [write_file(store, out_dir / name, group, partial, progress) for name, group in zip(names, groups)]
    else:
        args = [(store.location, store.storage_options, str(out_dir / name), group, partial)
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
