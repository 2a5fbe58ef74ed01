"""DTensors in per-rank `torch.save` files: their layout, read from the pickle alone.

A DTensor pickles its global shape and dtype, its placements (one per mesh dimension) and its device
mesh: the mesh's shape and the global rank at each coordinate. That is the whole layout, in every file:
rank 0's file plans the checkpoint, and each worker checks that its own file describes the same layout
(a digest of it) and that its local tensor is the box the layout gives its rank. A box follows
`torch.chunk`, dimension by dimension in mesh order (DTensor's `compute_local_shape_and_global_offset`);
a rank may hold an empty one. `Replicate()` dimensions hold copies: under HSDP each box is held once per
replica group, and the store writes it once. `Partial` (a pending reduction) and `_StridedShard` are
refused by name.

Nothing in these pickles is imported or called: DTensor, its spec, the mesh and the placements are inert
records (read/unpickle.py); a mesh's process groups are names only.

Two formats read them: veRL's checkpoints (read/verl.py), and here `DTensorFiles`: any folder of
`*rank<N>.pt` files holding a plain `torch.save(model.state_dict())` (or optimizer state) of FSDP2, as
users of `fully_shard` write them (rank-file discovery finds them; rank 0's pickle naming DTensor routes
them here rather than to ShardedTensor rank files).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, closed_on_error
from ..locations import StorageOptions
from . import tensors
from .container import TorchZip
from .contract import (SMALL_TENSOR_BYTES, ArrayLeaf, CheckpointSpec, LocalPiece, Node, ShardSpec, ShardedSpec,
                       replica_count, whole_numbers)
from .olmo import FileUnit
from .tree import flatten
from .unpickle import DeviceMesh, DTensor, Placement, TensorRef, load

FORMAT = "dtensor-files"
MAX_MESH = 1 << 20
STATE = "optim/state/"  # veRL's optimizer state, where plain 1-D tensors are FSDP1's flat-parameter shards


# ---------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Mesh:
    """A device mesh as data: its shape, and the global rank at each coordinate (C order)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        try:
            flat = self.ranks.index(rank)
        except ValueError:
            return None
        coord = []
        for size in reversed(self.shape):
            coord.append(flat % size)
            flat //= size
        return tuple(reversed(coord))


def mesh_of(record: Any, where: str) -> Mesh:
    """The mesh a DeviceMesh pickle describes. torch <= 2.9 keeps the ranks as `mesh` (a tensor whose shape
    is the mesh's) and their flat list; torch >= 2.10 keeps a flat `_rank_map` and a `_layout` (per mesh
    dimension, a size and a stride into it)."""
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
        shape = tuple(math.prod(s) for s, _ in dims)
        if math.prod(shape) > MAX_MESH:
            raise CheckpointError(f"{where}: a device mesh of {math.prod(shape)} ranks (corrupt file)")
        ranks = []
        for index in range(math.prod(shape)):
            offset, rest = 0, index
            for (sizes, strides), size in zip(reversed(dims), reversed(shape)):
                sub, rest = rest % size, rest // size
                for s, t in zip(reversed(sizes), reversed(strides)):
                    offset += (sub % s) * t
                    sub //= s
            if offset >= len(flat):
                raise CheckpointError(f"{where}: a device mesh layout reaching past its ranks (corrupt file)")
            ranks.append(flat[offset])
        out = Mesh(shape, tuple(ranks))
    else:
        mesh = state.get("mesh")
        if not isinstance(mesh, TensorRef):
            raise CheckpointError(f"{where}: a device mesh without its ranks (corrupt file)")
        shape = whole_numbers(mesh.shape, f"{where}: mesh sizes")
        out = Mesh(shape, whole_numbers(state.get("_flatten_mesh_list"), f"{where}: mesh ranks"))
    if len(out.ranks) != math.prod(out.shape) or len(set(out.ranks)) != len(out.ranks) or not out.shape:
        raise CheckpointError(f"{where}: a device mesh whose ranks do not fill it (corrupt file)")
    return out


