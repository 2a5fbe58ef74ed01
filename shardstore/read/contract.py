"""The read contract: what every checkpoint format gives the rest of shardstore, typed.

A checkpoint is read in two halves, and a format is whatever makes both:
- **Planning** (the coordinator, once). A `Format` recognises the checkpoint (`detect`, then `source`,
  or `of_files` for files named one by one) as a `Source`: its units of work in order, and small side
  files (a run's config).
  `plan` reads what it must and gives the `CheckpointSpec`: the key tree, every array's dtype, global
  shape and boxes with the unit holding each (`ShardedSpec`), and which leaves are plain values. The
  store is laid out from the spec alone. `spec.facts` holds what the store keeps of it, typed (facts.py),
  the format's own facts for its workers among them (`reader`).
- **Ingesting** (a worker per unit, in any order, any number of times). `open_unit` opens one unit with
  those facts and checks it against them before anything is written: a `Unit` whose `leaves` are
  `ArrayLeaf`s (the `LocalPiece`s it holds: a box of the array, and where its bytes are in a `Container`)
  and plain values.

Call sequence: `Format.detect` → `Format.source` → `Format.plan` → (the store is created) → per unit,
in workers: `Format.open_unit` → leaves → `Unit.close`. Formats are listed in `registry.py`; a new format
is one module in read/ and one line there.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping, Protocol

from .. import dtypes
from ..facts import CheckpointFacts
from ..errors import CheckpointError
from ..locations import StorageOptions
from ..ranges import FileRange, RemoteRange
from ..records import TensorRef
from ..tree import KeyEncoder, Node, Skeleton
from .arrival import Arrived, Looks
from .primitives import tensors
from .primitives.container import Container
from .source import Source

# A tensor at or below this size held whole by one unit is kept as a value, like a rank file's plain
# tensors (an optimizer's step, a scale); anything larger, or split across units, gets an array.
SMALL_TENSOR_BYTES = 64 << 10


def whole_numbers(values: Any, what: str) -> tuple[int, ...]:
    """`values` (a list or tuple: sizes, offsets, ranks a file states) checked to be whole non-negative
    numbers, or refused naming `what` they are: every format trusts a file's numbers only this far."""
    out = tuple(values) if isinstance(values, (list, tuple)) else None
    if out is None or not all(type(v) is int and v >= 0 for v in out):
        raise CheckpointError(f"{what} {values!r:.80} are not whole non-negative numbers (corrupt or forged file)")
    return out


