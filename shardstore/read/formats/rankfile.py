"""One rank file, read: who wrote it, the global shard layout of every ShardedTensor, its local pieces."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from ... import dtypes
from ...errors import CheckpointError, ShardstoreError, closed_on_error
from ...locations import StorageOptions, folder_of
from ...records import TensorRef
from ...tree import KeyEncoder, Skeleton
from ..arrival import Arrived
from ..contract import (ArrayLeaf, CheckpointSpec, LocalPiece, PlannedCheckpoint, ShardedSpec, ShardSpec,
                        shard_layout_digest, whole_numbers)
from ..layouts import discover, name_rank, refuse_mixed, scan
from ..primitives import tensors
from ..primitives.container import TorchZip
from ..primitives.flatten import flatten
from ..primitives.identity import container_identity
from ..primitives.skim import Skimmed, skim
from ..primitives.unpickle import DTensor, ShardedTensor, load
from ...trainers import composer
from ..source import Source, check_step, config_files, hf_files
from . import dtensor

MAX_WORLD_SIZE = 1 << 20
COMPOSER_TIMESTAMP = "state/timestamp"  # what Composer names its files by (trainers/composer.py)


class ShardedLeaf(ArrayLeaf):
    """A ShardedTensor of this rank: dtype, global shape, local pieces, and the global shard list (every
    rank's shard, repeated in every file), parsed once when first asked for.

    A worker only checks that list (its own entries against its pieces, the whole against the plan's
    digest), so it works on plain tuples; the typed `spec` is built where the store is planned. When the
    list was skimmed (read/primitives/skim.py) it is `planned`: equal to the plan's, which is FSDP's chunk layout."""

    def __init__(self, dtype: str, shape: tuple[int, ...], pieces: list[LocalPiece], metadata: Any = None,
                 where: str = "", planned: bool = False, shared: dict[Any, Any] | None = None):
        super().__init__(dtype, shape, pieces)
        self._metadata, self._where, self.planned = metadata, where, planned
        # Parsed lists by list object: a skimmed file's tensors of one layout share one decoded list.
        self._shared: dict[Any, Any] = {} if shared is None else shared
        self._spec: ShardedSpec | None = None

    def _global(self) -> list[tuple[Any, Any, Any]]:
        """(offsets, sizes, placement rank or -1) of every shard, as the file says them (unchecked)."""
        try:
            shards = self._metadata.shards_metadata
            key = ("boxes", id(shards))
            if key not in self._shared:
                self._shared[key] = [(tuple(m.shard_offsets), tuple(m.shard_sizes),
                                      -1 if m.placement is None else m.placement.rank()) for m in shards]
            listed: list[tuple[Any, Any, Any]] = self._shared[key]
            return listed
        except (AttributeError, TypeError) as exc:
            raise CheckpointError(f"{self._where}: malformed ShardedTensor metadata ({exc})") from None

    @property
    def spec(self) -> ShardedSpec:
        if self._spec is None:
            key = ("spec", id(self._global()))
            if key not in self._shared:
                try:
                    self._shared[key] = tuple(ShardSpec(tuple(map(int, o)), tuple(map(int, s)), -1 if r is None else int(r))
                                              for o, s, r in self._global())
                except (TypeError, ValueError) as exc:
                    raise CheckpointError(f"{self._where}: malformed ShardedTensor metadata ({exc})") from None
            self._spec = ShardedSpec(self.dtype, self.shape, self._shared[key])
        return self._spec

    def layout_digest(self) -> str:
        """`ShardedSpec.layout_digest` of the plan for an honest file, computed from the file's own values: anything
        that is not a plain int gives another digest, so the comparison with the plan checks it too."""
        shards = self._global()
        key = ("digest", self.dtype, self.shape, id(shards))  # a file's tensors of one shape share one list
        if key not in self._shared:
            try:
                self._shared[key] = shard_layout_digest(self.dtype, self.shape,
                                                        ((o, s, -1 if r is None else r) for o, s, r in shards))
            except TypeError:  # ranks that do not even sort
                raise CheckpointError(f"{self._where}: malformed ShardedTensor metadata (placement ranks)") from None
        digest: str = self._shared[key]
        return digest

    def check_own_pieces(self, rank: int, world: int, group_rank: int, group_size: int) -> None:
        """Every local shard must be exactly one of the global list's entries for this rank (offsets, sizes
        and placement), and there must be one for each of them: a file cannot write another rank's rows.

        torch 2.13 names placements by global rank; torch <= 2.1 under hybrid sharding named them by the
        rank within the shard group (`rank:0/…` in every replica group), so a list whose placements all
        lie inside one group's numbering is read in that numbering."""
        if self.planned:
            own = [box for box in [chunk_box(self.shape, rank, world)] if box and all(box[1])]
        else:
            shards = self._global()
            key = ("own", id(shards), rank, world, group_rank, group_size)  # as for `layout_digest`
            if key not in self._shared:
                by_group = group_size < world and all(type(r) is int and 0 <= r < group_size for _, _, r in shards)
                mine = group_rank if by_group else rank
                self._shared[key] = sorted((o, s) for o, s, r in shards if r == mine and all(s))
            own = self._shared[key]
        local = sorted((p.offsets, p.sizes) for p in self.pieces if all(p.sizes))
        if own != local:
            raise CheckpointError(f"{self._where}: local shards {[list(o) for o, _ in local]} are not the shards "
                                  f"the metadata gives rank {rank} ({[list(o) for o, _ in own]}); forged or damaged")