def placements_of(spec: Any, ndim: int, mesh: Mesh, where: str) -> tuple[tuple[str, int], ...]:
    """("shard", tensor dim) or ("replicate", -1) per mesh dimension."""
    placements = getattr(spec, "__dict__", {}).get("placements")
    if not isinstance(placements, tuple) or len(placements) != len(mesh.shape):
        raise CheckpointError(f"{where}: a DTensor whose placements do not match its mesh (corrupt file)")
    out = []
    for p in placements:
        kind = p.kind if isinstance(p, Placement) else type(p).__name__
        if kind == "Replicate":
            out.append(("replicate", -1))
        elif kind == "Shard":
            dim = p.__dict__.get("dim")
            if type(dim) is not int or not -ndim <= dim < ndim:
                raise CheckpointError(f"{where}: a Shard placement on dimension {dim!r:.20} of a {ndim}-d tensor")
            out.append(("shard", dim % ndim))
        elif kind in ("Partial", "_Partial"):
            raise CheckpointError(f"{where}: a Partial DTensor (a reduction still pending when it was saved); "
                                  f"its ranks' values are summands, not shards, and are not read")
        elif kind == "_StridedShard":
            raise CheckpointError(f"{where}: a _StridedShard placement (FSDP2 over tensor parallelism) is not "
                                  f"read yet")
        else:
            raise CheckpointError(f"{where}: an unknown DTensor placement {kind!r:.40}")
    return tuple(out)


def local_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[tuple[str, int], ...],
              coord: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box a mesh coordinate holds: `torch.chunk` of each sharded dimension, in mesh order."""
    offsets, sizes = [0] * len(shape), list(shape)
    for (kind, dim), n, c in zip(placements, mesh_shape, coord):
        if kind != "shard":
            continue
        size = sizes[dim]
        chunk = -(-size // n) if size % n else size // n
        start = chunk * c
        if start >= size:
            sizes[dim], offsets[dim] = 0, offsets[dim] + size
        else:
            sizes[dim], offsets[dim] = min(size, start + chunk) - start, offsets[dim] + start
    return tuple(offsets), tuple(sizes)


@dataclass(frozen=True)
class Layout:
    """One tensor leaf of a file, as the plan needs it."""

    kind: str  # "dtensor", "flat" (an FSDP1 flat parameter's 1-D optimizer shard), "whole" (a plain tensor)
    dtype: str
    shape: tuple[int, ...]  # global shape (the shard's length for "flat")
    placements: tuple[tuple[str, int], ...] = ()
    mesh: Mesh | None = None

    def describe(self) -> tuple:
        return (self.kind, self.dtype, self.shape, self.placements,
                None if self.mesh is None else (self.mesh.shape, self.mesh.ranks))


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
    return Layout("dtensor", dtype, shape, placements_of(spec, len(shape), mesh, where), mesh), local



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
              encode_key: Any) -> File:
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
        elif isinstance(leaf, TensorRef):
            tensors.check_view(f.zip, leaf, path)
            nbytes = math.prod(leaf.shape) * dtypes.info(leaf.dtype).itemsize
            if f.kind == "optim" and leaf.shape and path.startswith(STATE):
                if len(leaf.shape) != 1:
                    raise CheckpointError(f"{where}: a plain {len(leaf.shape)}-d optimizer state tensor beside "
                                          f"sharded parameters; expected FSDP1's 1-D flat-parameter shards")
                out[path] = (Layout("flat", leaf.dtype, leaf.shape, (("shard", 0),), None), leaf)
            elif leaf.shape and (f.kind == "model" or nbytes > SMALL_TENSOR_BYTES):  # weights are arrays
                out[path] = (Layout("whole", leaf.dtype, leaf.shape), leaf)
    return out


def digest_of(f: File, layouts: dict[str, tuple[Layout, TensorRef]]) -> str:
    """What every rank's file of one kind has in common: its keys, and each array's whole layout."""
    described = (f.kind, f.world, f.tree.to_json(), sorted((p, l.describe()) for p, (l, _) in layouts.items()))
    return hashlib.blake2b(repr(described).encode(), digest_size=16).hexdigest()


def box_of(layout: Layout, rank: int, mesh: Mesh | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, sizes) of the box rank `rank` holds of one array, or None when it holds none of it."""
    if layout.kind == "whole":
        return ((0,) * len(layout.shape), layout.shape) if rank == 0 else None
    used = layout.mesh if layout.kind == "dtensor" else mesh
    coord = used.coordinate(rank) if used is not None else (0,) * (1 if layout.kind == "flat" else 0)
    if coord is None:
        return None  # a rank outside this tensor's mesh holds none of it
    if layout.kind == "flat":
        n = layout.shape[0]
        return (coord[-1] * n,), (n,)
    offsets, sizes = local_box(layout.shape, used.shape, layout.placements, coord)  # type: ignore[union-attr]
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
    return None if mesh is None else {"shape": list(mesh.shape), "ranks": list(mesh.ranks)}


