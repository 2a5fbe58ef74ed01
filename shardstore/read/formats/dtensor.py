"""DTensors in per-rank `torch.save` files: their layout, read from the pickle alone.

A DTensor pickles its global shape and dtype, its placements (one per mesh dimension) and its device
mesh: the mesh's shape and the global rank at each coordinate. That is the whole layout, in every file:
rank 0's file plans the checkpoint, and each worker checks that its own file describes the same layout
(a digest of it) and that its local tensor is the box the layout gives its rank. A box follows
`torch.chunk`, dimension by dimension in mesh order (DTensor's `compute_local_shape_and_global_offset`);
a rank may hold an empty one. `_StridedShard` (FSDP2 over tensor parallelism, where the tensor-parallel
split came first) and torch 2.13's `shard_order` are followed as DTensor follows them, and a shard that is
then not one box of the tensor is refused. `Replicate()` dimensions hold copies: under HSDP each box is held
once per replica group, and the store writes it once; so are the copies of a sliced mesh (FSDP2's dp
sub-mesh of a (dp, tp) mesh: its DTensors held by every dp group). `Partial` (a pending reduction) is
refused by name.

Nothing in these pickles is imported or called: DTensor, its spec, the mesh and the placements are inert
records (read/primitives/unpickle.py); a mesh's process groups are names only.

Two formats read them: veRL's checkpoints (read/formats/verl.py), and here `DTensorFiles`: any folder of
`*rank<N>.pt` files holding a plain `torch.save(model.state_dict())` (or optimizer state) of FSDP2, as
users of `fully_shard` write them (rank-file discovery finds them; rank 0's pickle naming DTensor routes
them here rather than to ShardedTensor rank files).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ...facts import CheckpointFacts
from ... import dtypes
from ...errors import CheckpointError, closed_on_error
from ...locations import StorageOptions
from ...records import TensorRef
from ...tree import KeyEncoder, Node
from ..contract import (SMALL_TENSOR_BYTES, ArrayLeaf, CheckpointSpec, LocalPiece, ShardedSpec, ShardSpec,
                        replica_count, whole_numbers)
from ..layouts import name_rank
from ..primitives import tensors
from ..primitives.container import TorchZip
from ..primitives.flatten import flatten
from ..primitives.unpickle import DeviceMesh, DTensor, Placement, ShardedTensor, load
from ..unit import FileUnit

FORMAT = "dtensor-files"
MAX_MESH = 1 << 20
STATE = "optim/state/"  # veRL's optimizer state, where plain 1-D tensors are FSDP1's flat-parameter shards


# ---------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Mesh:
    """A device mesh as data: its shape, and the global rank at each coordinate (C order) of each of its
    `groups` copies. A mesh sliced out of a larger one (FSDP's data-parallel dimension of a (dp, tp) mesh)
    is one of several disjoint copies, one per coordinate of the dimensions sliced away, and every rank sits
    in exactly one: listing them all, copy after copy, makes a layout read the same from every rank's file,
    and makes the other copies what they are, replicas."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    groups: int = 1
    names: tuple[str, ...] | None = None

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        try:
            flat = self.ranks.index(rank) % math.prod(self.shape)
        except ValueError:
            return None
        coord = []
        for size in reversed(self.shape):
            coord.append(flat % size)
            flat //= size
        return tuple(reversed(coord))


def _names(state: dict[str, Any], where: str) -> tuple[str, ...] | None:
    names = state.get("_mesh_dim_names", state.get("mesh_dim_names"))
    if names is None:
        return None
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{where}: device mesh dimension names that are not names (corrupt file)")
    return names


def _cosets(offsets: list[int], size: int, where: str) -> list[int]:
    """Every copy of a layout over a rank map of `size`: the layout's own offsets, shifted to each position
    not yet covered, in order (what torch's `_MeshLayout.remap_to_tensor` lays out with the complement)."""
    covered = [False] * size
    out = []
    for base in range(size):
        if covered[base]:
            continue
        for o in offsets:
            if base + o >= size or covered[base + o]:
                raise CheckpointError(f"{where}: a device mesh layout that does not tile its ranks (corrupt file)")
            covered[base + o] = True
            out.append(base + o)
    return out


def mesh_of(record: Any, where: str) -> Mesh:
    """The mesh a DeviceMesh pickle describes. torch <= 2.9 keeps the ranks as `mesh` (a tensor whose shape
    is the mesh's: the copy this rank is in) and their flat list; torch >= 2.10 keeps the root mesh's flat
    `_rank_map` and a `_layout` (per mesh dimension, sizes and strides into it) that every copy shares."""
    if not isinstance(record, DeviceMesh):
        raise CheckpointError(f"{where}: a DTensor whose mesh is not a DeviceMesh (corrupt file)")
    state = record.__dict__
    if "_layout" in state:
        flat = whole_numbers(state.get("_flatten_rank_map"), f"{where}: mesh ranks")
        axes = getattr(state["_layout"], "__dict__", {}).get("axes")
        if not isinstance(axes, tuple) or not axes:
            raise CheckpointError(f"{where}: a device mesh without a layout (corrupt file)")
        dims = [(whole_numbers(getattr(a, "__dict__", {}).get("shape"), f"{where}: mesh sizes"),
                 whole_numbers(getattr(a, "__dict__", {}).get("stride"), f"{where}: mesh strides")) for a in axes]
        if any(len(s) != len(t) for s, t in dims):
            raise CheckpointError(f"{where}: a device mesh layout of mismatched sizes and strides (corrupt file)")
        if any(not all(s) for s, _ in dims):
            raise CheckpointError(f"{where}: a device mesh with an axis of size 0 (corrupt file)")
        shape = tuple(math.prod(s) for s, _ in dims)
        if math.prod(shape) > MAX_MESH or len(flat) > MAX_MESH:
            raise CheckpointError(f"{where}: a device mesh of {max(math.prod(shape), len(flat))} ranks (corrupt file)")
        offsets = []
        for index in range(math.prod(shape)):
            offset, rest = 0, index
            for (sizes, strides), size in zip(reversed(dims), reversed(shape)):
                sub, rest = rest % size, rest // size
                for s, t in zip(reversed(sizes), reversed(strides)):
                    offset += (sub % s) * t
                    sub //= s
            offsets.append(offset)
        out = Mesh(shape, tuple(flat[o] for o in _cosets(offsets, len(flat), where)), len(flat) // math.prod(shape),
                   _names(state, where))
    else:
        mesh = state.get("mesh")
        if not isinstance(mesh, TensorRef):
            raise CheckpointError(f"{where}: a device mesh without its ranks (corrupt file)")
        shape = whole_numbers(mesh.shape, f"{where}: mesh sizes")
        if not all(shape):
            raise CheckpointError(f"{where}: a device mesh with an axis of size 0 (corrupt file)")
        out = Mesh(shape, whole_numbers(state.get("_flatten_mesh_list"), f"{where}: mesh ranks"), 1,
                   _names(state, where))
    if (len(out.ranks) != out.groups * math.prod(out.shape) or len(set(out.ranks)) != len(out.ranks)
            or not out.shape):
        raise CheckpointError(f"{where}: a device mesh whose ranks do not fill it (corrupt file)")
    return out


def completed(mesh: Mesh, meshes: list[Mesh]) -> Mesh:
    """A sliced mesh as torch <= 2.9 pickles it (only the copy holding this rank) with all its copies, from a
    mesh of the same file it was sliced from (the largest whose named dimensions include its own, holding its
    ranks at the place slicing would put them). Without one it stays the one copy it is."""
    if mesh.groups != 1 or mesh.names is None:
        return mesh
    for root in sorted(meshes, key=lambda m: -len(m.ranks)):
        if root.groups != 1 or root.names is None or len(root.ranks) <= len(mesh.ranks) \
                or not set(mesh.names) <= set(root.names) or len(set(root.names)) != len(root.names):
            continue
        kept = [root.names.index(n) for n in mesh.names]
        if [root.shape[i] for i in kept] != list(mesh.shape):
            continue
        others = [i for i in range(len(root.shape)) if i not in kept]
        strides = [math.prod(root.shape[i + 1:]) for i in range(len(root.shape))]
        ranks = []
        for away in itertools.product(*(range(root.shape[i]) for i in others)):
            for here in itertools.product(*(range(n) for n in mesh.shape)):
                coord = dict(zip(others, away)) | dict(zip(kept, here))
                ranks.append(root.ranks[sum(coord[i] * strides[i] for i in range(len(root.shape)))])
        out = Mesh(mesh.shape, tuple(ranks), len(ranks) // math.prod(mesh.shape), mesh.names)
        if set(mesh.ranks) <= set(ranks) and out.coordinate(mesh.ranks[0]) == (0,) * len(mesh.shape) and \
                all(out.coordinate(r) == mesh.coordinate(r) for r in mesh.ranks):
            return out
    return mesh


Step = tuple[str, int, int]  # ("shard", tensor dim, split factor) or ("replicate", -1, 1), per mesh dimension


def placements_of(spec: Any, ndim: int, mesh: Mesh, where: str) -> tuple[Step, ...]:
    """One step per mesh dimension, applied left to right as DTensor does. `_StridedShard(d, sf)` (FSDP2 over
    tensor parallelism: the tensor-parallel split happened first) keeps its split factor; torch >= 2.13's
    `shard_order` (plain `Shard`s applied in another order) becomes the split factors torch itself derives
    from it (`DTensorSpec._convert_shard_order_to_StridedShard`)."""
    placements = getattr(spec, "__dict__", {}).get("placements")
    if not isinstance(placements, tuple) or len(placements) != len(mesh.shape):
        raise CheckpointError(f"{where}: a DTensor whose placements do not match its mesh (corrupt file)")
    out: list[Step] = []
    for p in placements:
        kind = p.kind if isinstance(p, Placement) else type(p).__name__
        if kind == "Replicate":
            out.append(("replicate", -1, 1))
        elif kind in ("Shard", "_StridedShard"):
            dim, split = p.__dict__.get("dim"), p.__dict__.get("split_factor", 1) if kind != "Shard" else 1
            if type(dim) is not int or not -ndim <= dim < ndim:
                raise CheckpointError(f"{where}: a {kind} placement on dimension {dim!r:.20} of a {ndim}-d tensor")
            if type(split) is not int or not 1 <= split <= math.prod(mesh.shape):
                raise CheckpointError(f"{where}: a _StridedShard split factor of {split!r:.20} (corrupt file)")
            out.append(("shard", dim % ndim, split))
        elif kind in ("Partial", "_Partial"):
            raise CheckpointError(f"{where}: a Partial DTensor (a reduction still pending when it was saved); "
                                  f"its ranks' values are summands, not shards, and are not read")
        else:
            raise CheckpointError(f"{where}: an unknown DTensor placement {kind!r:.40}")
    order = spec.__dict__.get("shard_order")
    if order is not None and not spec.__dict__.get("use_strided_shard_as_shard_order"):
        for entry in order:
            dim, mesh_dims = entry
            if type(dim) is not int or not isinstance(mesh_dims, tuple) or \
                    any(type(m) is not int or not 0 <= m < len(out) or out[m][:2] != ("shard", dim % ndim)
                        for m in mesh_dims) or len(set(mesh_dims)) != len(mesh_dims):
                raise CheckpointError(f"{where}: a shard order that does not match its placements (corrupt file)")
            for i, m in enumerate(mesh_dims):
                out[m] = ("shard", dim % ndim, math.prod(mesh.shape[e] for e in mesh_dims[:i] if e > m))
    return tuple(out)


def _chunk(size: int, n: int, c: int) -> tuple[int, int]:
    """Positions [a, b) of `torch.chunk`'s chunk c of n over `size` (empty past the end)."""
    step = -(-size // n)
    a = min(size, step * c)
    return a, min(size, a + step)


def _take(runs: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The global indices at positions `spans` of the sequence `runs` describes, as merged runs."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        pos = 0
        for s, e in runs:
            lo, hi = max(a, pos), min(b, pos + e - s)
            if lo < hi:
                start, stop = s + lo - pos, s + hi - pos
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], stop)
                else:
                    out.append((start, stop))
            pos += e - s
    return out


def local_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Step, ...],
              coord: tuple[int, ...], where: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box a mesh coordinate holds, as DTensor's `_compute_local_shape_and_global_offset` computes it:
    `torch.chunk` of each sharded dimension in mesh order, a `_StridedShard` taking chunk c of each of its
    split-factor pieces. A rank may hold an empty box; one whose indices are not one run is refused."""
    runs = [[(0, n)] if n else [] for n in shape]
    for (kind, dim, split), n, c in zip(placements, mesh_shape, coord):
        if kind != "shard":
            continue
        size = sum(e - s for s, e in runs[dim])
        spans = []
        for piece in range(split):
            p0, p1 = _chunk(size, split, piece)
            q0, q1 = _chunk(p1 - p0, n, c)
            spans.append((p0 + q0, p0 + q1))
        runs[dim] = _take(runs[dim], spans)
    if any(len(r) > 1 for r in runs):
        raise CheckpointError(f"{where}: a strided DTensor layout whose shard at mesh coordinate {list(coord)} is "
                              f"not one box of the tensor; not read")
    return (tuple(r[0][0] if r else n for r, n in zip(runs, shape)),
            tuple(r[0][1] - r[0][0] if r else 0 for r in runs))


@dataclass(frozen=True)
class Layout:
    """One tensor leaf of a file, as the plan needs it."""

    kind: str  # "dtensor", "sharded" (FSDP1's ShardedTensor), "flat" (an FSDP1 flat parameter's 1-D
    # optimizer shard), "whole" (a plain tensor)
    dtype: str
    shape: tuple[int, ...]  # global shape (the shard's length for "flat")
    placements: tuple[Step, ...] = ()
    mesh: Mesh | None = None
    where: str = field(default="", compare=False)
    # "sharded": (the rank it places it on, offsets, sizes) of every shard its metadata lists
    shards: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()

    def describe(self) -> tuple[Any, ...]:
        return (self.kind, self.dtype, self.shape, self.placements,
                None if self.mesh is None else (self.mesh.shape, self.mesh.ranks, self.mesh.groups), self.shards)


def dtensor_layout(leaf: DTensor, where: str) -> tuple[Layout, TensorRef]:
    spec, local = leaf.__dict__.get("_spec"), leaf.__dict__.get("_local_tensor")
    meta = getattr(spec, "__dict__", {}).get("tensor_meta")
    if not isinstance(local, TensorRef) or meta is None:
        raise CheckpointError(f"{where}: a DTensor without its local tensor or its spec (corrupt file)")
    shape = whole_numbers(getattr(meta, "shape", None), f"{where}: sizes")
    dtype = str(getattr(meta, "dtype", ""))
    dtypes.info(dtype)
    if local.dtype != dtype:
        raise CheckpointError(f"{where}: local tensor is torch.{local.dtype}, its DTensor says torch.{dtype}")
    mesh = mesh_of(spec.__dict__.get("mesh"), where)
    return Layout("dtensor", dtype, shape, placements_of(spec, len(shape), mesh, where), mesh, where), local


def _placed(placement: Any) -> int:
    """The rank a shard's metadata places it on (-1 for none: such a shard is no rank's)."""
    rank = None if placement is None else placement.rank()
    return rank if type(rank) is int else -1


def sharded_layout(leaf: ShardedTensor, rank: int, where: str) -> tuple[Layout, TensorRef | None]:
    """FSDP1's ShardedTensor (its SHARDED_STATE_DICT without a device mesh): the global shard list every
    rank's file repeats, and this rank's one local shard, which must be the one the list places on it."""
    md = leaf.metadata
    try:
        dtype, shape = str(md.tensor_properties.dtype), whole_numbers(md.size, f"{where}: sizes")
        shards = tuple((_placed(m.placement),
                        whole_numbers(m.shard_offsets, f"{where}: shard offsets"),
                        whole_numbers(m.shard_sizes, f"{where}: shard sizes")) for m in md.shards_metadata)
        local = [(whole_numbers(s.metadata.shard_offsets, f"{where}: offsets"), s.tensor) for s in leaf.local_shards]
    except (AttributeError, TypeError) as exc:
        raise CheckpointError(f"{where}: malformed ShardedTensor metadata ({str(exc)[:80]})") from None
    dtypes.info(dtype)
    placed = [(o, n) for r, o, n in shards if r == rank]
    if len(local) > 1 or len(placed) > 1:
        raise CheckpointError(f"{where}: {max(len(local), len(placed))} shards on rank {rank}; FSDP places one")
    if [o for o, _ in local] != [o for o, _ in placed]:
        raise CheckpointError(f"{where}: its local shard is not the one its metadata places on rank {rank} "
                              f"(a renamed or copied file)")
    if local and (not isinstance(local[0][1], TensorRef) or local[0][1].dtype != dtype):
        raise CheckpointError(f"{where}: its local shard is not a torch.{dtype} tensor (corrupt file)")
    return Layout("sharded", dtype, shape, where=where, shards=shards), local[0][1] if local else None


# ---------------------------------------------------------------------------------------------- files
@dataclass
class File:
    """One rank file read: its tree under its kind, and its leaves (DTensors, tensors, values)."""

    path: str
    kind: str  # "model", "optim", "extra_state" (veRL), or "" (a whole state dict)
    world: int
    rank: int
    zip: TorchZip
    tree: Node
    leaves: dict[str, Any]


def read_file(path: str, kind: str, world: int, rank: int, storage_options: StorageOptions | None, strict: bool,
              encode_key: KeyEncoder) -> File:
    """One rank's file, its state under `kind` in the tree ("model" for veRL's model files; "" for a file
    whose own keys are the top level)."""
    zf = TorchZip(path, storage_options)
    with closed_on_error(zf.close, path):
        zf.verify("data.pkl")
        obj = load(zf.record("data.pkl"), path, strict)
        try:  # an optimizer that has taken no step yet holds no tensor: one value under its kind
            tree, leaves = flatten({kind: obj} if kind else obj, encode_key)
        except RecursionError:
            raise CheckpointError(f"{path}: values nested too deeply, or containing themselves") from None
        return File(path, kind, world, rank, zf, tree, leaves)


def layouts_of(f: File) -> dict[str, tuple[Layout, TensorRef]]:
    """Every tensor leaf of a file that the plan makes an array of, with its local tensor."""
    out = {}
    for path, leaf in f.leaves.items():
        where = f"{f.path}: {path}"
        if isinstance(leaf, DTensor):
            out[path] = dtensor_layout(leaf, where)
        elif isinstance(leaf, ShardedTensor):
            out[path] = sharded_layout(leaf, f.rank, where)  # type: ignore[assignment]
        elif isinstance(leaf, TensorRef):
            tensors.check_view(f.zip, leaf, path)
            nbytes = math.prod(leaf.shape) * dtypes.info(leaf.dtype).itemsize
            if f.kind == "optim" and leaf.shape and path.startswith(STATE):
                if len(leaf.shape) != 1:
                    raise CheckpointError(f"{where}: a plain {len(leaf.shape)}-d optimizer state tensor beside "
                                          f"sharded parameters; expected FSDP1's 1-D flat-parameter shards")
                out[path] = (Layout("flat", leaf.dtype, leaf.shape, (("shard", 0, 1),), None), leaf)
            elif leaf.shape and (f.kind == "model" or nbytes > SMALL_TENSOR_BYTES):  # weights are arrays
                out[path] = (Layout("whole", leaf.dtype, leaf.shape), leaf)
    meshes = list({layout.mesh for layout, _ in out.values() if layout.mesh is not None})
    whole = {m: completed(m, meshes) for m in meshes}  # once per distinct mesh, not per tensor
    return {p: (replace(layout, mesh=whole[layout.mesh]) if layout.mesh is not None else layout, local)
            for p, (layout, local) in out.items()}


def digest_of(f: File, layouts: dict[str, tuple[Layout, TensorRef]]) -> str:
    """What every rank's file of one kind has in common: its keys, and each array's whole layout."""
    described = (f.kind, f.world, f.tree.to_json(), sorted((p, l.describe()) for p, (l, _) in layouts.items()))
    return hashlib.blake2b(repr(described).encode(), digest_size=16).hexdigest()


def box_of(layout: Layout, rank: int, mesh: Mesh | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, sizes) of the box rank `rank` holds of one array, or None when it holds none of it."""
    if layout.kind == "whole":
        return ((0,) * len(layout.shape), layout.shape) if rank == 0 else None
    if layout.kind == "sharded":
        return next(((o, n) for r, o, n in layout.shards if r == rank and all(n)), None)
    used = layout.mesh if layout.kind == "dtensor" else mesh
    coord = used.coordinate(rank) if used is not None else (0,) * (1 if layout.kind == "flat" else 0)
    if coord is None:
        return None  # a rank outside this tensor's mesh holds none of it
    if layout.kind == "flat":
        n = layout.shape[0]
        return (coord[-1] * n,), (n,)
    offsets, sizes = local_box(layout.shape, used.shape, layout.placements, coord,  # type: ignore[union-attr]
                               layout.where)
    return (offsets, sizes) if all(sizes) else None


