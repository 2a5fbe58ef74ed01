"""`--format dcp`: the store as a torch.distributed.checkpoint folder that `dcp.load` reads at any world size.

This is the other half of why people unshard: to resume on a different number of GPUs. DCP reshards on
load, so the output need not match any world size; it only has to describe every tensor as chunks. Each
store cell becomes one chunk (a cell is one shard file, so its bytes are copied kernel-side into a
`torch.save` zip embedded in a .distcp file), every other value one bytes item, both keyed by the flattened
names torch's own `flatten_state_dict` gives the nested state dict (so the loader finds them), with
`planner_data` to rebuild the nesting. Several workers write .distcp files at once; `.metadata`, which
makes the folder a checkpoint, is written last, so a run that stops early leaves nothing that loads.

In one pass (`plan_direct`) every chunk's .distcp item is laid out whole but for its tensor bytes.

A chunk is a store cell, as in the two-step export: its item is a small torch zip (the pickle of one
tensor, its one storage entry) known entirely from the plan, except the storage's bytes, which the
workers write, and its CRC-32, patched in at the seal from what they recorded. The values (and the
tensors the store assembles) arrive with the data: they go into one more .distcp file at the finish,
and `.metadata`, which makes the folder a checkpoint, is written last.
"""

from __future__ import annotations

import struct
import zlib
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

from ..errors import ExportError
from ..ranges import Part
from ..runner import Pool
from ..sink.layout import Layout, Sketch, Target, entry_crc, journalled_runs, new_layout, patched, prepare
from ..sink.output import OutputFile
from ..store.handle import TensorValue
from ..store.store import Store
from ..tree import MAX_DEPTH, Node
from .contract import Arrays, DirectExport, ExportRequest, OutputFormat, Planned, Progress, Written
from .notes import flat_buckets
from .resolve import ArrayRef, build, leaves, object_value
from .dcp_metadata import metadata
from .torch import SERIALIZATION_ID, _tied, serialization_id, write_zip

METADATA = ".metadata"


@dataclass(frozen=True)
class CellRef(ArrayRef):
    """One cell of an array: a chunk of the output."""

    index: tuple[int, ...] = ()

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[Part]:
        return store.cell_parts(self.path, self.index, allow_partial=allow_partial)

    def stored_crc(self, store: Store) -> int | None:
        return store.cell_crc(self.path, self.index)  # this cell's own, never the whole array's


@dataclass(frozen=True)
class Item:
    fqn: str
    chunk: tuple[tuple[int, ...], tuple[int, ...]] | None  # offsets and sizes of a tensor chunk; None: a value
    # an ArrayRef (a CellRef: one cell of the store); or (store path of the leaf holding it, keys below that
    # leaf) for anything else; or a `Value` of no store
    source: Any
    nbytes: int


@dataclass(frozen=True)
class Value:
    """An object an item holds that is in no store (the common state export/megatron.py writes)."""

    value: Any


Aliases = dict[str, list[str]]  # a tensor's flattened key -> those of the tied names that are that tensor


def dcp_state(store: Store) -> Any:
    """The state the folder stands for: the store's tree, and its tied names (DeepSpeed's shared_params:
    the state dict names one tensor twice) as the very tensors they name, so that `dcp.load` of that
    state finds every key."""
    return _tied(store, store.manifest.tree, build(store, store.manifest.tree, lean=True))


