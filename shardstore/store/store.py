"""The store: one Zarr v3 group per checkpoint, plus shardstore's own records beside it.

    <store>/zarr.json, <path>/zarr.json, <path>/c.<i>.<j>  Zarr: one array per sharded tensor, a file per cell
    <store>/__shardstore__/manifest.json                 what the store holds (written before any data)
    <store>/__shardstore__/ranks/<r>.json                one commit record per ingested rank, written last
    <store>/__shardstore__/staging/<r>.bin               a rank's pieces of small tensors, where more than
                                                         its commit record holds (store format 3)
    <store>/__shardstore__/blobs/<digest>                plain-tensor bytes, content-addressed
    <store>/__shardstore__/packs/<random>.bin            on object storage (store format 4), a task's cells in
                                                         one object; its records say where (store/packs.py)
    <store>/__shardstore__/assembled/<random>.json       ... and where the cells an assembly packed are
    <store>/__shardstore__/zarr.json                     an empty array node, so Zarr readers walking the
                                                         group see a node there and never look inside

State-dict paths never start with "__" (paths.escape), so nothing here can collide with one. A rank counts as
ingested only once its commit record exists, and that record is written after everything it lists is
durable, so a crash at any moment leaves nothing that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

if TYPE_CHECKING:
    import zarr

from .. import dtypes
from ..crc import crc32_combine
from ..errors import CheckpointError, StoreError
from ..gcpause import gc_paused
from ..locations import StorageOptions, filesystem
from ..ranges import FileRange, Part, joined, part_length
from .backend import Backend, open_backend
from .handle import TensorHandle, decode_value
from .manifest import MANIFEST_KEY, PACKED, ArrayEntry, CommitRecord, Manifest
from .packs import (ASSEMBLED, ASSEMBLY_KEY, Pack, Span, assembly_key, overlapping, packs_cells, places_fit,
                    transformed, zarr_view)
from .shardfile import GROUP_METADATA, array_metadata, records_node_metadata, shard_parts, shard_size

RECORDS_NODE = "__shardstore__/zarr.json"
RANKS = "__shardstore__/ranks"
STAGING = "__shardstore__/staging"
STAGING_CACHE_BYTES = 96 << 20  # staged bytes kept in memory: whole staging files, records' inline bytes (_staged)
ASSEMBLED_WRITE_BYTES = 16 << 20  # assembled cells held before they are written together (Store.assemble_ready)
BLOBS = "__shardstore__/blobs"
RECORDS_TOGETHER = 64  # commit records fetched at once (at W=1024 one is ~75 KB: 5 MB raw, not all of them)


def first_difference(a: bytes, b: bytes, itemsize: int, shape: tuple[int, ...], origin: tuple[int, ...]) -> list[int]:
    """The index (in the whole tensor) of the first element where two C-order copies of a block differ."""
    at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) // itemsize
    return [int(o + i) for o, i in zip(origin, np.unravel_index(at, shape))]


def _write_array_metadata(backend: Backend, manifest: Manifest, location: str, fresh: bool = False) -> None:
    """The zarr.json of each group above an array and of each array, never overwriting one that differs
    (another process may be writing that array's cells right now): all read at once, then the missing ones
    written at once, the last array's last (`Store.ensure_array_metadata`). A `fresh` store (one whose root
    this run made) holds none yet, so nothing is read: on object storage that was a request per array."""
    groups = {p.rsplit("/", 1)[0] for p in manifest.arrays if "/" in p}
    groups |= {g.rsplit("/", i)[0] for g in list(groups) for i in range(1, g.count("/") + 1)}
    wanted: list[tuple[str, Any]] = [(f"{group}/zarr.json", None) for group in sorted(groups)]
    for entry in manifest.arrays.values():
        info = dtypes.info(entry.dtype)
        meta = array_metadata(info.raw, entry.shape, tuple(max(c, 1) for c in entry.cell),
                              tuple(max(c, 1) for c in entry.chunk), {"torch_dtype": entry.dtype}, manifest.separator)
        wanted.append((f"{entry.path}/zarr.json", transformed(meta) if manifest.packed else meta))
    there = [None] * len(wanted) if fresh else backend.read_many([key for key, _ in wanted])
    for (key, meta), raw in zip(wanted, there):
        if meta is not None and raw is not None and json.loads(raw) != meta:
            raise StoreError(f"{location}: already holds a different array at {key[:-len('/zarr.json')]}; "
                             f"use an empty folder for a new store")
    missing = [(key, GROUP_METADATA if meta is None else json.dumps(meta).encode())
               for (key, meta), raw in zip(wanted, there) if raw is None]
    backend.write_many(missing[:-1])
    backend.write_many(missing[-1:])


def _shard_size(plan: ArrayEntry, cell: int) -> int:
    """The size of a cell's shard object (`shard_parts`)."""
    (lo, hi), *_ = plan.cell_bounds(plan.cell_index(cell))
    return shard_size(plan.cell, plan.chunk, hi - lo, dtypes.info(plan.dtype).itemsize)


def _read_if_there(backend: Backend, key: str, length: int | None = None) -> bytes | None:
    """A small object (its first `length` bytes, if given), or None: one request on object storage, where
    asking whether a missing key exists takes two (s3fs follows a HEAD's 404 with a listing, in case the key
    is a folder)."""
    return backend.read_many([key], length)[0]


def cell_key(path: str, index: tuple[int, ...], separator: str = ".") -> str:
    """Zarr's default chunk key. Stores of format 2 use "." (every cell file of an array in one folder:
    at world size 1024 a rank writes hundreds of cells, and a new folder for each cost more than the
    file); format 1 stores used "/"."""
    return f"{path}/c{separator}" + separator.join(str(i) for i in index) if index else f"{path}/c"


# a staged array's pieces: (offsets, sizes) -> (the rank whose staging holds it, where, how many bytes)
Pieces = dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, int, int]]