def boxes(layout: Layout, world: int, mesh: Mesh | None) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(rank, offsets, sizes) of every rank's non-empty box of one array: what the planner lays out."""
    return [(rank, *box) for rank in range(world) if (box := box_of(layout, rank, mesh)) is not None]


def global_shape(layout: Layout, mesh: Mesh | None) -> tuple[int, ...]:
    """FSDP1's flat shards run over the mesh's last (sharding) dimension; one replica group's make the whole."""
    if layout.kind == "flat":
        return (layout.shape[0] * (1 if mesh is None else mesh.shape[-1]),)
    return layout.shape


def model_mesh(model: dict[str, tuple[Layout, TensorRef]]) -> Mesh | None:
    meshes = {layout.mesh for layout, _ in model.values() if layout.mesh is not None}
    if len(meshes) > 1:
        return None  # several meshes: no single sharding dimension to place flat optimizer shards on
    return next(iter(meshes), None)


def mesh_json(mesh: Mesh | None) -> Any:
    return None if mesh is None else {"shape": list(mesh.shape), "ranks": list(mesh.ranks), "groups": mesh.groups}


def check_coordinate(leaf: DTensor, layout: Layout, f: File, path: str) -> None:
    """The mesh a rank pickles says where that rank sits in it (and, since torch 2.10, which rank saved it):
    a file renamed to another rank's name is refused here, naming both."""
    state = leaf._spec.__dict__["mesh"].__dict__
    saved, saver = state.get("_coordinate_on_dim"), state.get("_rank")
    if type(saver) is int and saver != f.rank:
        raise CheckpointError(f"{f.path}: {path}: named rank {f.rank}, but saved by rank {saver} "
                              f"(a renamed or copied file)")
    if saved is None or layout.mesh is None:
        return
    mine = layout.mesh.coordinate(f.rank)
    if mine is None or tuple(saved) != mine:
        raise CheckpointError(f"{f.path}: {path}: named rank {f.rank}, but its device mesh places it at "
                              f"coordinate {list(saved)!r:.40}, not {list(mine or ())} (a renamed or copied file)")