# ---------------------------------------------------------------------------------------------- the spec
def shard_layout_digest(dtype: str, shape: tuple[int, ...], shards: Any, flat: bool = False) -> str:
    """The shard layout (boxes and which rank of its group holds each), with placements numbered within
    the group so every replica group of a hybrid-sharded checkpoint has the same digest."""
    shards = list(shards)
    order = {r: i for i, r in enumerate(sorted({r for _, _, r in shards}))}
    boxes = sorted((o, s, order[r]) for o, s, r in shards)
    described = (dtype, shape, boxes, "flat") if flat else (dtype, shape, boxes)
    return hashlib.blake2b(repr(described).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class ShardSpec:
    """One box of an array (or, for a flat array, one element range), and the unit that holds it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int  # the holder: its rank (rank files: as the metadata names it) or its unit number


@dataclass(frozen=True)
class ShardedSpec:
    """The global description of one array: what the planner lays out."""

    dtype: str
    shape: tuple[int, ...]
    shards: tuple[ShardSpec, ...]
    flat: bool = False  # shards are element ranges (offsets, sizes) of the flattened tensor, not boxes

    def layout_digest(self) -> str:
        """The digest of its shard layout, which every unit's own list of the global layout must give."""
        return shard_layout_digest(self.dtype, self.shape, ((s.offsets, s.sizes, s.rank) for s in self.shards),
                                   self.flat)


@dataclass
class CheckpointSpec:
    """A checkpoint as the planner sees it, whatever its format."""

    format: str  # the registry name of the format that read it
    world_size: int  # units of work: ranks, or files
    group_size: int  # units per replica group (hybrid sharding); the world size otherwise
    tree: Skeleton
    arrays: dict[str, ShardedSpec]
    replicated: dict[str, TensorRef]  # a plain tensor every unit holds whole (world size 1)
    objects: list[str]  # store paths of every other leaf
    # what the store keeps of it (units, digest, tied names, the format's own facts for its workers, ...);
    # its format and group size are the fields above, its replicas at least the replica groups (plan.py)
    facts: CheckpointFacts = field(default_factory=CheckpointFacts)
    # A unit file's least size, where the metadata planning read places bytes in it (DCP's items): a
    # truncated file is then refused up front, by the dry run too, not by the worker that reaches its end.
    least_sizes: dict[str, int] = field(default_factory=dict)


def replica_count(arrays: dict[str, ShardedSpec]) -> int:
    """The most units holding any one box (one per replica group under hybrid sharding, where a format
    lists every group's holders): with more than one, the store writes each cell once, from the first
    unit to commit it."""
    most = 1
    for a in arrays.values():
        counts: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        for s in a.shards:
            counts[(s.offsets, s.sizes)] = counts.get((s.offsets, s.sizes), 0) + 1
        most = max(most, *counts.values()) if counts else most
    return most


# ---------------------------------------------------------------------------------------------- units
@dataclass
class LocalPiece:
    """A box of an array held in a unit (for a flat array, an element range), and where its bytes are: a
    tensor view into a storage of `container`. The store's `Piece` (sink/cells.py)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: TensorRef
    container: Container = field(repr=False)

    @cached_property
    def _span(self) -> tuple[int, int] | None:
        """Where its bytes are, when contiguous: asked for by `rows` and `crc` for every run, checked once."""
        return tensors.byte_range(self.container, self.tensor)

    def rows(self, first: int, count: int) -> FileRange | RemoteRange | None:
        span = self._span
        if span is None:
            return None
        row = math.prod(self.sizes[1:]) * dtypes.info(self.tensor.dtype).itemsize
        return self.container.range(span[0] + first * row, count * row)

    def values(self) -> Any:
        return tensors.array(self.container, self.tensor)

    def crc(self) -> int | None:
        """The CRC-32 its file stores for exactly this piece's bytes (a tensor that is its whole storage)."""
        span = self._span
        key = self.tensor.storage.key
        if span is None or span != (self.container.storage_offset(key), self.container.entries[f"data/{key}"].size):
            return None
        return self.container.stored_crc(key)


class ArrayLeaf:
    """A unit's share of one array: dtype, global shape, and the pieces it holds (maybe none)."""

    planned = False  # its global shard list was checked against the plan's when read (rank files' ShardedLeaf)

    def __init__(self, dtype: str, shape: tuple[int, ...], pieces: list[LocalPiece]):
        self.dtype, self.shape, self.pieces = dtype, shape, pieces

    def layout_digest(self) -> str | None:
        """A digest of every unit's boxes as this unit's file lists them; None where a file lists only its
        own (the plan's layout is then checked box by box)."""
        return None


class Unit(Protocol):
    """One unit of work, opened and checked: a rank file, a .distcp file, a safetensors shard."""

    path: str
    rank: int  # its number in the checkpoint
    world_size: int
    group_rank: int  # within its replica group (hybrid sharding), else its rank
    group_size: int
    leaves: dict[str, Any]  # store path -> ArrayLeaf | TensorRef | plain value

    @property
    def size(self) -> int: ...

    def value_zip(self, path: str) -> Container: ...

    def identity(self) -> str:
        """Its file's identity (read/primitives/identity.py), from what is already open."""

    def check(self, plan: PlannedCheckpoint) -> None:
        """Refuse, naming the file, a unit that is not part of the checkpoint `plan` was made from: run
        before anything of it is written."""

    def close(self) -> None: ...


class PlannedArray(Protocol):
    """What the plan says of one array (the store's ArrayEntry is one)."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def replicated(self) -> bool: ...  # a plain tensor every unit holds whole

    @property
    def layout(self) -> str | None: ...  # the digest of its shard layout, where the plan has one

    @property
    def staged(self) -> bool: ...  # its pieces are staged, not written into cells

    @property
    def cell(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class PlannedCheckpoint:
    """What the plan says of the whole checkpoint: what each unit checks itself against (`Unit.check`)."""

    world_size: int
    group_size: int
    tree: Node
    arrays: Mapping[str, PlannedArray]
    objects: frozenset[str]  # store paths of its values
    metadata: str | None  # the digest of what the plan was read from
    title: str  # the format's, for messages ("DCP")


# ---------------------------------------------------------------------------------------------- formats
class UnitShare(Protocol):
    """A unit's share of what planning parsed (`Format.unit_share`)."""

    def store_paths(self) -> Iterable[str]:
        """Every store path the unit can hold (besides its `subtrees`): its task is sent their entries of the
        manifest and their places in the output, not all."""

    def subtrees(self) -> Iterable[str]:
        """Store subtrees the unit can hold any path of."""


class Format(Protocol):
    """One checkpoint format: how it is found, planned, and opened unit by unit. Finding is shared
    (source.open_source): a folder is asked `detect`, then each of its sub-folders (a run folder of step
    folders), and `pick` chooses among several by `--tag`/`--step`."""

    name: str  # as stores record it ("torch-save", "dcp", "olmo-core", ...)
    title: str  # as messages name it ("OLMo-core")
    ranked: bool  # units are found by the ranks their names carry: a missing one shows only against the world size
    group_claims: bool  # a unit's group_rank numbers its share within its replica group (one writer per group rank)
    keeps_empty_values: bool  # an empty dict or list among the values survives (DCP drops them)
    # any script's own save (`dcp.save`, per-rank DTensor `torch.save`): its nesting is the script's, and
    # says nothing of a trainer (trainers/ asks this)
    any_script: bool
    shares_folder: bool  # several saves may share one folder, told apart by their files' names (tags)

    def detect(self, folder: str, storage_options: StorageOptions | None) -> bool:
        """Whether `folder` itself is a checkpoint in this format: a cheap look that never raises."""

    def source(self, folder: str, storage_options: StorageOptions | None) -> Source:
        """The checkpoint `folder` is (`detect` said so): its units in order, and its side files."""

    def latest(self, folder: str, storage_options: StorageOptions | None) -> str | None:
        """The checkpoint folder that `folder`'s own pointer to its newest names (Composer's
        latest-rank0.pt link), if it has one."""

    def of_files(self, files: list[str], storage_options: StorageOptions | None) -> "Source | None":
        """The checkpoint some of whose unit files are `files`, or None when they are not this format's."""

    def plan(self, source: "Source", encode_key: KeyEncoder, strict: bool) -> tuple[CheckpointSpec, Unit | None]:
        """The spec, and any unit that planning had to open whole (left open: the caller ingests it from
        there and closes it)."""

    def unit_share(self, path: str, storage_options: StorageOptions | None, facts: dict[str, Any]) -> "UnitShare | None":
        """What opening the unit `path` needs of what planning parsed, small enough to send with a worker's
        task (so no worker parses it again), or None where a unit reads what it needs itself."""

    def open_unit(self, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
                  facts: dict[str, Any], share: Any = None) -> Unit:
        """One unit, checked against `facts` (the spec's extra, as the store kept it), from its `share`
        when planning gave one."""

    def arrivals(self, folder: str, tag: str | None, looks: "Looks") -> "Arrived | None":
        """For `watch`: the checkpoint of this format arriving in `folder` (a local folder), and which of its
        unit files are whole and have held still since the previous look (`looks.still`); None when
        `folder` holds none of this format's. A format whose units cannot be told complete while they
        arrive refuses by name."""

    def unit_kind(self, name: str) -> str:
        """What a unit is, by the name the store records for it ("model files"): for `ls` and `status`."""