@dataclass
class Status:
    """What an export needs, and what is still missing."""

    world_size: int
    ranks_done: list[int]
    ranks_missing: list[int]
    complete: list[str]
    partial: dict[str, float]  # path -> fraction of cells present

    @property
    def ok(self) -> bool:
        return not self.ranks_missing and not self.partial


class Store:
    """An open store. Create one with `Store.create` (ingestion) or `shardstore.open` (everyone else)."""

    def __init__(self, backend: Backend, manifest: Manifest):
        self.backend = backend
        self.manifest = manifest
        self._zarr_root: zarr.Group | None = None
        self._records: dict[int, CommitRecord] = {}
        self._listed = False  # whether `records` has listed the store's commit records yet
        self._committed: dict[int, str] = {}  # rank -> its record's key, as the last listing found them
        self._crcs: tuple[int, dict[str, dict[int, int]]] = (0, {})  # (records indexed, path -> cell -> CRC)
        self._staging: dict[int, bytes] = {}  # whole staging files by rank, up to STAGING_CACHE_BYTES (_staged)
        self._staged_bytes = 0
        self._present: set[str] = set()  # cell keys known to be written (a cell is never removed)
        self._absent: set[str] | None = None  # inside `_cells_as_of_now`: cell keys found missing
        self._created = False  # this process made the store: its first assembly looks for no cell (_cells_as_of_now)
        self._pack: Pack | None = None  # a packed store's: the one this process's task is writing
        self._unsent: dict[tuple[str, int], Span] = {}  # cells this process packed, not yet in a record it holds
        self._spans: tuple[int, dict[str, dict[int, Span]]] = (0, {})  # (records indexed, path -> cell -> place)
        self._zarr_spans: dict[str, Span] = {}  # cell key -> place, for the Zarr view (packs.zarr_view)
        self._zarr_indexed = (0, 0)  # (records, assembled cells) in `_zarr_spans`
        self._blobs: set[str] = set()  # digests this process has stored (put_blob)
        self._assembled: dict[tuple[str, int], Span] = {}  # a packed store's assembled cells (_hold_assembly)
        self._assemblies: set[str] | None = None  # the assembly records read, once any were looked for

    # ------------------------------------------------------------------ opening and creating
    @classmethod
    def open(cls, location: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> "Store":
        backend = open_backend(location, storage_options)
        try:
            raw = backend.read(MANIFEST_KEY)
        except KeyError:
            if backend.exists("zarr.json") or backend.exists("."):
                raise StoreError(f"{location}: not a shardstore store (no {MANIFEST_KEY})") from None
            raise StoreError(f"{location}: no such store") from None
        try:
            data = json.loads(raw)
        except ValueError:
            raise StoreError(f"{location}: corrupt manifest {MANIFEST_KEY}") from None
        if not isinstance(data, dict):
            raise StoreError(f"{location}: corrupt manifest {MANIFEST_KEY}")
        return cls(backend, Manifest.from_json(data, str(location)))

    @classmethod
    def with_part(cls, location: str | os.PathLike[str], storage_options: StorageOptions | None,
                  part: Manifest) -> "Store":
        """The store at `location` as a task sees it: through its part of the manifest (`Manifest.part`),
        which came with the task, rather than the whole, read from the store."""
        return cls(open_backend(location, storage_options), part)

    @classmethod
    def exists(cls, location: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> bool:
        return open_backend(location, storage_options).exists(MANIFEST_KEY)

    @classmethod
    def create(cls, location: str | os.PathLike[str], manifest: Manifest,
               storage_options: StorageOptions | None = None, array_metadata: bool = True,
               packed: bool | None = None) -> "Store":
        """Create the store for `manifest`, or open it if it exists and holds the same checkpoint layout.
        Without `array_metadata` (a scratch store whose arrays a one-pass export writes straight into its
        output) no zarr.json of an array, or of a group above one, is written until `ensure_array_metadata`.
        A new store is `packed` (store/packs.py) by default on object storage; on a file system not, so that
        any Zarr reader opens it as it is."""
        backend = open_backend(location, storage_options)
        packed = packs_cells(backend) if packed is None else packed
        manifest = replace(manifest, packed=manifest.version >= PACKED and packed)
        if backend.exists(MANIFEST_KEY):
            store = cls.open(location, storage_options)
            store.check_compatible(manifest, str(location))
            return store
        fresh = _read_if_there(backend, "zarr.json") is None
        if fresh:
            backend.write("zarr.json", [GROUP_METADATA])
        if fresh or _read_if_there(backend, RECORDS_NODE) is None:
            backend.write(RECORDS_NODE, [json.dumps(records_node_metadata()).encode()])
        if array_metadata:
            _write_array_metadata(backend, manifest, str(location), fresh)
        if backend.exists(MANIFEST_KEY):
            store = cls.open(location, storage_options)
            store.check_compatible(manifest, str(location))
            return store
        backend.write(MANIFEST_KEY, manifest.json_parts(), durable=True)
        store = cls(backend, manifest)
        store._created = fresh
        return store

    def ensure_array_metadata(self) -> None:
        """Every array's zarr.json, where a store was created without them (`create`): before any array is
        written into the store. The last array's is written last, so its presence says all are there."""
        arrays = list(self.manifest.arrays.values())
        if arrays and not self.backend.exists(f"{arrays[-1].path}/zarr.json"):
            _write_array_metadata(self.backend, self.manifest, self.location)

    def cell_key(self, path: str, index: tuple[int, ...]) -> str:
        return cell_key(path, index, self.manifest.separator)

    def discard(self) -> None:
        """Remove the whole store. Only for one that holds nothing committed (see ingest.create_store)."""
        root = self.backend.local_path("")
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
            return
        fs, path = filesystem(self.location, self.storage_options)
        fs.rm(path, recursive=True)

    def check_compatible(self, other: Manifest, where: str) -> None:
        mine = self.manifest
        if other.world_size != mine.world_size:
            raise StoreError(f"{where}: holds a checkpoint of world size {mine.world_size}, not {other.world_size}")
        if other.tree != mine.tree or other.arrays.keys() != mine.arrays.keys():
            raise StoreError(f"{where}: holds a checkpoint with different keys")
        for path, plan in other.arrays.items():
            if (plan.dtype, plan.shape) != (mine.arrays[path].dtype, mine.arrays[path].shape):
                raise StoreError(f"{where}: {path} is {mine.arrays[path].dtype}{list(mine.arrays[path].shape)} "
                                 f"in the store, {plan.dtype}{list(plan.shape)} in the new files")

    # ------------------------------------------------------------------ writing (ingestion)
    def write_cell(self, plan: ArrayEntry, index: tuple[int, ...], data: list[Part],
                   valid_rows: int) -> tuple[str, Span | None]:
        """Write one cell as a complete Zarr shard object; `data` are its valid rows' bytes in order. Returns
        the key written, and in a packed store where in that pack the cell is."""
        key, parts = self._cell_object(plan, index, data, valid_rows)
        if not self.manifest.packed:
            self.backend.write(key, parts)
            self._written(key)
            return key, None
        if self._pack is None:
            self._pack = Pack(self.backend)
        span = self._pack.append(parts)
        self._unsent[(plan.path, plan.flat_index(index))] = span
        return span[0], span

    def _close_pack(self) -> None:
        """The pack being written appears (before the records that name it)."""
        pack, self._pack = self._pack, None
        if pack is not None:
            pack.close()

    def abandon_pack(self) -> None:
        """A pack still being written when its task ends without committing: it never appears."""
        pack, self._pack = self._pack, None
        if pack is not None:
            pack.abort()

    def _cell_object(self, plan: ArrayEntry, index: tuple[int, ...], data: list[Part],
                     valid_rows: int) -> tuple[str, list[Part]]:
        itemsize = dtypes.info(plan.dtype).itemsize
        nbytes = sum(part_length(p) for p in data)
        return (self.cell_key(plan.path, index),
                list(shard_parts(data, nbytes, plan.cell, plan.chunk, valid_rows, itemsize)))

    def _written(self, key: str) -> None:
        self._present.add(key)
        if self._absent is not None:
            self._absent.discard(key)

    def has_cell(self, entry: ArrayEntry, index: tuple[int, ...]) -> bool:
        """Whether the cell is written: its first byte read (a cell is never empty, it ends with its shard
        index), see `_read_if_there`. One found stays found (a cell is never removed)."""
        key = self.cell_key(entry.path, index)
        if key in self._present:
            return True
        if self._absent is not None and key in self._absent:
            return False
        if self.manifest.packed:  # its assembly records say (read once, and again by each status)
            self._assemblies_read()
            return key in self._present
        if _read_if_there(self.backend, key, 1) is None:
            return False
        self._present.add(key)
        return True

    @contextlib.contextmanager
    def _cells_as_of_now(self) -> Iterator[None]:
        """Inside, `has_cell` answers for every cell that a staged array or the committed staged pieces of
        a flat one could fill from what was found on entry, all looked for at once (`Backend.read_many`):
        on object storage, a status or an assembly waits for the service once, not once per array."""
        cells = [self.cell_key(entry.path, (0,) * len(entry.shape)) for entry in self.manifest.arrays.values()
                 if entry.staged]
        for entry in self.manifest.arrays.values():
            if entry.flat and not entry.staged:
                recorded = self._recorded_cells(entry.path)
                cells += [self.cell_key(entry.path, self._row_cell(entry, i))
                          for i in sorted(self._staged_cells(entry) - recorded)]
        keys = [key for key in dict.fromkeys(cells) if key not in self._present]
        # Only a coordinator writes these cells (assemble_ready). Until the first assembly of a store this
        # process made, only another run ingesting into it at once could have written one, and writing it
        # again writes the same bytes from the same committed pieces, atomically: not looked for (at world
        # size 256, 99 requests to S3). Later, other runs may have: a status then looks (in a packed store,
        # at the assembly records: a listing, not a request per cell).
        if self._created:
            absent = set(keys)
        elif self.manifest.packed:
            self._read_assemblies()
            absent = set(keys) - self._present
        else:
            absent = {key for key, got in zip(keys, self.backend.read_many(keys, 1)) if got is None}
        self._present.update(set(keys) - absent)
        self._absent = absent
        try:
            yield
        finally:
            self._absent = None

    def read_cell_bytes(self, entry: ArrayEntry, index: tuple[int, ...], nbytes: int) -> bytes:
        """The first `nbytes` of a cell's data (its valid rows, in C order)."""
        key, offset = self._cell_at(entry.path, index, nbytes)
        return self.backend.read(key, offset, nbytes)

    def _cell_at(self, path: str, index: tuple[int, ...], nbytes: int, offset: int = 0) -> tuple[str, int]:
        """Where bytes [offset, offset + nbytes) of a cell's shard object are: (key, offset there). In a
        packed store, a unit's cell is a range of a pack (`_pack_spans`; one this process is still writing
        is closed first); an assembled cell, an object of its own."""
        plan = self.manifest.arrays[path]
        span = None
        if self.manifest.packed:
            flat = plan.flat_index(index)
            span = self._unsent.get((path, flat)) or self._pack_spans().get(path, {}).get(flat) \
                or self._assembled_at(path, flat)
        if span is None:
            return self.cell_key(path, index), offset
        pack, start, size = span
        if offset + nbytes > size:
            raise StoreError(f"{self.location}: {path}: a commit record places cell {list(index)} in fewer bytes "
                             f"than it holds; the store is damaged")
        if self._pack is not None and pack == self._pack.key:
            self._close_pack()  # (under --verify-replicas: a copy an earlier unit of this task wrote)
        return pack, start + offset

    def _pack_spans(self) -> dict[str, dict[int, Span]]:
        """Array -> cell -> its place in a pack, from every commit record held: indexed once (and again only
        when more records are held)."""
        records = self.records(refresh=False)
        if self._spans[0] != len(records):
            index: dict[str, dict[int, Span]] = {}
            taken: list[tuple[str, int, int, str]] = []
            for rank, rec in records.items():
                for path, cell, span in self._places(f"{RANKS}/{rank}.json", f"delete the record, ingest rank "
                                                     f"{rank} again", rec.packs, rec.spans, rec.cells, taken):
                    index.setdefault(path, {}).setdefault(cell, span)
            self._refuse_overlaps(taken)
            self._spans = (len(records), index)
        return self._spans[1]

    def _places(self, record: str, remedy: str, packs: list[str], spans: dict[str, list[list[int]]],
                cells: dict[str, list[int]], taken: list[tuple[str, int, int, str]]) -> Iterator[tuple[str, int, Span]]:
        """A well-formed record's places (packs.places_fit), (array, cell, place), each checked to be exactly
        its cell's shard object, and added to `taken` for `_refuse_overlaps`, which checks that no two share
        a byte: a damaged or hostile record cannot hand one cell another's bytes."""
        for path, places in spans.items():
            plan = self.manifest.arrays.get(path)
            for cell, (k, start, size) in zip(cells[path], places):
                if plan is None or not 0 <= cell < plan.ncells or size != _shard_size(plan, cell):
                    raise StoreError(f"{self.location}: {record} places a cell of {path} wrongly; the store is "
                                     f"damaged ({remedy})")
                taken.append((packs[k], start, start + size, record))
                yield path, cell, (packs[k], start, size)

    def _refuse_overlaps(self, taken: list[tuple[str, int, int, str]]) -> None:
        record = overlapping(taken)
        if record is not None:
            raise StoreError(f"{self.location}: {record} places two cells on the same bytes of a pack; the store "
                             f"is damaged")

    def _assembled_at(self, path: str, cell: int) -> Span | None:
        """An assembled cell's place (a store opened to read one tensor, as an export task does, has read no
        assembly record yet)."""
        self._assemblies_read()
        return self._assembled.get((path, cell))

    def _assemblies_read(self) -> None:
        """The assembly records read, if none were yet (a status reads new ones: `_read_assemblies`)."""
        if self._assemblies is None:
            self._read_assemblies()

    def _read_assemblies(self) -> None:
        """The assembly records (packs.py) not read yet: one listing, then the new ones together."""
        held = self._assemblies = self._assemblies if self._assemblies is not None else set()
        keys = [k for k in self.backend.list(ASSEMBLED) if ASSEMBLY_KEY.fullmatch(k) and k not in held]
        for key, raw in zip(keys, self.backend.read_many(keys)):
            if raw is None:
                raise StoreError(f"{self.location}: {key} was listed but cannot be read; is another process "
                                 f"deleting the store?")
            try:
                data = json.loads(raw)
            except ValueError:
                data = None
            self._hold_assembly(key, data)

    def _hold_assembly(self, key: str, data: Any) -> None:
        """An assembly record's cells, each checked as a commit record's are (`_places`), now present."""
        if not isinstance(data, dict) or not places_fit(data.get("packs"), data.get("spans"), data.get("cells")) \
                or [assembly_key(p) for p in data["packs"]] != [key]:  # its own pack, never a unit's
            raise StoreError(f"{self.location}: {key} is damaged; delete it (the cells it places are assembled "
                             f"again from the committed pieces)")
        taken: list[tuple[str, int, int, str]] = []
        for path, cell, span in self._places(key, "delete it: its cells are assembled again", data["packs"],
                                             data["spans"], data["cells"], taken):
            self._assembled.setdefault((path, cell), span)
            self._present.add(self.cell_key(path, self.manifest.arrays[path].cell_index(cell)))
        self._refuse_overlaps(taken)
        if self._assemblies is not None:
            self._assemblies.add(key)

    def write_staging(self, rank: int, parts: list[Part]) -> str:
        key = f"{STAGING}/{rank}.bin"
        self.backend.write(key, parts)
        return key

    def put_blob(self, data: bytes | memoryview) -> str:
        """A plain tensor's bytes, stored once by their digest. On object storage they are written without
        asking first (the same bytes under the same name: one PUT, where a HEAD and s3fs's listing after
        its 404 took two), and once per process."""
        digest = hashlib.blake2b(data, digest_size=20).hexdigest()
        key = f"{BLOBS}/{digest}"
        if digest not in self._blobs and (self.backend.local_path(key) is None or not self.backend.exists(key)):
            self.backend.write(key, [data])
        self._blobs.add(digest)
        return digest

    def commit_ranks(self, records: list[CommitRecord], written: list[str]) -> None:
        """Make everything the units wrote durable, then write their records: each now counts as done.
        A worker commits the units of its batch at once (ingest.py), with one sync for all of them."""
        self._close_pack()
        self.backend.publish([(f"{RANKS}/{r.rank}.json", json.dumps(r.to_json()).encode()) for r in records],
                             after=dict.fromkeys(written))
        for record in records:
            self._hold(record)
        self._unsent.clear()

    def remember(self, record: CommitRecord, staging: bytes | None = None) -> None:
        """A record this run's worker committed (ingest.py): kept as if read back from the store, with the
        staging file the worker wrote, if it handed that back (`_staged`)."""
        if 0 <= record.rank < self.manifest.world_size:
            self._hold(record)
            if staging is not None:
                self._keep_staging(record.rank, staging)

    # ------------------------------------------------------------------ records and status
    def records(self, refresh: bool = True) -> dict[int, CommitRecord]:
        """Commit records by rank (cached: a committed record never changes). `refresh=False` lists the
        store for newly committed ranks only if this process never has."""
        if refresh or not self._listed:
            with gc_paused():
                self.records_of(self.committed())
            self._listed = True
        return dict(sorted(self._records.items()))

    def committed(self) -> set[int]:
        """The ranks whose commit records the store holds now: one listing, no record read. A worker
        reads only the records it needs (ingest.py); reading all of them was most of its requests on S3."""
        self._committed = {}
        for key in self.backend.list(RANKS):
            name = key.rsplit("/", 1)[-1]
            if not re.fullmatch(r"(0|[1-9][0-9]{0,6})\.json", name):
                continue  # not a commit record (a stray file, an editor's backup): never trusted
            if int(name[:-5]) < self.manifest.world_size:
                self._committed[int(name[:-5])] = key
        return set(self._committed)

    def records_of(self, ranks: Iterable[int]) -> dict[int, CommitRecord]:
        """The commit records of those of `ranks` that are committed (as of the last `committed()` or as
        this process committed or was handed them), each read once, together (`Backend.read_many`)."""
        wanted = sorted(set(ranks))
        new = [(rank, self._committed[rank]) for rank in wanted if rank not in self._records and rank in self._committed]
        for at in range(0, len(new), RECORDS_TOGETHER):
            some = new[at:at + RECORDS_TOGETHER]
            for (rank, key), raw in zip(some, self.backend.read_many([key for _, key in some])):
                if raw is None:
                    raise StoreError(f"{self.location}: {key} was listed but cannot be read; is another process "
                                     f"deleting the store?")
                self._hold(self._decode_record(raw, key))
        return {rank: self._records[rank] for rank in wanted if rank in self._records}

    def _hold(self, record: CommitRecord) -> None:
        """Keep a record; staged bytes inline in it count against STAGING_CACHE_BYTES like a kept staging
        file (a worker inlines at most its share of that: sink/cells.py), so the two together stay bounded."""
        held = self._records.get(record.rank)
        before = held.inline if held is not None else None
        self._staged_bytes += len(record.inline or b"") - len(before or b"")
        self._records[record.rank] = record

    def _decode_record(self, raw: bytes, key: str) -> CommitRecord:
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        return CommitRecord.from_json(data, f"{self.location}: {key}")

    def cells_present(self, path: str) -> set[int]:
        """Flat indices of the cells of `path` that committed ranks have delivered."""
        plan = self.manifest.arrays[path]
        if plan.staged:
            return {0} if self.has_cell(plan, (0,) * len(plan.shape)) else set()
        cells = self._recorded_cells(path)
        if plan.flat:  # cells assembled from several units' staged parts
            cells.update(i for i in self._staged_cells(plan) - cells if self.has_cell(plan, self._row_cell(plan, i)))
        return cells

    def _recorded_cells(self, path: str) -> set[int]:
        """Flat indices of the cells of `path` that commit records list."""
        cells: set[int] = set()
        for rec in self.records(refresh=False).values():
            cells.update(rec.cells.get(path, ()))
        return cells

    @staticmethod
    def _row_cell(entry: ArrayEntry, cell: int) -> tuple[int, ...]:
        return (cell,) + (0,) * (len(entry.shape) - 1)

    def _staged_cells(self, entry: ArrayEntry) -> set[int]:
        """The cells of a flat entry that committed units have staged parts of."""
        span = entry.cell_elements
        return {offsets[0] // span for rec in self.records(refresh=False).values()
                for offsets, _, _, _ in rec.staged.get(entry.path, ())}

    def status(self) -> Status:
        records = self.records()
        done = sorted(records)
        missing = sorted(set(range(self.manifest.world_size)) - set(done))
        complete, partial = [], {}
        with self._cells_as_of_now():
            for path, plan in self.manifest.arrays.items():
                have = len(self.cells_present(path))
                if have >= plan.ncells:
                    complete.append(path)
                elif plan.staged:  # not assembled yet: count the elements its committed pieces cover
                    pieces = self._staged_pieces(plan)
                    partial[path] = sum(math.prod(s) for _, s in pieces) / max(math.prod(plan.shape), 1)
                else:
                    partial[path] = have / plan.ncells
        return Status(self.manifest.world_size, done, missing, complete, partial)

    # ------------------------------------------------------------------ staged (small) arrays
    def assemble_ready(self, verify: bool = False) -> list[str]:
        """Assemble every staged array whose pieces are all committed. Idempotent; returns what it wrote.

        Under hybrid sharding a piece is staged once per replica group; the lowest rank's copy is used, and
        with `verify` every other copy must match it bit for bit. What is looked for, read and written here
        goes to the backend together (`_cells_as_of_now`, `_fetch_staging`, `Backend.write_many`): on
        object storage, a few waits for the service instead of one per array and per rank.
        """
        self.records()  # once: what every array below is assembled from (a listing each was a request each)
        written: list[str] = []
        out: list[tuple[str, bytes]] = []
        placed: list[tuple[str, int]] = []  # (path, flat index) of each in `out`
        held = 0  # bytes in `out`

        def write(entry: ArrayEntry, index: tuple[int, ...], data: bytes, valid_rows: int, what: str) -> None:
            nonlocal held
            key, parts = self._cell_object(entry, index, [data], valid_rows)
            out.append((key, joined(parts)))
            placed.append((entry.path, entry.flat_index(index)))
            held += len(out[-1][1])
            written.append(what)
            if held >= ASSEMBLED_WRITE_BYTES:
                flush()

        def flush() -> None:
            nonlocal held
            if self.manifest.packed:
                self._write_assembly(placed, [data for _, data in out])
            else:
                self.backend.write_many(out)
            for key, _ in out:
                self._written(key)
            out.clear()
            placed.clear()
            held = 0

        with self._cells_as_of_now():
            todo: dict[str, set[int]] = {}  # path -> its flat cells to write (empty for a whole staged array)
            for entry in self.manifest.arrays.values():
                if entry.staged:
                    if not self.has_cell(entry, (0,) * len(entry.shape)):
                        todo[entry.path] = set()
                elif entry.flat and (cells := self._staged_cells(entry) - self.cells_present(entry.path)):
                    todo[entry.path] = cells
            holders = self._staged_by_path()
            self._fetch_staging(sorted({rank for path in todo for rank, _ in holders.get(path, ())}))
            for path, cells in todo.items():
                entry = self.manifest.arrays[path]
                if not entry.staged:
                    self._assemble_flat_cells(entry, cells, verify, write)
                    continue
                pieces = self._staged_pieces(entry, verify, holders.get(entry.path, []))
                if sum(math.prod(s) for _, s in pieces) < math.prod(entry.shape):
                    continue
                if entry.shape:
                    write(entry, (0,) * len(entry.shape), self._assemble(entry, pieces).tobytes(), entry.shape[0],
                          entry.path)
                else:
                    written.append(entry.path)
            flush()
        self._created = False
        return written

    def _write_assembly(self, cells: list[tuple[str, int]], data: list[bytes]) -> None:
        """Assembled cells, packed: their pack, then the assembly record that places them (packs.py)."""
        if not cells:
            return
        pack = Pack(self.backend)
        record: dict[str, Any] = {"packs": [pack.key], "cells": {}, "spans": {}}
        try:
            for (path, cell), shard in zip(cells, data):
                _, start, size = pack.append([shard])
                record["cells"].setdefault(path, []).append(cell)
                record["spans"].setdefault(path, []).append([0, start, size])
            pack.close(durable=True)
        except BaseException:
            pack.abort()
            raise
        key = assembly_key(pack.key)
        self.backend.write(key, [json.dumps(record).encode()], durable=True)
        self._hold_assembly(key, record)

    def _assemble_flat_cells(self, entry: ArrayEntry, todo: set[int], verify: bool, write: Any) -> None:
        """Write (`write`) each cell in `todo` of a flat entry that units share, once all its parts are committed."""
        span, total = entry.cell_elements, math.prod(entry.shape)
        by_cell: dict[int, Pieces] = {}
        for key, where in self._staged_pieces(entry, verify).items():
            by_cell.setdefault(key[0][0] // span, {})[key] = where
        for cell in sorted(todo):
            lo, hi = cell * span, min((cell + 1) * span, total)
            pieces = by_cell[cell]
            if sum(s[0] for _, s in pieces) < hi - lo:
                continue  # a unit holding part of it is not in yet
            data = self._assemble(entry, pieces, shape=(hi - lo,), origin=lo)
            write(entry, self._row_cell(entry, cell), data.tobytes(), (hi - lo) * entry.cell[0] // span,
                  f"{entry.path}[{cell}]")

    def _staged_by_path(self) -> dict[str, list[tuple[int, CommitRecord]]]:
        """Each staged array's committed records, in rank order: found once for an assembly, not once per
        array (DeepSeek-V3's 31,000 arrays x 1,922 records took 25 s)."""
        holders: dict[str, list[tuple[int, CommitRecord]]] = {}
        for rank, rec in self.records(refresh=False).items():
            for path in rec.staged:
                holders.setdefault(path, []).append((rank, rec))
        return holders

    def _staged_pieces(self, entry: ArrayEntry, verify: bool = False,
                       holders: list[tuple[int, CommitRecord]] | None = None) -> Pieces:
        """(offsets, sizes) -> (rank, start, nbytes) of every committed piece of a staged array (`holders`:
        the records holding its pieces, `_staged_by_path`; else every record)."""
        pieces: Pieces = {}
        for rank, rec in self.records(refresh=False).items() if holders is None else holders:
            for offsets, sizes, start, nbytes in rec.staged.get(entry.path, ()):
                key = (tuple(offsets), tuple(sizes))
                if key not in pieces:
                    pieces[key] = (rank, start, nbytes)
                elif verify:
                    mine, first = self._staged(rank, start, nbytes), self._staged(*pieces[key])
                    if mine != first:
                        at = first_difference(mine, first, dtypes.info(entry.dtype).itemsize, key[1], key[0])
                        raise CheckpointError(f"{rec.file}: replica of {entry.path} differs from rank "
                                              f"{pieces[key][0]}'s copy, first at element {at}")
        return pieces

    def _assemble(self, entry: ArrayEntry, pieces: Pieces, whole: bool = True,
                  shape: tuple[int, ...] | None = None, origin: int = 0) -> np.ndarray:
        """A staged array (or, for a flat entry, the element range of `shape` from `origin`) from its pieces;
        anything no piece covers is a hole (NaN, or zero for integers).

        Every element must be covered at most once, and with `whole` exactly once: completeness is coverage,
        not a sum of piece sizes that an overlap and a gap of the same size would pass."""
        part = shape is not None
        shape = shape or ((math.prod(entry.shape),) if entry.flat else entry.shape)
        full, covered = self._fill(entry, pieces, shape, origin)
        if whole and not covered.all():
            at = int(np.argmin(covered.reshape(-1))) + origin
            raise StoreError(f"{self.location}: {entry.path}: pieces leave element "
                             f"{list(np.unravel_index(at, entry.shape))} uncovered")
        return full if part else full.reshape(entry.shape)

    def arrived(self, entry: ArrayEntry) -> tuple[np.ndarray, np.ndarray]:
        """A staged array not assembled yet, from the pieces committed so far: its values (holes NaN, or
        zero for integers) and, element by element, whether it has arrived. Lazy reads of a partial store
        answer from this for the rows that are in."""
        self.records()
        shape = (math.prod(entry.shape),) if entry.flat else entry.shape
        full, covered = self._fill(entry, self._staged_pieces(entry), shape, 0)
        return full.reshape(entry.shape), covered.reshape(entry.shape).astype(bool)

    def _fill(self, entry: ArrayEntry, pieces: Pieces, shape: tuple[int, ...],
              origin: int) -> tuple[np.ndarray, np.ndarray]:
        """`shape` from `origin` filled with the pieces that fall in it, and where they did; refused where
        two overlap or one lies outside."""
        info = dtypes.info(entry.dtype)
        full = np.frombuffer(bytearray(info.hole(math.prod(shape))), dtype=info.raw).reshape(shape)
        covered = np.zeros(shape, dtype=np.uint8)
        for (offsets, sizes), (rank, start, nbytes) in pieces.items():
            offsets = (offsets[0] - origin,) + offsets[1:]
            box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            if nbytes != math.prod(sizes) * info.itemsize or covered[box].shape != tuple(sizes) or covered[box].any():
                raise StoreError(f"{self.location}: {entry.path}: rank {rank}'s piece at {list(offsets)} overlaps "
                                 f"another or lies outside the tensor; the store is damaged")
            covered[box] = 1
            full[box] = np.frombuffer(self._staged(rank, start, nbytes), info.raw).reshape(sizes)
        return full, covered

    def _staged(self, rank: int, start: int, nbytes: int) -> bytes:
        """A staged piece's bytes: from its commit record where they are inline there, or from the rank's
        whole staging file where that is kept (handed back by the worker that wrote it, or fetched by
        `_fetch_staging`), else read on its own."""
        inline = self._records[rank].inline if rank in self._records else None
        whole = inline if inline is not None else self._staging.get(rank)
        data = whole[start:start + nbytes] if whole is not None else self.backend.read(f"{STAGING}/{rank}.bin",
                                                                                       start, nbytes)
        if len(data) != nbytes:
            where = f"{RANKS}/{rank}.json's staged bytes are" if inline is not None else f"{STAGING}/{rank}.bin is"
            raise StoreError(f"{self.location}: {where} shorter than its commit record says; the store is damaged "
                             f"(re-ingest rank {rank})")
        return data

    def _keep_staging(self, rank: int, data: bytes) -> None:
        """A rank's whole staging file, kept while all kept fit in STAGING_CACHE_BYTES."""
        if rank not in self._staging and self._staged_bytes + len(data) <= STAGING_CACHE_BYTES:
            self._staging[rank] = data
            self._staged_bytes += len(data)

    def _fetch_staging(self, ranks: list[int]) -> None:
        """The whole staging files of `ranks` not kept yet, fetched together while they fit in what is left of
        STAGING_CACHE_BYTES (a larger one is read piece by piece): on object storage one request per rank,
        sent at once, instead of one per piece of every staged tensor. A file's size is what its commit
        record lists in it, not another request."""
        budget, want = STAGING_CACHE_BYTES - self._staged_bytes, []
        for rank in ranks:
            size = max((start + n for pieces in self._records[rank].staged.values() for *_, start, n in pieces),
                       default=0)
            if rank not in self._staging and self._records[rank].inline is None and size <= budget:
                want.append((rank, size))
                budget -= size
        for (rank, size), data in zip(want, self.backend.read_many([f"{STAGING}/{r}.bin" for r, _ in want])):
            if data is not None:  # (a missing one is reported by the read of its first piece)
                self._keep_staging(rank, data[:size])

    # ------------------------------------------------------------------ reading
    @property
    def zarr(self) -> zarr.Group:
        import zarr  # only here: a store's own reads and writes never need it

        if self._zarr_root is None:
            inner = self.backend.zarr_store()
            view = zarr_view(inner, self._zarr_spans) if self.manifest.packed else inner
            self._zarr_root = zarr.open_group(store=view, mode="r", zarr_format=3)
        if self.manifest.packed:  # the cells of every record held so far, as Zarr's view finds them
            held = self._pack_spans()
            self._assemblies_read()
            if self._zarr_indexed != (self._spans[0], len(self._assembled)):  # (Store.read comes here each slice)
                places = [((path, cell), span) for path, cells in held.items() for cell, span in cells.items()]
                self._zarr_spans.update((self.cell_key(path, self.manifest.arrays[path].cell_index(cell)), span)
                                        for (path, cell), span in [*places, *self._assembled.items()])
                self._zarr_indexed = (self._spans[0], len(self._assembled))
        return self._zarr_root

    def read(self, path: str, selection: Any = slice(None)) -> np.ndarray:
        """Raw (store dtype) values of a slice of one array; Zarr fetches only the inner chunks it needs."""
        return np.asarray(self.zarr[path][selection])  # (an ndarray already: no copy)

    def stream(self, path: str, max_bytes: int = 16 << 20, allow_partial: bool = False,
               rows: tuple[int, int] | None = None) -> Iterator[Part]:
        """The array's bytes in C order (or only rows [first, stop) of it), as parts: file ranges where the
        backend has files (zero copy). A block of whole rows is one byte range of every cell it touches,
        which is how the Hugging Face export splits fused weights without holding them.

        With `allow_partial`, cells no rank has delivered yet come out as holes (NaN, or zero for integer
        dtypes) instead of raising.
        """
        plan = self.manifest.arrays[path]
        if not plan.shape or 0 in plan.shape:
            return
        first, stop = rows or (0, plan.shape[0])
        info = dtypes.info(plan.dtype)
        row_bytes = math.prod(plan.shape[1:]) * info.itemsize
        if tuple(plan.cell[1:]) == tuple(plan.shape[1:]):
            for i in range(first // plan.cell[0], -(-stop // plan.cell[0])):
                index = (i,) + (0,) * (len(plan.shape) - 1)
                cell_lo, cell_hi = plan.cell_bounds(index)[0]
                lo, hi = max(cell_lo, first), min(cell_hi, stop)
                if allow_partial and not (self.has_cell(plan, index) if plan.staged
                                          else plan.flat_index(index) in self.cells_present(path)):
                    if plan.staged:
                        yield self._assemble(plan, self._staged_pieces(plan), whole=False)[lo:hi].tobytes()
                        continue
                    step = max(1, max_bytes // max(row_bytes, 1))
                    for start in range(lo, hi, step):
                        yield info.hole((min(start + step, hi) - start) * row_bytes // info.itemsize)
                    continue
                nbytes = (hi - lo) * row_bytes
                yield from self._file_parts(*self._cell_at(path, index, nbytes, (lo - cell_lo) * row_bytes), nbytes,
                                            max_bytes)
        else:  # the grid cuts trailing dimensions: let Zarr gather full rows
            step = max(1, max_bytes // max(row_bytes, 1))
            for lo in range(first, stop, step):
                yield np.ascontiguousarray(self.read(path, slice(lo, min(lo + step, stop)))).data

    def stored_crc(self, path: str) -> int | None:
        """The CRC-32 of the whole array's bytes in C order, combined (crc.py) from what each cell's unit
        recorded: the CRC its source file stores for exactly that cell's bytes. None unless every cell is a
        block of whole rows that has one; the export then computes the CRC from the bytes."""
        plan = self.manifest.arrays[path]
        if not all(plan.shape) or tuple(plan.cell[1:]) != tuple(plan.shape[1:]):
            return None
        crcs = self._recorded_crcs(path)
        row_bytes = math.prod(plan.shape[1:]) * dtypes.info(plan.dtype).itemsize
        total = None
        for i in range(plan.grid[0]):
            if i not in crcs:
                return None
            (lo, hi), *_ = plan.cell_bounds((i,) + (0,) * (len(plan.shape) - 1))
            total = crcs[i] if total is None else crc32_combine(total, crcs[i], (hi - lo) * row_bytes)
        return total

    def cell_crc(self, path: str, index: tuple[int, ...]) -> int | None:
        """The CRC-32 of one cell's bytes in C order, where the unit that wrote it recorded the one its source
        file stores for exactly those bytes; else None."""
        return self._recorded_crcs(path).get(self.manifest.arrays[path].flat_index(index))

    def _recorded_crcs(self, path: str) -> dict[int, int]:
        """Cell -> the CRC-32 its unit recorded, for one array: every commit record's, indexed once (an
        export asks for each of thousands of cells) and again only when more records have been read."""
        records = self.records(refresh=False)
        if self._crcs[0] != len(records):
            index: dict[str, dict[int, int]] = {}
            for rec in records.values():
                for p, cells in rec.crcs.items():
                    index.setdefault(p, {}).update((int(cell), crc) for cell, crc in cells.items())
            self._crcs = (len(records), index)
        return self._crcs[1].get(path, {})

    def cell_parts(self, path: str, index: tuple[int, ...], max_bytes: int = 16 << 20,
                   allow_partial: bool = False) -> Iterator[Part]:
        """One cell's values in C order, clipped to the array: where the cell spans its trailing dimensions
        whole they are a prefix of its shard file (file ranges, copied kernel-side), else Zarr reads them.
        With `allow_partial`, a cell no unit has delivered yet comes out as a hole, as in `stream`."""
        plan = self.manifest.arrays[path]
        bounds = plan.cell_bounds(index)
        if not plan.shape or any(hi <= lo for lo, hi in bounds):
            return
        if allow_partial and not (self.has_cell(plan, index) if plan.staged
                                  else plan.flat_index(index) in self.cells_present(path)):
            info = dtypes.info(plan.dtype)
            if plan.staged:  # the pieces that are in, holes around them
                whole = self._assemble(plan, self._staged_pieces(plan), whole=False)
                yield np.ascontiguousarray(whole[tuple(slice(lo, hi) for lo, hi in bounds)]).tobytes()
                return
            count, step = math.prod(hi - lo for lo, hi in bounds), max(1, max_bytes // info.itemsize)
            for start in range(0, count, step):
                yield info.hole(min(step, count - start))
            return
        if all(hi - lo == c for (lo, hi), c in zip(bounds[1:], plan.cell[1:])):
            nbytes = math.prod(hi - lo for lo, hi in bounds) * dtypes.info(plan.dtype).itemsize
            yield from self._file_parts(*self._cell_at(path, index, nbytes), nbytes, max_bytes)
        else:
            yield np.ascontiguousarray(self.read(path, tuple(slice(lo, hi) for lo, hi in bounds))).data

    def sweep_temporaries(self) -> int:
        """Delete temporary files left by writers that were killed mid-write (their process is gone)."""
        return self.backend.sweep_temporaries()

    def _file_parts(self, key: str, offset: int, nbytes: int, max_bytes: int = 16 << 20) -> Iterator[Part]:
        local = self.backend.local_path(key)
        if local is not None:
            try:
                fd = os.open(local, os.O_RDONLY)
            except FileNotFoundError:
                raise StoreError(f"{self.backend.root}: missing data file {key}; is the store complete?") from None
            try:
                yield FileRange(fd, offset, nbytes, str(local))
            finally:
                os.close(fd)
            return
        for start in range(offset, offset + nbytes, max_bytes):
            data = self.backend.read(key, start, min(max_bytes, offset + nbytes - start))
            if len(data) != min(max_bytes, offset + nbytes - start):
                raise StoreError(f"{self.location}: {key} is shorter than its cells; the store is damaged")
            yield data

    # ------------------------------------------------------------------ the user-facing read API
    def keys(self) -> list[str]:
        """Every leaf path, in state-dict order: sharded tensors and all other values."""
        return self.manifest.tree.leaf_paths()

    def __contains__(self, path: object) -> bool:
        return path in self.manifest.arrays or path in self.manifest.objects

    def __getitem__(self, path: str) -> Any:
        """A lazy `TensorHandle` for a sharded tensor; the value itself for anything else.

        A value that differs between ranks (an RNG state) comes from the lowest rank; `values(path)`
        has all of them.
        """
        entry = self.manifest.arrays.get(path)
        if entry is not None:
            return TensorHandle(self, entry)
        if path not in self.manifest.objects:
            raise KeyError(path)
        by_rank = self.values(path)
        if not by_rank:
            raise StoreError(f"{path}: no rank holding it has been ingested yet")
        return by_rank[min(by_rank)]

    def values(self, path: str) -> dict[int, Any]:
        """A non-tensor leaf's value on every ingested rank."""
        return {r: decode_value(self, v) for r, v in self.object_values(path).items()}

    def contributors(self, path: str) -> list[int]:
        """Ranks whose data is in this array so far."""
        self.records()
        return sorted(r for r, rec in self._records.items() if path in rec.cells or path in rec.staged)

    def object_values(self, path: str) -> dict[int, Any]:
        """The encoded value of an object leaf, by rank."""
        return {r: rec.objects[path] for r, rec in self.records(refresh=False).items() if path in rec.objects}

    def blob(self, digest: str) -> bytes:
        return self.backend.read(f"{BLOBS}/{digest}")

    @property
    def location(self) -> str:
        return self.backend.root

    @property
    def storage_options(self) -> StorageOptions:
        return self.backend.storage_options