def array_leaf(f: File, path: str, leaf: Any, layout: Layout, local: TensorRef | None, mesh: Mesh | None) -> ArrayLeaf:
    """A tensor leaf of one rank's file as the store takes it: the box its placements give this rank,
    checked against the local tensor it holds (rank 0's copy of a plain tensor; none elsewhere)."""
    if isinstance(leaf, DTensor):
        check_coordinate(leaf, layout, f, path)
    mine = box_of(layout, f.rank, mesh)  # this rank's only: a worker never walks the whole world
    shape = global_shape(layout, mesh)
    if layout.kind == "whole" and f.rank != 0:
        return ArrayLeaf(layout.dtype, shape, [])  # rank 0's copy is the one written
    if mine is None:
        if local is not None and 0 not in local.shape:
            raise CheckpointError(f"{f.path}: {path}: holds {list(local.shape)} where its rank holds nothing")
        return ArrayLeaf(layout.dtype, shape, [])
    offsets, sizes = mine
    if local is None or tuple(local.shape) != sizes:
        raise CheckpointError(f"{f.path}: {path}: local tensor {list(local.shape) if local else None} is not the "
                              f"{list(sizes)} box "
                              f"its placements give rank {f.rank}; forged or damaged")
    tensors.check_view(f.zip, local, path)
    return ArrayLeaf(layout.dtype, shape, [LocalPiece(offsets, sizes, local, f.zip)])


