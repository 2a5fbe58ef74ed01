"""Packed cells (store format 4, on object storage): a worker task's cells in one object, not one each.

On object storage a request costs more than the bytes of a small cell, and a rank file at W=256 fills
a few cells of each array it holds rows of: one PUT per cell was most of an ingest's requests. In a packed
store a task (a batch of units, ingest.py) appends every cell it writes to one object,
`__shardstore__/packs/<random>.bin`, and each unit's commit record says where each of its cells is
(`CommitRecord.packs`, `.spans`). A cell's bytes in a pack are exactly the shard object it would
otherwise be (shardfile.py), so Zarr's sharding codec reads them as they are, once told where.

What tells Zarr is a storage transformer, the Zarr v3 extension point for this: the arrays' zarr.json
name `shardstore.packed`, which zarr-python refuses to open on its own (rather than read the absent cell
objects as fill values), and `PackedZarrStore`, which implements it: cell keys become byte ranges of
packs, and the transformer is taken out of the metadata it serves. `shardstore.open(...).zarr` is such
a view.

The cells a coordinator assembles from staged pieces (Store.assemble_ready) are packed the same way, each
time it assembles, and placed by an assembly record, `__shardstore__/assembled/<random>.json`, written
after its pack. A pack that no record names (its task failed or was killed before committing) is never
read.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ..ranges import Part

if TYPE_CHECKING:
    import zarr.abc.store
    from zarr.abc.store import ByteRequest
    from zarr.core.buffer import Buffer, BufferPrototype

    from .backend import Backend, Writer

PACKS = "__shardstore__/packs"
PACK_KEY = re.compile(r"__shardstore__/packs/[0-9a-f]{32}\.bin")
ASSEMBLED = "__shardstore__/assembled"  # assembly records: where the cells a coordinator assembled are
ASSEMBLY_KEY = re.compile(r"__shardstore__/assembled/[0-9a-f]{32}\.json")
TRANSFORMER = {"name": "shardstore.packed", "configuration": {"records": "__shardstore__/ranks"}}

# a packed cell's place: (its pack's key, the offset of its shard object there, the object's size)
Span = tuple[str, int, int]


ON_FILE_SYSTEMS = False  # whether a new store on a file system is packed too (tests set it: the same code paths
# as on object storage, without a server)


def packs_cells(backend: Backend) -> bool:
    """Whether a new store there packs its cells: on object storage, where a request costs more than a
    small cell's bytes. On a file system a cell file costs little, and any Zarr reader opens the store."""
    return backend.local_path("") is None or ON_FILE_SYSTEMS


class Pack:
    """One pack being written. Appends return where the cell went; nothing appears until `close`."""

    def __init__(self, backend: Backend):
        self.key = f"{PACKS}/{uuid.uuid4().hex}.bin"
        self._writer: Writer = backend.open_writer(self.key)
        self.size = 0

    def append(self, parts: Iterable[Part]) -> Span:
        offset = self.size
        self.size += self._writer.write(parts)
        return self.key, offset, self.size - offset

    def close(self, durable: bool = False) -> None:
        self._writer.close(durable)

    def abort(self) -> None:
        self._writer.abort()


def assembly_key(pack: str) -> str:
    """The assembly record that places cells in `pack` (named after it: a record places cells only in its own)."""
    return f"{ASSEMBLED}/{pack.rsplit('/', 1)[-1].removesuffix('.bin')}.json"


def places_fit(packs: Any, spans: Any, cells: Any) -> bool:
    """A record's places are well formed: pack names a pack may have (never another key of the store),
    one [pack, offset, size] per cell listed, in range. (Whether they overlap, or have the size their
    cell's shard object has, is checked where they are indexed: `Store._places`.)"""
    if not (isinstance(packs, list) and isinstance(spans, dict) and isinstance(cells, dict)):
        return False
    if not packs:
        return not spans
    return all(isinstance(p, str) and PACK_KEY.fullmatch(p) for p in packs) and spans.keys() == cells.keys() \
        and all(isinstance(places, list) and isinstance(cells[path], list) and len(places) == len(cells[path])
                and all(type(cell) is int for cell in cells[path]) for path, places in spans.items()) \
        and all(isinstance(place, list) and len(place) == 3 and all(type(v) is int and v >= 0 for v in place)
                and place[0] < len(packs) for places in spans.values() for place in places)


def overlapping(ranges: list[tuple[str, int, int, str]]) -> str | None:
    """Of places (pack, start, stop, who placed it), the record that puts a cell on bytes another has."""
    ranges.sort()
    for (pack, _, stop, _), (other, start, _, record) in zip(ranges, ranges[1:]):
        if pack == other and start < stop:
            return record
    return None


def transformed(meta: dict[str, Any]) -> dict[str, Any]:
    """An array's zarr.json in a packed store: Zarr readers that do not know the transformer refuse it."""
    return {**meta, "storage_transformers": [TRANSFORMER]}


def zarr_view(store: zarr.abc.store.Store, spans: Mapping[str, Span]) -> zarr.abc.store.Store:
    """`store` seen through the transformer: `spans` (cell key -> its place; the caller keeps it up to
    date) is consulted for every key read."""
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
    from zarr.storage import WrapperStore

    def within(request: ByteRequest | None, offset: int, size: int) -> RangeByteRequest:
        """A byte request of a cell as one of its pack, never past the cell's end."""
        if request is None:
            start, stop = 0, size
        elif isinstance(request, RangeByteRequest):
            start, stop = request.start, request.end
        elif isinstance(request, OffsetByteRequest):
            start, stop = request.offset, size
        elif isinstance(request, SuffixByteRequest):
            start, stop = size - min(request.suffix, size), size
        else:  # pragma: no cover - zarr's ByteRequest is exactly these three
            raise TypeError(request)
        start, stop = min(start, size), min(stop, size)
        return RangeByteRequest(offset + start, offset + max(start, stop))

    class PackedZarrStore(WrapperStore[Store]):
        def _with_store(self, inner: Store) -> PackedZarrStore:
            return PackedZarrStore(inner)

        async def get(self, key: str, prototype: BufferPrototype,
                      byte_range: ByteRequest | None = None) -> Buffer | None:
            span = spans.get(key)
            if span is not None:
                pack, offset, size = span
                return await self._store.get(pack, prototype, within(byte_range, offset, size))
            got = await self._store.get(key, prototype, byte_range)
            if got is None or byte_range is not None or not key.endswith("zarr.json"):
                return got
            meta = json.loads(got.to_bytes())
            if isinstance(meta, dict) and meta.get("storage_transformers") == [TRANSFORMER]:
                meta["storage_transformers"] = []
                return prototype.buffer.from_bytes(json.dumps(meta).encode())
            return got

        async def get_partial_values(self, prototype: BufferPrototype,
                                     key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
            return [await self.get(key, prototype, request) for key, request in key_ranges]

        async def exists(self, key: str) -> bool:
            return key in spans or await self._store.exists(key)

    return PackedZarrStore(store)