def describe(store: Store, arrays: Arrays | None = None
             ) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]], list[Item], Aliases]:
    """(what each flattened key is, planner_data, items, aliases) for the whole store. Keys are flattened
    as torch's `flatten_state_dict` does (`flatten`), into containers the store keeps as one value
    (param_groups). An array `arrays` replaces (`average`'s mean of several stores) is one chunk, the whole
    tensor. A tied name (`dcp_state`) is a key of its own; its chunks are its tensor's items, written once
    (`with_aliases`)."""
    flat, mappings = flatten(dcp_state(store))
    leaf_of = dcp_names(store)
    described: dict[str, Any] = {}
    items: list[Item] = []
    aliases: Aliases = {}
    first: dict[int, str] = {}  # each tensor's first key
    for fqn, value in flat.items():
        if isinstance(value, (ArrayRef, TensorValue)) and first.setdefault(id(value), fqn) != fqn:
            described[fqn] = described[first[id(value)]]
            aliases.setdefault(first[id(value)], []).append(fqn)
            continue
        if isinstance(value, ArrayRef):
            entry = store.manifest.arrays[value.path]
            described[fqn] = ("tensor", entry.dtype, entry.shape)
            replaced = arrays(value, value.dtype) if arrays else value
            if replaced != value:
                items.append(Item(fqn, ((0,) * len(entry.shape), tuple(entry.shape)), replaced, replaced.nbytes))
                continue
            for flat_index in range(entry.ncells):
                index = entry.cell_index(flat_index)
                bounds = entry.cell_bounds(index)
                offsets, sizes = tuple(lo for lo, _ in bounds), tuple(hi - lo for lo, hi in bounds)
                if 0 not in sizes:
                    ref = CellRef(value.path, entry.dtype, sizes, index=index)
                    items.append(Item(fqn, (offsets, sizes), ref, ref.nbytes))
            continue
        keys = tuple(mappings[fqn])
        at = next(n for n in range(len(keys), 0, -1) if keys[:n] in leaf_of)
        source = (leaf_of[keys[:at]], keys[at:])
        if isinstance(value, TensorValue):
            described[fqn] = ("tensor", value.dtype, value.shape)
            items.append(Item(fqn, ((0,) * len(value.shape), value.shape), source, len(value.data)))
        else:
            described[fqn] = ("bytes",)
            items.append(Item(fqn, None, source, 0))
    return described, mappings, items, aliases


def with_aliases(results: list[ItemsWritten], aliases: Aliases) -> list[ItemsWritten]:
    """Each tied name's chunks at the very bytes its tensor's were written to: the folder names every key
    of the state, and stores each tensor once (torch's reader reads each item from its own offset)."""
    return [(name, written + [(replace(item, fqn=alias), offset, length) for item, offset, length in written
                              for alias in aliases.get(item.fqn, ())]) for name, written in results]


def flatten(state: dict[Any, Any]) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]]:
    """torch's `flatten_state_dict` (torch >= 2.4) without torch: every mapping is gone into (its keys by
    str()), a list only where something below it is a mapping, a list gone into or a tensor (`ArrayRef`,
    `TensorValue`); anything else is one value. Keys are the path joined by dots; mappings, each key's
    path."""
    flat: dict[str, Any] = {}
    mappings: dict[str, tuple[str | int, ...]] = {}
    todo: list[tuple[tuple[str | int, ...], Any, int]] = [((str(k),), v, 1) for k, v in reversed(state.items())]
    while todo:
        path, value, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ExportError(f"{'.'.join(map(str, path[:8]))}...: values nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, Mapping):
            todo += [(path + (str(k),), v, depth + 1) for k, v in reversed(list(value.items()))]
        elif isinstance(value, list) and not _terminal(value):
            todo += [(path + (i,), v, depth + 1) for i, v in reversed(list(enumerate(value)))]
        else:
            fqn = ".".join(map(str, path))
            if fqn in flat:
                raise ExportError(f"{fqn}: two values get this DCP name; --format dcp cannot keep both "
                                  f"(--format torch can)")
            flat[fqn], mappings[fqn] = value, path
    return flat, mappings


def _terminal(values: list[Any]) -> bool:
    """A list torch keeps whole: nothing in it is a tensor, and nothing is a mapping or a list it goes into
    (torch's `_is_terminal`: a mapping is gone into even when it holds no tensor; so is its list)."""
    todo = [values]
    while todo:
        for entry in todo.pop():
            if isinstance(entry, (Mapping, ArrayRef, TensorValue)):
                return False
            if isinstance(entry, list):
                todo.append(entry)
    return True


def dcp_names(store: Store) -> dict[tuple[Any, ...], str]:
    """The store path of each leaf, by the keys DCP names it with; refused where two leaves get one name."""
    leaf_of: dict[tuple[Any, ...], str] = {}
    for keys, path in leaves(store.manifest.tree, dcp_names=True):
        if leaf_of.setdefault(tuple(keys), path) != path:  # e.g. keys 0 and "0" of one dict
            raise ExportError(f"{path}: DCP names it {'.'.join(map(str, keys))!r}, as it names "
                              f"{leaf_of[tuple(keys)]}; --format dcp cannot keep both (--format torch can)")
    return leaf_of


ItemsWritten = tuple[str, list[tuple[Item, int, int]]]  # a file's name, and (item, offset, length) of each item in it


def _write_file(location: str, storage_options: dict[str, Any] | None, path: str, items: list[Item],
                partial: bool) -> ItemsWritten:
    """One .distcp file, in a worker: every item a torch.save zip, one after another."""
    return write_items(Store.open(location, storage_options), Path(path), items, partial)


def write_items(store: Store, path: Path, items: list[Item], partial: bool,
                 progress: Callable[[int], None] | None = None) -> ItemsWritten:
    """Each item at the end of `path`: a whole tensor of the store from its dtype and shape's template
    (`Templates`), anything else (a value, a tensor with holes) as torch.save writes it."""
    written = []
    templates = Templates(store)
    with OutputFile(path) as out:
        for item in items:
            start = out.pos
            if isinstance(item.source, ArrayRef) and not partial:
                _write_from(out, templates.of(item.source), item.source, store)
                written.append((item, start, out.pos - start))
                if progress:
                    progress(item.nbytes)
                continue
            if isinstance(item.source, (ArrayRef, Value)):
                obj: Any = item.source.value if isinstance(item.source, Value) else item.source
            else:
                leaf, below = item.source
                obj = object_value(store, leaf, lean=True)
                for key in below:
                    obj = _below(obj, key)
            write_zip(out, "archive", obj, store, {"partial": "true"} if partial else None)
            written.append((item, start, out.pos - start))
            if progress:
                progress(item.nbytes)
    return path.name, written


def _below(obj: Any, key: Any) -> Any:
    """`obj[key]`, where torch's flattening named a dict's key by its str() (Megatron's bucket sizes are
    keyed by a tuple of dtypes)."""
    if not isinstance(obj, dict) or key in obj:
        return obj[key]
    return next(v for k, v in obj.items() if str(k) == key)


FILE_BYTES = 256 << 20  # a .distcp file's share of the tensors: one worker task, one step of the progress
INLINE_BYTES = 64 << 20  # below this, starting workers costs more than they save: one file, written here


@dataclass(frozen=True)
class DcpPlan:
    described: dict[str, Any]
    mappings: dict[str, tuple[Any, ...]]
    files: list[list[Item]]  # the items of each .distcp file
    aliases: Aliases  # the tied names, written as their tensors' items

    @property
    def names(self) -> list[str]:
        return [distcp_name(i) for i in range(len(self.files))]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for items in self.files for item in items)


