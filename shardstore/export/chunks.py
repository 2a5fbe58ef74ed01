"""A Hugging Face model written as a DCP checkpoint under another trainer's names (Megatron-Core's
`torch_dist`, torchtitan's): each tensor of the target a set of chunks, each chunk one source tensor's
rows (or a block of zeros), so nothing is rearranged in memory and each byte is read once and written
once. What the two writers share: the model's tensors as arrays (an FP8 model's weights dequantized on the
way), a chunk item for a source tensor's rows, and the one-pass export whose workers copy each chunk that
is one run of one array's rows into its place in the .distcp files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .. import dtypes
from ..errors import ExportError
from ..locations import name_of
from ..ranges import Part
from ..sink.layout import Target, new_layout, prepare
from ..sink.output import OutputFile
from ..store.store import Store
from . import dcp, fp8, hf, mxfp4, quantized
from .adapters import raw_rows, rows_of
from .contract import ExportRequest
from .dcp_metadata import metadata
from .hf.spec import HFModel
from .resolve import ArrayRef


def model_arrays(store: Store, subtree: str, request: ExportRequest, dtype: str
                 ) -> tuple[HFModel, dict[str, Any], dict[str, str]]:
    """The Hugging Face model the store is (export/hf) and its tensors by name, each an array of the store
    (an FP8 model's weights dequantized into `dtype`: a trainer trains from those), and the store paths of
    its names; refused naming a tensor that is no array, or a cast asked of the rest."""
    model, names = hf.describe(store, subtree, request.hf_config, request.strip_prefix)
    if model.config is None:
        raise ExportError(f"{subtree or 'the checkpoint'}: describes no model (an adapter?)")
    items = quantized.dequantize(hf.tensor_items(store, model, names, request), model.config, dtype)
    model = hf.without_scales(model, items)
    sources = {it.key: it for it in items}
    for it in sources.values():
        if isinstance(it.source, quantized.COMPUTED):
            continue
        if type(it.source) is not ArrayRef:
            raise ExportError(f"{it.key}: kept among the checkpoint's values, not as an array; --format "
                              f"{request.format} writes arrays only")
        if it.dtype != it.source.dtype:
            raise ExportError(f"--dtype: --format {request.format} writes each tensor in its own dtype (an FP8 "
                              f"model's weights dequantized into it); cast with the trainer when it loads")
    return model, sources, names


def rows_item(key: str, offset: tuple[int, ...], shape: tuple[int, ...], source: Any,
              rows: tuple[tuple[int, int], ...] | None) -> dcp.Item:
    """The chunk of `key` at `offset` that is `source`'s `rows` (all of them: None), one after another,
    of `shape` (the leading 1s of a layer's or an expert's index in a stacked key)."""
    if isinstance(source, fp8.Dequantized) and rows is not None and len(rows) == 1:
        source = source.rows_of(*rows[0])
    elif not isinstance(source, fp8.Dequantized):
        rows = rows or ((0, source.shape[0]),)
        source = replace(source, rows=_picked(source, rows))
    elif rows is not None:
        raise ExportError(f"{key}: an FP8 weight's rows picked out of order; dequantize it first (--format hf "
                          f"--dtype bfloat16)")
    ref = replace(source, shape=shape)
    return dcp.Item(key, (offset, shape), ref, ref.nbytes)


def unstacked_item(key: str, offset: tuple[int, ...], shape: tuple[int, ...], source: ArrayRef, member: int,
                   interleave: int, transpose: bool) -> dcp.Item:
    """The chunk of `key` at `offset` that is member `member` of the stacked `source` (see `Unstacked`), of
    `shape` (leading 1s as in `rows_item`)."""
    ref = Unstacked(source.path, source.dtype, shape, None, source, member, interleave, transpose)
    return dcp.Item(key, (offset, shape), ref, ref.nbytes)


@dataclass(frozen=True)
class Unstacked(ArrayRef):
    """One member of a tensor stacked from several (`stack`, an array: GPT-OSS's experts, one Hugging Face
    tensor per layer) as the tensor it was stacked from, export/safetensors.Stacked undone: its last two axes
    swapped back (`transpose`), then its rows gathered from the `interleave` ways they were dealt out
    (gate, up, gate, up... -> [gate; up]). The bits are moved, never converted; memory holds one member,
    twice."""

    stack: ArrayRef | None = None
    member: int = 0
    interleave: int = 1
    transpose: bool = False

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[Part]:
        assert self.stack is not None
        if self.transpose and isinstance(self.stack, mxfp4.Dequantized):  # dequantized as it was stored, rows x
            yield from self.stack.member_rows(store, self.member, self.interleave)  # columns: never transposed
            return
        values = np.frombuffer(raw_rows(store, rows_of(self.stack, self.member, self.member + 1)),
                               dtypes.info(self.dtype).raw).reshape(self.stack.shape[1:])
        if self.transpose:
            values = values.swapaxes(-1, -2)
        rows = values.shape[0]
        gathered = values.reshape(rows // self.interleave, self.interleave, *values.shape[1:]).swapaxes(0, 1)
        yield np.ascontiguousarray(gathered).reshape(-1).view(np.uint8).data

    def stored_crc(self, store: Store) -> int | None:
        return None


def _picked(source: ArrayRef, rows: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """`rows` of `source` (counted in its own blocks of rows, where it has them) as rows of its array,
    adjacent blocks merged."""
    out: list[tuple[int, int]] = []
    for first, stop in rows:
        for a, b in rows_of(source, first, stop).rows or ():
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
    return tuple(out)


# what the finish's items must hold on average for its workers to write them: an item sent to a worker costs
# its pickling both ways and its copy in both processes (DeepSeek-V3's 92k tensors at a tiny width: 190 MB
# more, and no faster), where the bytes of a real model's weights are what is worth spreading
SHIPPED_ITEM_BYTES = 1 << 20


@dataclass(frozen=True)
class ChunksDirect(dcp.DcpDirect):
    """The chunks that are one run of rows of an array the ingest brings, laid out for its workers to copy
    into `folder`'s .distcp files; the rest (zeros, dequantized or reordered weights, the objects) and
    `.metadata` at the finish, from the store: the rest in files of their own, by `jobs` workers (an FP8
    model's weights are most of its bytes, and dequantizing them is work)."""

    folder: str = ""  # the DCP folder in OUT ("": OUT itself)
    described: dict[str, Any] | None = None
    rest: tuple[tuple[dcp.Item, ...], ...] = ((),)  # the items of each file after the laid-out ones
    jobs: int = 1
    placed: tuple[tuple[dcp.Item, int, int, int], ...] = ()  # (item, file, its offset, its length)
    said: tuple[str, ...] = ()  # the notes

    @property
    def notes(self) -> list[str]:
        return list(self.said)

    def _in(self, name: str) -> str:
        return f"{self.folder}/{name}" if self.folder else name

    @property
    def files(self) -> list[str]:
        return list(self.layout.names) + [self._in(name) for name in self._rest_names] + [self._in(dcp.METADATA)]

    @property
    def _rest_names(self) -> list[str]:
        return [dcp.distcp_name(len(self.layout.names) + i) for i in range(len(self.rest))]

    def finish(self, store: Store, out: Path) -> list[Path]:
        assert self.described is not None
        folder = out / self.folder if self.folder else out
        results: dict[str, list[tuple[dcp.Item, int, int]]] = {name_of(n): [] for n in self.layout.names}
        for item, file, offset, length in self.placed:
            results[name_of(self.layout.names[file])].append((item, offset, length))
        written: list[dcp.ItemsWritten] = list(results.items())
        paths = [folder / name for name in self._rest_names]
        written += dcp.write_files(store, paths, [list(items) for items in self.rest], False, self.jobs)
        with OutputFile(folder / dcp.METADATA) as f:
            f.write(metadata(self.described, {}, written))
        return paths + [folder / dcp.METADATA]


def plan_direct(store: Store, chunks: list[dcp.Item], described: dict[str, Any], jobs: int, folder: str = ""
                ) -> dict[str, Any] | None:
    """ChunksDirect's fields: each chunk that is one run of rows of an array the ingest brings laid out in
    `folder`'s .distcp files for its workers; None where there is none."""
    copied = [c for c in chunks if type(c.source) is ArrayRef and c.source.rows is not None
              and len(c.source.rows) == 1 and c.source.path in store.manifest.arrays]
    if not copied:
        return None
    files = dcp.spread(copied, jobs)
    sketches, places = dcp.sketch_items(store, [[item.source for item in items] for items in files])
    laid, placed = {}, []
    targets: dict[str, list[Target]] = {}
    for file, (items, spots) in enumerate(zip(files, places)):
        for item, (start, length, data, size, crcs) in zip(items, spots):
            assert item.chunk is not None
            laid[(item.fqn, item.chunk[0])] = (file, start, length, data, size, crcs)
            placed.append((item, file, start, length))
            source: ArrayRef = item.source
            (first, stop), = source.rows or ()
            columns = store.manifest.arrays[source.path].shape[1:]
            targets.setdefault(source.path, []).append(
                Target(file, data, ((first, *(0,) * len(columns)), (stop - first, *columns)), source.dtype, crc=True))
    names = [f"{folder}/{dcp.distcp_name(i)}" if folder else dcp.distcp_name(i) for i in range(len(sketches))]
    lay = new_layout(store, names, [s.pos for s in sketches], targets)
    (Path(lay.folder) / folder).mkdir(parents=True, exist_ok=True)
    prepare(store, lay, [s.writes for s in sketches])
    copies = {id(item) for item, _, _, _ in placed}
    left = [c for c in chunks if id(c) not in copies]
    shipped = sum(c.nbytes for c in left) >= SHIPPED_ITEM_BYTES * len(left)
    rest = tuple(map(tuple, dcp.spread(left, jobs if shipped else 1)))
    return dict(layout=lay, values=True, laid=laid, folder=folder, described=described, rest=rest, jobs=jobs,
                placed=tuple(placed))
