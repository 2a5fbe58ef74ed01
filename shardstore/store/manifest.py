"""The manifest: what the store holds, written once, before any data, and read by every other stage.

It is the contract between ingestion and export: the tree of the state dict (container kinds and real
keys, so torch export rebuilds the exact nesting), the plan of every sharded array, and which paths
hold per-rank values. Zarr's own metadata says how to read each array; this says what it means.
"""

from __future__ import annotations

import base64
import builtins
import json
import math
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, Iterable, Iterator

from .. import dtypes
from ..errors import StoreError
from ..facts import CheckpointFacts
from ..paths import pick
from ..tree import Node
from .packs import places_fit

FORMAT_VERSION = 4  # 4: cells may be packed (store/packs.py); 3: a commit record may hold its rank's staged
# bytes; 2: cell files named with Zarr's "." chunk key separator (1: "/")
INLINE_STAGING = 3  # the first format whose commit records may hold their staged bytes
PACKED = 4  # the first format whose cells may be packed
MANIFEST_KEY = "__shardstore__/manifest.json"


@dataclass(frozen=True)
class ArrayEntry:
    """One sharded tensor: its dtype and shape, and the grid it is written and read in (see plan.py)."""

    path: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    cell: tuple[int, ...]  # outer chunk (Zarr shard) shape: the unit of writing
    chunk: tuple[int, ...]  # inner chunk shape: the unit of reading
    staged: bool  # pieces go through per-rank staging; the one cell is assembled when all are in
    replicated: bool = False  # a plain tensor every rank holds whole: the first rank to arrive writes it
    layout: str | None = None  # digest of the planned shard layout: every rank file's metadata must match it
    # Pieces are ranges of the flattened tensor (FSDP1's flat parameters), not boxes. Cells are then
    # blocks of whole rows, so each is one element range; a piece that fills a cell only in part stages
    # that part, and the cell is assembled once every unit holding some of it has committed.
    flat: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.info(self.dtype).itemsize

    @property
    def grid(self) -> tuple[int, ...]:
        """Number of cells along each dimension."""
        return tuple(-(-d // c) if d else 0 for d, c in zip(self.shape, self.cell))

    @property
    def ncells(self) -> int:
        return math.prod(self.grid)

    def cell_index(self, flat: int) -> tuple[int, ...]:
        idx = []
        for n in reversed(self.grid):
            idx.append(flat % n)
            flat //= n
        return tuple(reversed(idx))

    def flat_index(self, index: tuple[int, ...]) -> int:
        flat = 0
        for i, n in zip(index, self.grid):
            flat = flat * n + i
        return flat

    def cell_bounds(self, index: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """[start, stop) of a cell along each dimension, clipped to the array."""
        return tuple((i * c, min((i + 1) * c, d)) for i, c, d in zip(index, self.cell, self.shape))

    def cells_of(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The cells a shard covers, in C order (the shard is aligned to the grid by construction)."""
        ranges = [range(o // c, -(-(o + s) // c)) for o, s, c in zip(offsets, sizes, self.cell)]
        out: list[tuple[int, ...]] = [()]
        for r in ranges:
            out = [prefix + (i,) for prefix in out for i in r]
        return out

    @property
    def cell_elements(self) -> int:
        """Elements per cell (a flat entry's cells are element ranges of this length)."""
        return math.prod(self.cell)

    def flat_cells(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """(cell, first, stop) for every cell the element range [start, start + count) touches, with the
        part of the range inside it (a flat entry: cells span whole rows)."""
        span, total = self.cell_elements, math.prod(self.shape)
        stop = start + count
        return [(i, max(i * span, start), min((i + 1) * span, stop, total))
                for i in range(start // span, -(-stop // span))]

    def to_json(self) -> dict[str, Any]:
        out = {"dtype": self.dtype, "shape": list(self.shape), "cell": list(self.cell),
               "chunk": list(self.chunk), "staged": self.staged, "replicated": self.replicated}
        if self.layout is not None:
            out["layout"] = self.layout
        if self.flat:
            out["flat"] = True
        return out

    @classmethod
    def from_json(cls, path: str, d: dict[str, Any]) -> "ArrayEntry":
        return cls(path, d["dtype"], tuple(d["shape"]), tuple(d["cell"]), tuple(d["chunk"]), d["staged"],
                   d.get("replicated", False), d.get("layout"), d.get("flat", False))


def _v1_megatron_common(tree: Node, format: str) -> str | None:
    """Where version-1 facts' Megatron common state is: a top-level `common_state…` (megatron-core's
    own files, DCP), or the first rank's values in Megatron-LM's torch format."""
    for _, child in tree.children:
        if child.path.startswith("common_state"):
            return child.path
        if child.path == "ranks" and format == "megatron-torch" and child.children:
            return child.children[0][1].path
    return None


@dataclass
class Manifest:
    layout: str
    world_size: int
    tree: Node
    arrays: dict[str, ArrayEntry]
    objects: list[str]  # paths of every leaf that is not a sharded tensor
    facts: CheckpointFacts = field(default_factory=CheckpointFacts)
    version: int = FORMAT_VERSION  # of the store this manifest was written for
    packed: bool = False  # its units' cells are in packs (store format 4, object storage: store/packs.py)

    @property
    def separator(self) -> str:
        """Zarr's chunk key separator in this store's cell names."""
        return "." if self.version >= 2 else "/"

    def part(self, exact: Iterable[str], subtrees: frozenset[str] = frozenset()) -> "Manifest":
        """What a task needs of the manifest: the entries of the store paths its units can hold (`exact`,
        and all `within` `subtrees`), sent with it so its worker reads no manifest (`ingest._task`). Each
        worker read it whole, and DeepSeek-V3's structure (31,015 arrays, 30,644 values: 23 MB of JSON)
        took 1 s and held 165 MB in each. A part has no tree: only units that are checked path by path
        against arrays and values (those with shares: DCP and safetensors files) are sent one."""
        exact = list(exact)
        return replace(self, tree=Node("dict", ""), arrays=pick(self.arrays, exact, subtrees),
                       objects=list(pick(dict.fromkeys(self.objects), exact, subtrees)),
                       facts=self.facts.part(exact, subtrees))

    def json_parts(self, batch: int = 1024) -> Iterator[bytes]:
        """The manifest's JSON (`json.dumps` of its fields, byte for byte), a few arrays' entries at a time:
        built whole, DeepSeek-V3's structure (92k arrays) held 150 MB of dicts, pieces and string at once."""
        head = json.dumps({"format": "shardstore", "version": self.version, "layout": self.layout,
                           "world_size": self.world_size, "facts": self.facts.to_json(), "tree": self.tree.to_json()})
        yield (head[:-1] + ', "arrays": {').encode()
        entries = iter(self.arrays.items())
        sep = ""
        while chunk := list(islice(entries, batch)):
            yield (sep + ", ".join(f"{json.dumps(p)}: {json.dumps(a.to_json())}" for p, a in chunk)).encode()
            sep = ", "
        yield ('}, "objects": ' + json.dumps(self.objects) + (', "packed": true}' if self.packed else "}")).encode()

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> "Manifest":
        if d.get("format") != "shardstore":
            raise StoreError(f"{where}: not a shardstore store")
        if d.get("version", 0) > FORMAT_VERSION:
            raise StoreError(f"{where}: written by a newer shardstore (store format {d.get('version')}, "
                             f"this one reads up to {FORMAT_VERSION}); upgrade shardstore")
        try:
            arrays = {p: ArrayEntry.from_json(p, a) for p, a in d["arrays"].items()}
            facts = (CheckpointFacts.from_json(d["facts"], where) if "facts" in d
                     else CheckpointFacts.from_extra(d.get("extra", {})))
            tree = Node.from_json(d["tree"])
            if facts.version < 2:
                facts = replace(facts, megatron_common=_v1_megatron_common(tree, facts.format))
            manifest = cls(d["layout"], d["world_size"], tree, arrays, d["objects"], facts, int(d.get("version", 1)),
                           d.get("packed", False))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise StoreError(f"{where}: corrupt manifest ({type(exc).__name__}: {str(exc)[:80]})") from None
        if not (isinstance(manifest.world_size, int) and 0 < manifest.world_size <= 1 << 20
                and isinstance(manifest.objects, list) and isinstance(manifest.packed, bool)):
            raise StoreError(f"{where}: corrupt manifest (world size or tree)")
        return manifest


@dataclass
class CommitRecord:
    """What one unit of work (a rank file, a .distcp file) delivered. Written last, once everything it lists
    is durable: a unit counts as ingested exactly when its record exists."""

    rank: int  # the unit's number in the checkpoint
    file: str  # its file name, and size: a rerun skips a unit committed from the same file
    bytes: int
    cells: dict[str, list[int]]  # store path -> flat indices of the cells this unit wrote
    staged: dict[str, list[list[Any]]]  # store path -> [offsets, sizes, start, nbytes] in its staging file
    objects: dict[str, Any]  # store path -> the value (typed JSON) this unit holds there
    only: str | None = None  # the subtree whose tensors it wrote, when not all (a scratch store for one export)
    world_size: int = 0
    group_rank: int = 0
    group_size: int = 0
    crcs: dict[str, dict[str, int]] = field(default_factory=dict)  # path -> cell -> its source's CRC-32
    identity: str | None = None  # which file it was (read/primitives/identity.py); None in stores from before it
    direct: str | None = None  # its pieces went straight into the output of this layout (sink/, each format's `plan_direct`)
    runs: list[list[int]] = field(default_factory=list)  # [file, offset, length, CRC-32] it wrote into zip entries
    # its staged pieces' bytes, where few (store format 3): no staging file, nothing more to write or read
    inline: builtins.bytes | None = field(default=None, repr=False)  # (the field `bytes` hides the type)
    # in a packed store (format 4): the packs its cells are in, and for each of `cells`, [pack, offset, size]
    packs: list[str] = field(default_factory=list)
    spans: dict[str, list[list[int]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "group_rank": self.group_rank,
                "group_size": self.group_size, "file": self.file, "bytes": self.bytes, "only": self.only,
                "cells": self.cells, "staged": self.staged, "objects": self.objects, "crcs": self.crcs,
                "identity": self.identity, "direct": self.direct, "runs": self.runs,
                **({"staging": base64.b64encode(self.inline).decode("ascii")} if self.inline is not None else {}),
                **({"packs": self.packs, "spans": self.spans} if self.packs else {})}

    @classmethod
    def from_json(cls, d: Any, where: str) -> "CommitRecord":
        try:
            record = cls(d["rank"], d["file"], d["bytes"], d["cells"], d["staged"], d["objects"], d.get("only"),
                         d.get("world_size", 0), d.get("group_rank", 0), d.get("group_size", 0), d.get("crcs", {}),
                         d.get("identity"), d.get("direct"), d.get("runs", []), _inline(d.get("staging")),
                         d.get("packs", []), d.get("spans", {}))
        except (KeyError, TypeError, ValueError):  # (ValueError: staged bytes that are not base64)
            record = None
        if record is None or not all(isinstance(v, t) for v, t in (
                (record.rank, int), (record.file, str), (record.bytes, int), (record.cells, dict),
                (record.staged, dict), (record.objects, dict), (record.crcs, dict))) \
                or not isinstance(record.identity, (str, type(None))) or not isinstance(record.direct, (str, type(None))) \
                or not all(
                isinstance(c, dict) and all(isinstance(v, int) for v in c.values()) for c in record.crcs.values()) \
                or not isinstance(record.runs, list) or not all(
                isinstance(r, list) and len(r) == 4 and all(isinstance(v, int) for v in r) for r in record.runs) \
                or not places_fit(record.packs, record.spans, record.cells):
            raise StoreError(f"{where}: damaged commit record; delete it and ingest that rank again")
        return record


def _inline(text: Any) -> bytes | None:
    """A record's inline staged bytes (base64), checked: anything else is a damaged record."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise TypeError("staged bytes are not a string")
    return base64.b64decode(text, validate=True)