def plan_dcp(store: Store, jobs: int = 1, arrays: Arrays | None = None) -> DcpPlan:
    """Which item goes into which .distcp file: the largest first, each to the lightest file, in files of
    about FILE_BYTES (at least one per worker), so the work spreads and progress moves file by file."""
    described, mappings, items, aliases = describe(store, arrays)
    return DcpPlan(described, mappings, spread(items, jobs), aliases)


Sized = TypeVar("Sized", Item, CellRef)


def spread(items: list[Sized], jobs: int) -> list[list[Sized]]:
    """The items in .distcp files: the largest first, each to the lightest file."""
    total = sum(item.nbytes for item in items)
    count = 1 if jobs == 1 or total < INLINE_BYTES else max(jobs, -(-total // FILE_BYTES))
    count = max(1, min(count, len(items)))
    files: list[list[Sized]] = [[] for _ in range(count)]
    load = [0] * count
    for item in sorted(items, key=lambda it: -it.nbytes):
        i = load.index(min(load))
        files[i].append(item)
        load[i] += item.nbytes
    return files


def distcp_name(i: int) -> str:
    return f"__{i}_0.distcp"


def export_dcp(store: Store, out_dir: Path, plan: DcpPlan, jobs: int = 1, progress: Callable[[int], None] | None = None,
               partial: dict[str, str] | None = None) -> list[Path]:
    """Write every planned `out_dir/__{i}_0.distcp` (by `jobs` workers), and then `out_dir/.metadata`.
    `progress` hears each item's tensor bytes as it is written (here), or each file's once it is (workers)."""
    names = plan.names
    results = write_files(store, [out_dir / n for n in names], plan.files, partial is not None, jobs, progress)
    described_metadata = metadata(plan.described, plan.mappings, with_aliases(results, plan.aliases))
    with OutputFile(out_dir / METADATA) as out:
        out.write(described_metadata)
    return [out_dir / n for n in names] + [out_dir / METADATA]


def write_files(store: Store, paths: list[Path], files: list[list[Item]], partial: bool, jobs: int,
                progress: Callable[[int], None] | None = None) -> list[ItemsWritten]:
    """Each of `paths` holding its `files` items, by up to `jobs` workers (each file a task) or here for
    one; `progress` hears each item's tensor bytes as it is written (here), or each file's once it is."""
    results: list[ItemsWritten] = []

    def done(result: ItemsWritten) -> None:
        results.append(result)
        if progress:
            progress(sum(item.nbytes for item, _, _ in result[1]))

    with Pool(max(1, min(jobs, len(paths)))) as pool:
        if pool.inline:
            for path, items in zip(paths, files):
                results.append(write_items(store, path, items, partial, progress))
        else:
            pool.run(_write_file, [(store.location, store.storage_options, str(path), f, partial)
                                   for path, f in zip(paths, files)], [path.name for path in paths], done)
    return results


# ---------------------------------------------------------------------------------------------- one pass
# Where a chunk's item is: its file, then its Place there (below).
Laid = tuple[int, int, int, int, int, list[int]]


@dataclass(frozen=True)
class DcpDirect(DirectExport):
    layout: Layout
    values: bool  # whether anything is left for the last .distcp file (values, assembled tensors)
    laid: dict[tuple[str, tuple[int, ...]], Laid]  # (store path, cell) -> where its item is

    @property
    def files(self) -> list[str]:
        return list(self.layout.names) + ([distcp_name(len(self.layout.names))] if self.values else []) + [METADATA]

    def seal(self, store: Store) -> None:
        runs = journalled_runs(store, self.layout)
        with ExitStack() as stack:  # each file made durable, or left for the rerun, as it exits
            files = [stack.enter_context(OutputFile.reopen(Path(self.layout.folder) / name, size))
                     for name, size in zip(self.layout.names, self.layout.sizes)]
            for file, _, _, at, size, positions in self.laid.values():
                crc = struct.pack("<I", entry_crc(runs.get(file, []), at, size, files[file].fd))
                for position in positions:
                    files[file].pwrite(crc, position)

    def finish(self, store: Store, out: Path) -> list[Path]:
        described, mappings, items, aliases = describe(store)
        results: dict[str, list[Any]] = {name: [] for name in self.layout.names}
        rest = []
        for item in items:
            where = self.laid.get((item.source.path, item.source.index)) if isinstance(item.source, CellRef) else None
            if where is None:
                rest.append(item)
            else:
                results[self.layout.names[where[0]]].append((item, where[1], where[2]))
        written: list[ItemsWritten] = list(results.items())
        files = []
        if rest:
            name = distcp_name(len(self.layout.names))
            written.append(write_items(store, out / name, rest, False))
            files.append(out / name)
        with OutputFile(out / METADATA) as f:
            f.write(metadata(described, mappings, with_aliases(written, aliases)))
        return files + [out / METADATA]


def _laid_out(store: Store, jobs: int) -> tuple[list[Sketch], dict[tuple[str, tuple[int, ...]], Laid]]:
    """Each .distcp file sketched, and where each chunk's item is."""
    cells = []
    for _, path in leaves(store.manifest.tree):
        entry = store.manifest.arrays.get(path)
        if entry is None:  # a value: at the finish
            continue
        for flat in range(entry.ncells):
            index = entry.cell_index(flat)
            sizes = tuple(hi - lo for lo, hi in entry.cell_bounds(index))
            if 0 not in sizes:
                cells.append(CellRef(path, entry.dtype, sizes, index=index))
    files = spread(cells, jobs) if cells else []
    sketches, places = sketch_items(store, files)
    laid = {(ref.path, ref.index): (file, *place) for file, (refs, at) in enumerate(zip(files, places))
            for ref, place in zip(refs, at)}
    return sketches, laid


# Where a tensor's item is in its file: its start and length, its storage bytes' start and length, and the
# positions of its CRC-32 (local header, central directory).
Place = tuple[int, int, int, int, list[int]]


@dataclass(frozen=True)
class Template:
    """One dtype and shape's item (what torch.save writes of such a tensor), sketched with its tensor's
    bytes a hole: its runs of bytes around the hole, and where in it are the tensor's bytes, their CRC-32
    (local header, central directory), its serialization id and that id's CRC-32. Offsets from its start."""

    runs: list[tuple[int, bytes]]
    length: int
    data: int
    size: int
    crcs: list[int]
    ident: int
    ident_crcs: list[int]

    def fresh_id(self) -> list[tuple[int, bytes]]:
        """The patches that give an item of it its own serialization id, as each torch.save has."""
        ident = serialization_id()
        crc = struct.pack("<I", zlib.crc32(ident))
        return [(self.ident, ident), *((c, crc) for c in self.ident_crcs)]


class Templates:
    """Each dtype and shape's item sketched once: a tensor's item depends on them alone but for its random
    serialization id (its storage is always "0", its offsets count from its own start). DeepSeek-V3's 92k
    tensors are a few hundred of them; each sketch was a pickling and a zip's headers."""

    def __init__(self, store: Store):
        self.store = store
        self._made: dict[tuple[str, tuple[int, ...]], Template] = {}

    def of(self, ref: Any) -> Template:
        key = (str(ref.dtype), tuple(ref.shape))
        if key not in self._made:
            alone = Sketch()
            zw = write_zip(alone, "archive", ref, self.store, holes=True)
            (name, (data, size)), = zw.holes.items()
            self._made[key] = Template(alone.runs(), alone.pos, data, size, zw.crc_at(name),
                                       zw.data_at[SERIALIZATION_ID], zw.crc_at(SERIALIZATION_ID))
        return self._made[key]


def sketch_items(store: Store, files: list[list[Any]]) -> tuple[list[Sketch], list[list[Place]]]:
    """Each file's tensors sketched one after another as DCP's items, their bytes holes for the workers,
    with where each is: each item its dtype and shape's template (`Templates`) with a new serialization id."""
    templates = Templates(store)
    sketches, places = [], []
    for refs in files:
        sketch, at = Sketch(), []
        for ref in refs:
            t = templates.of(ref)
            start = sketch.pos
            sketch.place(t.runs, t.length, t.fresh_id())
            at.append((start, t.length, start + t.data, t.size, [start + c for c in t.crcs]))
        sketches.append(sketch)
        places.append(at)
    return sketches, places


def _write_from(out: OutputFile, t: Template, source: ArrayRef, store: Store) -> None:
    """A tensor's item written from its template: the runs before its bytes, its bytes (their CRC-32 the
    store's record of it, or summed on the way), then the runs after, with its own id and that CRC."""
    start = out.pos
    for at, data in t.runs:
        if at >= t.data:
            break
        out.write(data)
    if out.pos - start != t.data:
        raise ValueError(f"{source.path}: its item's template is not whole before its bytes")
    known = source.stored_crc(store)
    summed = out.write_parts(source.parts(store), crc=0 if known is None else None)
    crc = struct.pack("<I", known if known is not None else summed or 0)
    if out.pos - start != t.data + t.size:
        raise ValueError(f"{source.path}: wrote {out.pos - start - t.data} of its {t.size} bytes")
    for _, data in patched([r for r in t.runs if r[0] >= t.data], t.fresh_id() + [(c, crc) for c in t.crcs]):
        out.write(data)
    for c in t.crcs:
        if c < t.data:
            out.pwrite(crc, start + c)


def plan_direct(store: Store, jobs: int) -> DcpDirect:
    dcp_names(store)  # two leaves DCP would name alike: refused before the ingest, not after it
    sketches, laid = _laid_out(store, jobs)
    targets: dict[str, list[Target]] = {}
    for (path, index), (file, _, _, at, _, _) in laid.items():
        entry = store.manifest.arrays[path]
        bounds = entry.cell_bounds(index)
        box = (tuple(lo for lo, _ in bounds), tuple(hi - lo for lo, hi in bounds))
        targets.setdefault(path, []).append(Target(file, at, box, entry.dtype, crc=True))
    lay = new_layout(store, [distcp_name(i) for i in range(len(sketches))], [s.pos for s in sketches], targets)
    prepare(store, lay, [s.writes for s in sketches])
    values = any(path not in targets for _, path in leaves(store.manifest.tree))
    return DcpDirect(lay, values, laid)


def _plan(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    plan = plan_dcp(store, jobs, request.arrays)

    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        return export_dcp(store, out, plan, jobs, progress, partial), [], flat_buckets(store.manifest.arrays)

    return Planned(plan.names + [METADATA], plan.nbytes, write)


FORMAT = OutputFormat("dcp", subtree=False, may_write=r"__[0-9]+_0\.distcp|\.metadata", config_beside=True,
                      resume_beside=False, describes_model=False, single_file=False, takes_scheduler=False, plan=_plan,
                      direct=lambda store, request, node, subtree, jobs: plan_direct(store, jobs),
                      recognises=lambda out: (out / METADATA).is_file(), reads_as_checkpoint=True)