def array_spec(layout: Layout, world: int, mesh: Mesh | None, base: int) -> ShardedSpec:
    """The planner's view of one array: every rank's box, held by unit `base + rank`."""
    return ShardedSpec(layout.dtype, global_shape(layout, mesh),
                       tuple(ShardSpec(o, s, base + r) for r, o, s in boxes(layout, world, mesh)))


def mesh_from_json(facts: Any) -> Mesh | None:
    return None if facts is None else Mesh(tuple(facts["shape"]), tuple(facts["ranks"]), facts.get("groups", 1))


# ---------------------------------------------------------------------------------------------- format
_TENSOR_CLASS = re.compile(rb"ShardedTensor|DTensor")


def holds_dtensors(path: str, storage_options: StorageOptions | None) -> bool:
    """Whether a rank file's pickle names DTensor: the per-rank DTensor files of a plain FSDP2 save. The
    first of the two tensor classes named decides, so a ShardedTensor file is told from its first tensor
    (at W=1024 its pickle is tens of MB) and nothing is copied."""
    try:
        with TorchZip(path, storage_options) as zf:
            first = _TENSOR_CLASS.search(zf.record("data.pkl"))
            return first is not None and first.group() == b"DTensor"
    except (CheckpointError, KeyError, OSError):
        return False  # not readable as one: the rank-file reader says why