def check_coordinate(leaf: DTensor, layout: Layout, f: File, path: str) -> None:
    """The mesh a rank pickles says where that rank sits in it: a file renamed to another rank's name is
    refused here, naming both."""
    saved = leaf._spec.__dict__["mesh"].__dict__.get("_coordinate_on_dim")
    if saved is None or layout.mesh is None:
        return
    mine = layout.mesh.coordinate(f.rank)
    if mine is None or tuple(saved) != mine:
        at = layout.mesh.ranks[sum(c * math.prod(layout.mesh.shape[i + 1:]) for i, c in enumerate(saved))] \
            if len(saved) == len(layout.mesh.shape) and all(0 <= c < n for c, n in zip(saved, layout.mesh.shape)) \
            else "?"
        raise CheckpointError(f"{f.path}: {path}: named rank {f.rank}, but its device mesh places it at rank {at} "
                              f"(a renamed or copied file)")


def array_leaf(f: File, path: str, leaf: Any, layout: Layout, local: TensorRef, mesh: Mesh | None) -> ArrayLeaf:
    """A tensor leaf of one rank's file as the store takes it: the box its placements give this rank,
    checked against the local tensor it holds (rank 0's copy of a plain tensor; none elsewhere)."""
    if isinstance(leaf, DTensor):
        check_coordinate(leaf, layout, f, path)
    mine = box_of(layout, f.rank, mesh)  # this rank's only: a worker never walks the whole world
    shape = global_shape(layout, mesh)
    if layout.kind == "whole" and f.rank != 0:
        return ArrayLeaf(layout.dtype, shape, [])  # rank 0's copy is the one written
    if mine is None:
        if math.prod(local.shape):
            raise CheckpointError(f"{f.path}: {path}: holds {list(local.shape)} where its rank holds nothing")
        return ArrayLeaf(layout.dtype, shape, [])
    offsets, sizes = mine
    if tuple(local.shape) != sizes:
        raise CheckpointError(f"{f.path}: {path}: local tensor {list(local.shape)} is not the {list(sizes)} box "
                              f"its placements give rank {f.rank}; forged or damaged")
    tensors.check_view(f.zip, local, path)
    return ArrayLeaf(layout.dtype, shape, [LocalPiece(offsets, sizes, local, f.zip)])


def array_spec(layout: Layout, world: int, mesh: Mesh | None, base: int) -> ShardedSpec:
    """The planner's view of one array: every rank's box, held by unit `base + rank`."""
    return ShardedSpec(layout.dtype, global_shape(layout, mesh),
                       tuple(ShardSpec(o, s, base + r) for r, o, s in boxes(layout, world, mesh)))


def mesh_from_json(facts: Any) -> Mesh | None:
    return None if facts is None else Mesh(tuple(facts["shape"]), tuple(facts["ranks"]))