def chunk_box(shape: tuple[int, ...], rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """FSDP's chunk layout (`_create_chunk_sharded_tensor`, torch.chunk along dim 0): the box rank `rank`
    holds, or None for a rank past the last chunk."""
    rows = -(-shape[0] // world)
    if rank * rows >= shape[0]:
        return None
    return (rank * rows,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - rank * rows),) + tuple(shape[1:])


def is_chunk_layout(spec: ShardedSpec, world: int) -> bool:
    """Whether `spec` is exactly FSDP's chunk layout over `world` ranks: what a skimmed file is held to."""
    if not spec.shape or spec.flat:
        return False
    boxes = [chunk_box(spec.shape, r, world) for r in range(world)]
    want = sorted((o, s, r) for r, box in enumerate(boxes) if box for o, s in [box])
    return sorted((s.offsets, s.sizes, s.rank) for s in spec.shards) == want


@dataclass
class RankFile:
    path: str
    rank: int  # global rank
    world_size: int
    group_rank: int  # rank within the process group that sharded the tensors
    group_size: int
    skeleton: Skeleton
    leaves: dict[str, Any]  # path -> ShardedLeaf | TensorRef | python value
    zip: TorchZip = field(repr=False)
    digests: dict[str, str] = field(default_factory=dict)  # each ShardedTensor's shard list (read/primitives/skim.py)

    @property
    def size(self) -> int:
        return self.zip.size

    def value_zip(self, path: str) -> TorchZip:
        return self.zip

    def identity(self) -> str:
        return container_identity(self.zip)

    def check(self, plan: PlannedCheckpoint) -> None:
        """Everything a rank file says of its save against the plan: its rank (by name and inside), its
        process group, its keys, and every ShardedTensor's global layout and local boxes."""
        claimed = name_rank(self.path)
        if claimed is not None and claimed != self.rank:
            raise CheckpointError(f"{self.path}: named rank {claimed} but holds rank {self.rank} (renamed file?)")
        if self.group_size != plan.group_size:
            raise CheckpointError(f"{self.path}: sharded over groups of {self.group_size} ranks, but the store holds "
                                  f"a checkpoint sharded over {plan.group_size} (another checkpoint?)")
        if self.world_size != plan.world_size:
            raise CheckpointError(f"{self.path}: from a world of {self.world_size} ranks, but the store holds a "
                                  f"checkpoint of {plan.world_size} (a rank file from another checkpoint?)")
        if not 0 <= self.rank < plan.world_size:
            raise CheckpointError(f"{self.path}: rank {self.rank} outside world size {plan.world_size}")
        if self.skeleton != plan.tree:
            raise CheckpointError(f"{self.path}: its keys differ from the checkpoint in the store (another checkpoint?)")
        for path, entry in plan.arrays.items():
            leaf = self.leaves.get(path)
            if entry.replicated:
                if not isinstance(leaf, TensorRef) or (leaf.dtype, tuple(leaf.shape)) != (entry.dtype, entry.shape):
                    raise CheckpointError(f"{self.path}: {path} differs from the plain tensor in the store (another "
                                          f"checkpoint?)")
                continue
            if not isinstance(leaf, ArrayLeaf):
                raise CheckpointError(f"{self.path}: {path} is not a ShardedTensor here, but is in the store")
            if (leaf.dtype, leaf.shape) != (entry.dtype, entry.shape):
                raise CheckpointError(f"{self.path}: {path} is {leaf.dtype}{list(leaf.shape)} here but "
                                      f"{entry.dtype}{list(entry.shape)} in the store (another checkpoint?)")
            if entry.layout is not None and not leaf.planned and leaf.layout_digest() != entry.layout:
                raise CheckpointError(f"{self.path}: {path} is sharded differently here than in the rest of the "
                                      f"checkpoint (its shard metadata is forged, damaged or from another run)")
            if not entry.staged:
                for piece in leaf.pieces:
                    if any(o % c or (s % c and o + s != d)
                           for o, s, c, d in zip(piece.offsets, piece.sizes, entry.cell, entry.shape)):
                        raise CheckpointError(f"{self.path}: {path} has a shard at {list(piece.offsets)} that does "
                                              f"not match the checkpoint's shard layout")

    def close(self) -> None:
        self.zip.close()


def _ints(values: Any, what: str, where: str) -> tuple[int, ...]:
    """ShardedTensor metadata's sizes and offsets (a torch.Size, a list; old files may give one int)."""
    return whole_numbers(values if isinstance(values, (list, tuple)) else (values,), f"{where}: {what}")


def _sharded_leaf(st: ShardedTensor, where: str, zf: TorchZip, planned: bool, shared: dict[Any, Any]) -> ShardedLeaf:
    md = st.metadata
    try:
        dtype = str(md.tensor_properties.dtype)
        shape = _ints(md.size, "sizes", where)
        pieces = [LocalPiece(_ints(s.metadata.shard_offsets, "shard offsets", where),
                             _ints(s.metadata.shard_sizes, "shard sizes", where), s.tensor, zf)
                  for s in st.local_shards]
    except AttributeError as exc:
        raise CheckpointError(f"{where}: malformed ShardedTensor metadata ({exc})") from None
    dtypes.info(dtype)
    for piece in pieces:
        if not isinstance(piece.tensor, TensorRef):
            raise CheckpointError(f"{where}: a local shard that is not a tensor (corrupt file)")
        if tuple(piece.tensor.shape) != piece.sizes:
            raise CheckpointError(f"{where}: local shard has shape {piece.tensor.shape}, metadata says {piece.sizes}")
        if piece.tensor.dtype != dtype:
            raise CheckpointError(f"{where}: local shard is torch.{piece.tensor.dtype}, metadata says torch.{dtype}")
        if len(piece.offsets) != len(shape) or any(o < 0 or o + n > d for o, n, d in zip(piece.offsets, piece.sizes, shape)):
            raise CheckpointError(f"{where}: local shard at {list(piece.offsets)} lies outside {list(shape)}")
    return ShardedLeaf(dtype, shape, pieces, md, where, planned, shared)


def _group(pg: Any, name: str) -> tuple[int, int, int, int]:
    """(rank, world size, rank in group, group size) from a ShardedTensor's process-group state, checked."""
    try:
        rank, world = pg.global_rank, pg.global_world_size
        group_rank, group_size = pg.local_rank, pg.local_world_size
    except AttributeError:
        raise CheckpointError(f"{name}: ShardedTensor carries no process-group state") from None
    if not all(type(v) is int for v in (rank, world, group_rank, group_size)) or not (
            0 < group_size <= world <= MAX_WORLD_SIZE and world % group_size == 0
            and 0 <= rank < world and 0 <= group_rank < group_size):
        raise CheckpointError(f"{name}: impossible process group (rank {rank!r:.20} of {world!r:.20}, "
                              f"{group_rank!r:.20} of a group of {group_size!r:.20}); forged or damaged")
    return rank, world, group_rank, group_size


def read_rank_file(path: str | os.PathLike[str], encode_key: KeyEncoder = repr,
                   storage_options: StorageOptions | None = None, strict: bool = False,
                   planned: dict[str, str] | None = None, digests: bool = False) -> RankFile:
    """Open and unpickle one rank file (safely: see `unpickle`), leaving every tensor byte where it is.

    Everything the file says about itself is checked before anything is written: its process group, each
    local shard against its own entry in the global metadata, and every tensor view against its storages.
    With `planned` (each ShardedTensor's digest of its shard list, read/primitives/skim.py, where the plan is FSDP's
    chunk layout) the lists are skimmed instead of built when every digest matches: each local shard is
    then checked against the chunk layout. Otherwise (digests that differ, or `planned` empty: a plan that
    is not one chunk layout over the world, as under hybrid sharding), and with `digests` (the planner),
    the lists are skimmed too, one decoded per distinct digest, and the digests kept (`RankFile.digests`).
    With `planned` None the file is read whole."""
    name = os.fspath(path)
    zf = TorchZip(path, storage_options)
    with closed_on_error(zf.close, name):
        zf.verify("data.pkl")
        data = zf.record("data.pkl")
        skimmed = _skim(name, data, strict, encode_key, forms=True) if planned is not None or digests else None
        if skimmed is not None and planned and skimmed.digests == planned:  # a worker: its lists are the plan's
            rf = _rank_file(name, zf, skimmed.skeleton, skimmed.raw, planned=True)
        elif skimmed is not None:
            # The planner, or a worker whose lists are not the plan's chunk layout (under hybrid sharding every
            # replica group's lists name its own ranks): one list decoded per distinct digest, then every
            # check a whole read makes, on the same lists a whole read would build.
            skimmed.restore_lists(name, strict)
            rf = _rank_file(name, zf, skimmed.skeleton, skimmed.raw)
            rf.digests = skimmed.digests
        else:
            skimmed = None  # free it before the whole file is built
            rf = _rank_file(name, zf, *_tree(load(data, name, strict), name, encode_key))
    return rf


def _tree(obj: Any, name: str, encode_key: KeyEncoder) -> tuple[Skeleton, dict[str, Any]]:
    try:
        return flatten(obj, encode_key)
    except RecursionError:
        raise CheckpointError(f"{name}: values nested too deeply, or containing themselves") from None


# The shard lists of the last file that decoded its own (`_Skimmed.restore_lists`), by normal form. Nothing
# changes a decoded list: a file's tensors already share theirs.
_DECODED: dict[tuple[bytes, bool], Any] = {}


@dataclass
class _Skimmed:
    """A rank file read without its shard lists (read/primitives/skim.py)."""

    skeleton: Skeleton
    raw: dict[str, Any]  # leaves, ShardedTensors with a placeholder for their list
    digests: dict[str, str]  # each ShardedTensor's list, by path
    cut: Skimmed

    def restore_lists(self, name: str, strict: bool) -> None:
        """Put each ShardedTensor's list back, decoded once per distinct digest (tensors of one shape and
        sharding share one list object), or taken from the last file's where its normal form is the same
        bytes: under hybrid sharding the files of one replica group hold the same lists, which no plan
        holds (W=256 in 2 groups, warm: 3.6 -> 3.0 s for a whole unshard)."""
        lists, mine = {}, {}
        for d in set(self.digests.values()):
            key = (self.cut.forms[d], strict)  # the bytes themselves: equal keys are equal lists
            mine[key] = _DECODED[key] if key in _DECODED else self.cut.decode(d, f"{name}: a shard list", strict)
            lists[d] = mine[key]
        _DECODED.clear()  # memory bounded by one file's lists
        _DECODED.update(mine)
        for path, digest in self.digests.items():
            self.raw[path].metadata.shards_metadata = lists[digest]


def _skim(name: str, data: Any, strict: bool, encode_key: KeyEncoder, forms: bool) -> _Skimmed | None:
    """The file's tree and leaves with every global shard list cut out (read/primitives/skim.py), and each
    ShardedTensor's digest of its list; None where the skimmer does not apply to this file."""
    cut = skim(data, forms)
    if cut is None:
        return None
    skeleton, raw = _tree(load(cut.data, name, strict, cut.globals), name, encode_key)
    spans: dict[str, str] = {}
    used: set[int] = set()
    for p, leaf in raw.items():
        if isinstance(leaf, ShardedTensor):
            index = cut.span_index(getattr(getattr(leaf, "metadata", None), "shards_metadata", None))
            if index is None or index in used:
                return None
            used.add(index)
            spans[p] = cut.digests[index]
    # Every cut list is some ShardedTensor's, and nothing kept a reference into them (a trainer's own
    # "shards_metadata" or "placements" entry would have been cut too: that file is read whole).
    if len(used) != len(cut.digests) or cut.elided_kept():
        return None
    return _Skimmed(skeleton, raw, spans, cut)


def _rank_file(name: str, zf: TorchZip, skeleton: Skeleton, raw: dict[str, Any], planned: bool = False) -> RankFile:
    leaves: dict[str, Any] = {}
    groups = set()
    shared: dict[Any, Any] = {}
    for p, leaf in raw.items():
        if isinstance(leaf, ShardedTensor):
            leaves[p] = _sharded_leaf(leaf, f"{name}: {p}", zf, planned, shared)
            groups.add(_group(leaf.pg_state, name))
        elif isinstance(leaf, DTensor):  # a file among ShardedTensor rank files, or named as one
            raise CheckpointError(f"{name}: {p} is a DTensor, in a checkpoint of ShardedTensor rank files")
        else:
            leaves[p] = leaf
    if len(groups) > 1:
        raise CheckpointError(f"{name}: its ShardedTensors name different process groups; forged or damaged")
    # No ShardedTensor at all: FSDP at world size 1 (NO_SHARD) saves whole tensors.
    rank, world, group_rank, group_size = groups.pop() if groups else (0, 1, 0, 1)
    rf = RankFile(name, rank, world, group_rank, group_size, skeleton, leaves, zf)
    for p, leaf in leaves.items():
        if isinstance(leaf, TensorRef):
            tensors.check_view(zf, leaf, p)
        elif isinstance(leaf, ShardedLeaf):
            for piece in leaf.pieces:
                tensors.check_view(zf, piece.tensor, p)
            leaf.check_own_pieces(rank, world, group_rank, group_size)
    return rf


def spec_of(rf: RankFile) -> CheckpointSpec:
    """A rank file describes the whole checkpoint: every rank's shards of every tensor are in its metadata.
    Where the lists can be skimmed, the spec says so (`facts.reader["skim"]`, read/primitives/skim.py): with each list's
    digest where that is FSDP's chunk layout over the world (workers whose lists match then never build
    them), else empty (workers decode one list per distinct digest of their own)."""
    arrays = {p: leaf.spec for p, leaf in rf.leaves.items() if isinstance(leaf, ShardedLeaf)}
    replicated = {p: leaf for p, leaf in rf.leaves.items() if isinstance(leaf, TensorRef) and leaf.shape}
    objects = [p for p in rf.leaves if p not in arrays and p not in replicated]
    spec = CheckpointSpec("torch-save", rf.world_size, rf.group_size, rf.skeleton, arrays, replicated, objects)
    layouts = {(id(a.shards), a.shape): a for a in arrays.values()}  # tensors sharing a list share its check
    if rf.digests and set(rf.digests) == set(arrays):
        chunked = rf.group_size == rf.world_size and all(is_chunk_layout(a, rf.world_size) for a in layouts.values())
        spec.facts = replace(spec.facts, reader={"skim": rf.digests if chunked else {}})
    return spec


# ---------------------------------------------------------------------------------------------- format
class RankFiles:
    """Per-rank `torch.save` files of ShardedTensors: the format any folder of `*rank<N>.pt` files is
    read as, so the registry tries it last."""

    name, title, ranked = "torch-save", "ShardedTensor", True
    group_claims, keeps_empty_values = True, True
    # OLMo's trainer saves ShardedTensors so (its nesting then is OLMo's); tagged saves share a folder
    any_script, shares_folder = False, True

    def detect(self, folder: str, storage_options: StorageOptions | None) -> bool:
        try:
            return bool(scan(folder, storage_options=storage_options))
        except CheckpointError:
            return False

    def source(self, folder: str, storage_options: StorageOptions | None) -> Source:
        return self.find(folder, None, None, storage_options)

    def latest(self, folder: str, storage_options: StorageOptions | None) -> str | None:
        return None  # Composer's latest-rank{r}.pt links are resolved by `find` (layouts.py)

    def find(self, src: str, tag: str | None, step: int | None, storage_options: StorageOptions | None) -> Source:
        """The rank files of the one checkpoint in `src` or one level down, picked by `tag` or `step`."""
        files = [os.fspath(f) for f in discover(src, tag, step, storage_options)]
        return Source(self._format_of(files, storage_options), files, storage_options,
                      _described_by(src, folder_of(files[0]), storage_options))

    def of_files(self, files: list[str], storage_options: StorageOptions | None) -> Source:
        return Source(self._format_of(files, storage_options), files, storage_options)

    def _format_of(self, files: list[str], storage_options: StorageOptions | None) -> str:
        """Rank files of DTensors (a plain FSDP2 `torch.save` per rank) are read by read/formats/dtensor.py."""
        return dtensor.FORMAT if files and dtensor.holds_dtensors(files[0], storage_options) else self.name

    def plan(self, source: Any, encode_key: KeyEncoder, strict: bool) -> tuple[CheckpointSpec, RankFile]:
        """Planned from the first file (every rank's metadata is in every file), which stays open."""
        rf = read_rank_file(source.units[0], encode_key=encode_key, storage_options=source.storage_options,
                            strict=strict, digests=True)
        with closed_on_error(rf.close, rf.path):
            _check_named_step(rf)
            return spec_of(rf), rf

    def unit_share(self, path: str, storage_options: StorageOptions | None, facts: dict[str, Any]) -> None:
        """Each unit reads what it needs itself."""

    def open_unit(self, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
                  facts: dict[str, Any], share: Any = None) -> RankFile:
        return read_rank_file(path, encode_key=encode_key, storage_options=storage_options, strict=strict,
                              planned=facts.get("skim"))

    def arrivals(self, folder: str, tag: str | None, looks: Any) -> Any:
        """Rank files (of ShardedTensors, or of DTensors: rank 0's routes them) count once each is a whole
        torch zip; any folder is one, perhaps still empty."""
        groups = scan(folder, tag)
        refuse_mixed(folder, groups, how="--tag")
        ready = [(os.fspath(path), rank) for ranks in groups.values() for rank, path in ranks.items()
                 if looks.still(os.fspath(path), lambda p, size: _whole_zip(p))]
        first = [p for p, _ in ready[:1]]
        return Arrived(self.of_files(first, None) if first else Source(self.name, []), ready)

    def unit_kind(self, name: str) -> str:
        return "rank files"


def _check_named_step(rf: RankFile) -> None:
    """Composer's timestamp (epoch and batch) in rank 0's file against those its name says: a file of
    another save renamed into this one is refused (the other ranks' are compared with it: store/onesave.py)."""
    timestamp = rf.leaves.get(COMPOSER_TIMESTAMP)
    if isinstance(timestamp, dict):
        for key, named in (("epoch", composer.EPOCH), ("batch", composer.BATCH)):
            check_step(rf.path, f"timestamp {key}", timestamp.get(key), rf.path, named)


def _whole_zip(path: str) -> bool:
    try:
        TorchZip(path).close()
        return True
    except ShardstoreError:
        return False


FORMAT = RankFiles()


def _described_by(src: str, folder: str, storage_options: StorageOptions | None) -> list[str]:
    """The files beside rank files that describe their model: OLMo's config.yaml, and a Hugging Face model's
    files (a run of an HF model saving per-rank state dicts keeps its config.json beside them, or once in
    the run folder the user named, above its step folders)."""
    found = config_files(folder, storage_options)
    beside = hf_files(folder, storage_options)
    if not beside and os.path.normpath(folder_of(folder)) == os.path.normpath(src):
        beside = hf_files(src, storage_options)
    return found + beside