def checked_leaves(f: File, digest: str, planned_from: str) -> dict[str, Any]:
    """A rank's file's leaves, each DTensor as the box this rank holds, once its keys and layouts are
    those of the file the store was planned from (`digest`, of `planned_from`)."""
    layouts = layouts_of(f)
    if digest_of(f, layouts) != digest:
        raise CheckpointError(f"{f.path}: its keys or tensor layouts differ from {planned_from} the store was "
                              f"planned from (a file of another checkpoint?)")
    mesh = model_mesh(layouts)
    return {p: array_leaf(f, p, leaf, *layouts[p], mesh) if p in layouts else leaf for p, leaf in f.leaves.items()}


class DTensorFiles:
    """Per-rank `torch.save` files of DTensors under any `*rank<N>.pt` names, one unit each, in rank
    order; the state dict's own keys are the top level."""

    name, title, ranked = FORMAT, "DTensor", True
    group_claims, keeps_empty_values = False, True  # every unit is its own group rank: replicas are deduplicated
    any_script, shares_folder = True, True  # Composer's ep0-ba10-rank0.pt beside ep0-ba20-rank0.pt

    def detect(self, folder: str, storage_options: StorageOptions | None) -> bool:
        return False  # found through rank-file discovery (RankFiles.find), which routes them here

    def source(self, folder: str, storage_options: StorageOptions | None) -> Any:
        raise NotImplementedError  # never detected as a folder

    def latest(self, folder: str, storage_options: StorageOptions | None) -> str | None:
        return None

    def of_files(self, files: list[str], storage_options: StorageOptions | None) -> Any:
        return None  # rank-file discovery routes them (RankFiles.of_files)

    def _file(self, path: str, world: int, storage_options: StorageOptions | None, strict: bool,
              encode_key: KeyEncoder) -> File:
        rank = name_rank(path)
        if rank is None or not 0 <= rank < world:
            raise CheckpointError(f"{path}: names no rank of the {world} the checkpoint has")
        return read_file(path, "", world, rank, storage_options, strict, encode_key)

    def plan(self, source: Any, encode_key: KeyEncoder, strict: bool) -> tuple[CheckpointSpec, None]:
        """Planned from the first file: its DTensors' meshes say the world size (the files given may be
        some of them: ingesting ranks as they arrive)."""
        f = self._file(source.units[0], MAX_MESH, source.storage_options, strict, encode_key)
        try:
            layouts = layouts_of(f)
            ranks = {r for layout, _ in layouts.values() if layout.mesh is not None for r in layout.mesh.ranks}
            world = len(ranks) if ranks else len(source.units)
            f.world = world
            if ranks and ranks != set(range(world)):
                raise CheckpointError(f"{f.path}: its device meshes hold ranks {sorted(ranks)[:8]}, not the "
                                      f"{world} of a world size of {world}")
            mesh = model_mesh(layouts)
            arrays = {p: array_spec(layout, world, mesh, 0) for p, (layout, _) in layouts.items()}
            objects = [p for p in f.leaves if p not in layouts]
            facts = CheckpointFacts(metadata=digest_of(f, layouts), replicas=replica_count(arrays),
                                    reader={"dtensor_files": {"world": world}})
            return CheckpointSpec(self.name, world, world, f.tree, arrays, {}, objects, facts), None
        finally:
            f.zip.close()

    def unit_share(self, path: str, storage_options: StorageOptions | None, facts: dict[str, Any]) -> None:
        """Each unit reads what it needs itself."""

    def open_unit(self, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
                  facts: dict[str, Any], share: Any = None) -> FileUnit:
        f = self._file(path, facts["dtensor_files"]["world"], storage_options, strict, encode_key)
        unit = FileUnit(path, f.rank, f.world, f.rank, f.world, facts["metadata"], {}, f.zip)
        with closed_on_error(unit.close, path):
            unit.leaves.update(checked_leaves(f, facts["metadata"], "rank 0's file"))
        return unit

    def arrivals(self, folder: str, tag: str | None, looks: Any) -> None:
        return None  # arriving rank files are RankFiles', which routes them here

    def unit_kind(self, name: str) -> str:
        return "rank files"


FILES = DTensorFiles()