# ---------------------------------------------------------------------------------------------- format
def holds_dtensors(path: str, storage_options: StorageOptions | None) -> bool:
    """Whether a rank file's pickle names DTensor: the per-rank DTensor files of a plain FSDP2 save."""
    try:
        with TorchZip(path, storage_options) as zf:
            return b"DTensor" in bytes(zf.record("data.pkl"))
    except (CheckpointError, KeyError, OSError):
        return False  # not readable as one: the rank-file reader says why


class DTensorFiles:
    """Per-rank `torch.save` files of DTensors under any `*rank<N>.pt` names, one unit each, in rank
    order; the state dict's own keys are the top level."""

    name, title, ranked = FORMAT, "DTensor", True
    group_claims, keeps_empty_values = False, True  # every unit is its own group rank: replicas are deduplicated

    def detect(self, folder: str, storage_options: StorageOptions | None) -> bool:
        return False  # found through rank-file discovery (RankFiles.find), which routes them here

    def source(self, folder: str, storage_options: StorageOptions | None) -> Any:
        raise NotImplementedError  # never detected as a folder

    def latest(self, folder: str, storage_options: StorageOptions | None) -> str | None:
        return None

    def of_files(self, files: list[str], storage_options: StorageOptions | None) -> Any:
        return None  # rank-file discovery routes them (RankFiles.of_files)

    def _file(self, path: str, world: int, storage_options: StorageOptions | None, strict: bool,
              encode_key: Any) -> File:
        from .layouts import name_rank

        rank = name_rank(path)
        if rank is None or not 0 <= rank < world:
            raise CheckpointError(f"{path}: names no rank of the {world} the checkpoint has")
        return read_file(path, "", world, rank, storage_options, strict, encode_key)

    def plan(self, source: Any, encode_key: Any, strict: bool) -> tuple[CheckpointSpec, None]:
        """Planned from the first file: its DTensors' mesh says the world size (the files given may be
        some of them: ingesting ranks as they arrive)."""
        f = self._file(source.units[0], MAX_MESH, source.storage_options, strict, encode_key)
        try:
            layouts = layouts_of(f)
            mesh = model_mesh(layouts)
            world = len(source.units) if mesh is None else len(mesh.ranks)
            f.world = world
            if mesh is not None and set(mesh.ranks) != set(range(world)):
                raise CheckpointError(f"{f.path}: its device mesh holds ranks {sorted(mesh.ranks)[:8]}, not the "
                                      f"{world} of a world size of {world}")
            arrays = {p: array_spec(layout, world, mesh, 0) for p, (layout, _) in layouts.items()}
            objects = [p for p in f.leaves if p not in layouts]
            extra = {"metadata": digest_of(f, layouts),
                     "dtensor_files": {"world": world}, "replicas": replica_count(arrays)}
            return CheckpointSpec(self.name, world, world, f.tree, arrays, {}, objects, extra), None
        finally:
            f.zip.close()

    def open_unit(self, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: Any,
                  facts: dict[str, Any]) -> FileUnit:
        f = self._file(path, facts["dtensor_files"]["world"], storage_options, strict, encode_key)
        unit = FileUnit(path, f.rank, f.world, f.rank, f.world, facts["metadata"], {}, f.zip)
        with closed_on_error(unit.close, path):
            layouts = layouts_of(f)
            if digest_of(f, layouts) != facts["metadata"]:
                raise CheckpointError(f"{path}: its keys or tensor layouts differ from rank 0's file the store was "
                                      f"planned from (a file of another checkpoint?)")
            mesh = model_mesh(layouts)
            for p, leaf in f.leaves.items():
                unit.leaves[p] = array_leaf(f, p, leaf, *layouts[p], mesh) if p in layouts else leaf
        return unit

    def unit_kind(self, name: str) -> str:
        return "rank files"


FILES = DTensorFiles()
