"""Per-rank DTensor files: veRL's FSDP checkpoints (`global_step_N/actor/`), one `torch.save` per rank.

Each rank saves `model_world_size_{W}_rank_{r}.pt` (the model's state dict: DTensors under FSDP2 and under
FSDP1 built with a device mesh, plain tensors at world size 1), `optim_world_size_{W}_rank_{r}.pt` (the
optimizer's state dict: DTensor moments under FSDP2; under FSDP1 with `use_orig_params=False`, veRL's
default, the 1-D shards of its flat parameters, keyed 0..N) and `extra_state_world_size_{W}_rank_{r}.pt`
(the LR scheduler and RNG states). The store's tree is `{"model": ..., "optim": ..., "extra_state": ...}`.

A DTensor pickles its global shape and dtype, its placements (one per mesh dimension) and its device
mesh: the mesh's shape and the global rank at each coordinate. That is the whole layout, in every file:
rank 0's files plan the checkpoint, and each worker checks that its own file describes the same layout
(a digest of it) and that its local tensor is the box the layout gives its rank. A box follows
`torch.chunk`, dimension by dimension in mesh order (DTensor's `compute_local_shape_and_global_offset`);
a rank may hold an empty one. `Replicate()` dimensions hold copies: under HSDP each box is held once per
replica group, and the store writes it once. `Partial` (a pending reduction) and `_StridedShard` are
refused by name. An FSDP1 flat parameter's optimizer state is assembled as the flat vector it is, the
shards of one replica group in their mesh order (padding included); it is not split per parameter.

Nothing in these pickles is imported or called: DTensor, its spec, the mesh and the placements are inert
records (read/unpickle.py); a mesh's process groups are names only.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, closed_on_error
from ..locations import StorageOptions
from . import tensors
from .container import TorchZip
from . import fsdp_flat
from .olmo import FileUnit, flat_spec, relative
from .contract import (SMALL_TENSOR_BYTES, ArrayLeaf, CheckpointSpec, LocalPiece, Node, ShardSpec, ShardedSpec,
                       replica_count, whole_numbers)
from .trainer import join, listing
from .tree import flatten
from .unpickle import DeviceMesh, DTensor, Placement, TensorRef, load

FORMAT = "dtensor"
ACTOR = "actor"
UNIT_FOLDERS = (ACTOR,)  # a path to it names the step folder's checkpoint
KINDS = ("model", "optim", "extra_state")
UNIT_FILE = re.compile(r"(?P<kind>model|optim|extra_state)_world_size_(?P<world>\d+)_rank_(?P<rank>\d+)\.pt\Z")
STATE = "optim/state/"
PARAM_GROUPS = "optim/param_groups"
HF_FOLDER = "huggingface"
SIDE_FILES = ("fsdp_config.json",)
MAX_MESH = 1 << 20


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


def _dtensor_layout(leaf: DTensor, where: str) -> tuple[Layout, TensorRef]:
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
def unit_name(kind: str, world: int, rank: int) -> str:
    return f"{kind}_world_size_{world}_rank_{rank}.pt"


def _parse(path: str) -> tuple[str, int, int]:
    m = UNIT_FILE.match(path.replace("\\", "/").rsplit("/", 1)[-1])
    if m is None:
        raise CheckpointError(f"{path}: not a veRL checkpoint file "
                              f"({{model,optim,extra_state}}_world_size_W_rank_R.pt)")
    return m["kind"], int(m["world"]), int(m["rank"])


def detect(folder: str, storage_options: StorageOptions | None = None) -> bool:
    """A step folder (global_step_N/) whose actor/ holds veRL's rank files."""
    return any(UNIT_FILE.match(p.rsplit("/", 1)[-1]) for p in listing(join(folder, ACTOR), storage_options))


def units(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Every rank's model files, then its optimizer files, then its extra-state files, each in rank order;
    every kind present for every rank of one world size, or refused naming what is missing."""
    actor = join(folder, ACTOR)
    found: dict[tuple[str, int], str] = {}
    worlds = set()
    for p in listing(actor, storage_options):
        m = UNIT_FILE.match(p.rsplit("/", 1)[-1])
        if m:
            found[(m["kind"], int(m["rank"]))] = p
            worlds.add(int(m["world"]))
    if len(worlds) != 1:
        raise CheckpointError(f"{actor}: holds rank files of world sizes {sorted(worlds)}; one checkpoint has one")
    (world,) = worlds
    kinds = [k for k in KINDS if any(kind == k for kind, _ in found)]
    if "model" not in kinds:
        raise CheckpointError(f"{actor}: holds no model_world_size_{world}_rank_*.pt files")
    out = []
    for kind in kinds:
        missing = [r for r in range(world) if (kind, r) not in found]
        if missing or any(r >= world for k, r in found if k == kind):
            raise CheckpointError(f"{join(actor, unit_name(kind, world, missing[0] if missing else world))}: "
                                  + ("missing (the checkpoint is incomplete)" if missing else "beyond the world size"))
        out += [found[(kind, r)] for r in range(world)]
    return out


def unit_kind(name: str) -> str:
    kind = UNIT_FILE.match(name.rsplit("/", 1)[-1])
    return {"model": "model files", "optim": "optimizer files", "extra_state": "extra-state files"}.get(
        kind["kind"] if kind else "", "files")


def side_files(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """What veRL's rank 0 saves beside the rank files: `fsdp_config.json`, and `huggingface/` (the model's
    config, generation config and tokenizer files), which `--format hf` uses without a flag."""
    actor = join(folder, ACTOR)
    here = [p for p in listing(actor, storage_options) if p.rsplit("/", 1)[-1] in SIDE_FILES]
    return here + [p for p in listing(join(actor, HF_FOLDER), storage_options)
                   if p.rsplit(".", 1)[-1] in ("json", "txt", "model", "jinja", "tiktoken")]


@dataclass
class _File:
    """One rank file read: its tree under its kind, and its leaves (DTensors, tensors, values)."""

    path: str
    kind: str
    world: int
    rank: int
    zip: TorchZip
    tree: Node
    leaves: dict[str, Any]


def _read(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: Any) -> _File:
    kind, world, rank = _parse(path)
    zf = TorchZip(path, storage_options)
    with closed_on_error(zf.close, path):
        zf.verify("data.pkl")
        obj = load(zf.record("data.pkl"), path, strict)
        try:  # an optimizer that has taken no step yet holds no tensor: one value under its kind
            tree, leaves = flatten({kind: obj}, encode_key)
        except RecursionError:
            raise CheckpointError(f"{path}: values nested too deeply, or containing themselves") from None
        return _File(path, kind, world, rank, zf, tree, leaves)


def _layouts(f: _File) -> dict[str, tuple[Layout, TensorRef]]:
    """Every tensor leaf of a file that the plan makes an array of, with its local tensor."""
    out = {}
    for path, leaf in f.leaves.items():
        where = f"{f.path}: {path}"
        if isinstance(leaf, DTensor):
            out[path] = _dtensor_layout(leaf, where)
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


def _digest(f: _File, layouts: dict[str, tuple[Layout, TensorRef]]) -> str:
    """What every rank's file of one kind has in common: its keys, and each array's whole layout."""
    described = (f.kind, f.world, f.tree.to_json(), sorted((p, l.describe()) for p, (l, _) in layouts.items()))
    return hashlib.blake2b(repr(described).encode(), digest_size=16).hexdigest()


def _boxes(layout: Layout, world: int, mesh: Mesh | None) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(rank, offsets, sizes) of every rank's non-empty box of one array."""
    out = []
    for rank in range(world):
        if layout.kind == "whole":
            if rank == 0:
                out.append((0, (0,) * len(layout.shape), layout.shape))
            continue
        used = layout.mesh if layout.kind == "dtensor" else mesh
        coord = used.coordinate(rank) if used is not None else (0,) * (1 if layout.kind == "flat" else 0)
        if coord is None:
            continue  # a rank outside this tensor's mesh holds none of it
        if layout.kind == "flat":
            n = layout.shape[0]
            out.append((rank, (coord[-1] * n,), (n,)))
            continue
        offsets, sizes = local_box(layout.shape, used.shape, layout.placements, coord)  # type: ignore[union-attr]
        if all(sizes):
            out.append((rank, offsets, sizes))
    return out


def _global_shape(layout: Layout, mesh: Mesh | None) -> tuple[int, ...]:
    """FSDP1's flat shards run over the mesh's last (sharding) dimension; one replica group's make the whole."""
    if layout.kind == "flat":
        return (layout.shape[0] * (1 if mesh is None else mesh.shape[-1]),)
    return layout.shape


def _model_mesh(model: dict[str, tuple[Layout, TensorRef]]) -> Mesh | None:
    meshes = {layout.mesh for layout, _ in model.values() if layout.mesh is not None}
    if len(meshes) > 1:
        return None  # several meshes: no single sharding dimension to place flat optimizer shards on
    return next(iter(meshes), None)


# ---------------------------------------------------------------------------------------------- spec
def _flat_index(path: str) -> str | None:
    """The optimizer's key of the state entry a path lies in ("3" for optim/state/3/exp_avg)."""
    return path[len(STATE):].split("/", 1)[0] if path.startswith(STATE) else None


def _member_paths(path: str, held: list[fsdp_flat.Member]) -> list[tuple[fsdp_flat.Member, str]]:
    """optim/state/{k}/{key} -> optim/state/{parameter}/{key} for each parameter flat parameter k holds."""
    tail = path[len(STATE):].split("/", 1)[1]
    return [(m, f"{STATE}{m.name}/{tail}") for m in held]


def _split(model: _File, model_layouts: dict[str, tuple[Layout, TensorRef]], optim: _File,
           optim_layouts: dict[str, tuple[Layout, TensorRef]],
           mesh: Mesh | None) -> dict[str, list[fsdp_flat.Member]] | None:
    """FSDP1's flat-parameter optimizer state, split per parameter where the model's parameters and
    FSDP's flattening rule account for every flat parameter's length exactly (fsdp_flat.py)."""
    lengths: dict[str, int] = {}
    for path, (layout, _) in optim_layouts.items():
        if layout.kind == "flat":
            k = _flat_index(path)
            if lengths.setdefault(k, layout.shape[0]) != layout.shape[0]:  # type: ignore[arg-type]
                return None
    if not lengths:
        return None
    params, seen = [], set()
    model_keys = {node.path[len("model/"):]: key for key, node in _walk_nodes(model.tree)
                  if node.path.startswith("model/")}
    for path, (layout, _) in model_layouts.items():
        leaf = model.leaves[path]
        if id(leaf) in seen:  # a tied weight: one parameter under two keys
            continue
        seen.add(id(leaf))
        if layout.kind == "dtensor" or model.world == 1:
            params.append((path[len("model/"):], layout.shape))
    found = fsdp_flat.split(params, list(lengths.values()), 1 if mesh is None else mesh.shape[-1], model_keys)
    return None if found is None else dict(zip(lengths, found))  # type: ignore[arg-type]


def _retree(tree: Node, split: dict[str, list[fsdp_flat.Member]]) -> None:
    """The optimizer's state keyed by parameter name instead of flat-parameter index, in the model's
    parameter order (as torch's full optimizer state dicts are)."""
    nodes = _walk_nodes(tree)
    state = next(node for _, node in nodes if node.path == STATE.rstrip("/"))
    order = {node.path[len("model/"):]: i for i, (_, node) in enumerate(nodes) if node.path.startswith("model/")}
    children = []
    for key, node in state.children:
        if node.path[len(STATE):] not in split:  # kept as it is, after the split ones
            children.append((len(nodes), key, node))
            continue
        for m in split[node.path[len(STATE):]]:
            leaves = [(leaf_key, Node("leaf", f"{STATE}{m.name}/{leaf.path.rsplit('/', 1)[1]}"))
                      for leaf_key, leaf in node.children]
            children.append((order[m.name], m.key, Node("dict", f"{STATE}{m.name}", leaves)))
    state.children = [(key, node) for _, key, node in sorted(children, key=lambda c: c[0])]


def _walk_nodes(node: Node) -> list[tuple[Any, Node]]:
    out = []
    for key, child in node.children:
        out.append((key, child))
        out += _walk_nodes(child)
    return out


def spec(folder: str, unit_paths: list[str], encode_key: Any, strict: bool,
         storage_options: StorageOptions | None) -> CheckpointSpec:
    """Planned from rank 0's file of each kind: a DTensor's pickle describes every rank's box."""
    names = [relative(u) for u in unit_paths]
    first = {}
    for i, u in enumerate(unit_paths):
        kind, world, rank = _parse(u)
        if rank == 0:
            first[kind] = i
    files = [_read(unit_paths[i], storage_options, strict, encode_key) for i in first.values()]
    try:
        tree = Node("dict", "", [child for f in files for child in f.tree.children])
        model = _layouts(files[0])
        mesh = _model_mesh(model)
        arrays: dict[str, ShardedSpec] = {}
        objects: list[str] = []
        digests = {}
        optim = next((f for f in files if f.kind == "optim"), None)
        split = _split(files[0], model, optim, _layouts(optim), mesh) if optim is not None else None
        for f in files:
            layouts = model if f.kind == "model" else _layouts(f)
            if any(l.kind == "flat" for l, _ in layouts.values()) and mesh is None and f.world > 1:
                raise CheckpointError(f"{f.path}: FSDP1 flat-parameter optimizer shards, but the model files do not "
                                      f"say which mesh dimension they are sharded over")
            digests[f.kind] = _digest(f, layouts)
            base = first[f.kind] - f.rank  # unit index of this kind's rank 0
            for path in f.leaves:
                held = split.get(_flat_index(path)) if split and f.kind == "optim" else None
                if held is not None:  # a flat parameter's state: one leaf per parameter it holds
                    for member, place in _member_paths(path, held):
                        if path not in layouts:
                            objects.append(place)
                            continue
                        layout, _ = layouts[path]
                        ranges = [(base + r, lo, n) for r, (o,), (size,) in _boxes(layout, f.world, mesh)
                                  for _, lo, n in fsdp_flat.overlaps([member], o, size)]
                        arrays[place] = flat_spec(layout.dtype, member.shape, ranges)
                    continue
                if path not in layouts:
                    objects.append(path)
                    continue
                layout, _ = layouts[path]
                shards = tuple(ShardSpec(o, s, base + r) for r, o, s in _boxes(layout, f.world, mesh))
                arrays[path] = ShardedSpec(layout.dtype, _global_shape(layout, mesh), shards)
        if split:
            _retree(tree, split)
        _check_tiling({p: a for p, a in arrays.items() if not a.flat}, files[0].path)
    finally:
        for f in files:
            f.zip.close()
    digest = hashlib.blake2b(repr(sorted(digests.items())).encode(), digest_size=16).hexdigest()
    facts = {"layouts": digests, "mesh": _mesh_json(mesh),
             "split": {k: [[m.name, list(m.shape), m.start, m.key] for m in held] for k, held in (split or {}).items()}}
    extra = {"units": names, "metadata": digest, "dtensor": facts, "replicas": replica_count(arrays)}
    return CheckpointSpec(FORMAT, len(names), len(names), tree, arrays, {}, objects, extra)


def _mesh_json(mesh: Mesh | None) -> Any:
    return None if mesh is None else {"shape": list(mesh.shape), "ranks": list(mesh.ranks)}


def _check_tiling(arrays: dict[str, ShardedSpec], where: str) -> None:
    """One replica group's boxes must cover each array exactly (torch.chunk boxes tile by construction;
    a forged mesh or placement that leaves a hole is refused here, before anything is written)."""
    for path, a in arrays.items():
        distinct = {(s.offsets, s.sizes) for s in a.shards}
        if sum(math.prod(s) for _, s in distinct) != math.prod(a.shape):
            raise CheckpointError(f"{where}: {path}: the ranks' boxes do not cover the tensor exactly once "
                                  f"(forged or damaged placements)")


# ---------------------------------------------------------------------------------------------- units
def _check_coordinate(leaf: DTensor, layout: Layout, f: _File, path: str) -> None:
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


def open_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: Any,
              facts: dict[str, Any]) -> FileUnit:
    """One rank's file, checked against the plan: the same keys and layouts as rank 0's file of its kind
    (a digest of them), and a local tensor that is exactly the box its rank holds."""
    listed = facts.get("units", [])
    if relative(path) not in listed or "dtensor" not in facts:
        raise CheckpointError(f"{path}: not a file of the veRL checkpoint the store holds")
    index, count = listed.index(relative(path)), len(listed)
    f = _read(path, storage_options, strict, encode_key)
    unit = FileUnit(path, index, count, index, count, facts["metadata"], {}, f.zip)
    with closed_on_error(unit.close, path):
        mesh_json = facts["dtensor"]["mesh"]
        mesh = None if mesh_json is None else Mesh(tuple(mesh_json["shape"]), tuple(mesh_json["ranks"]))
        layouts = _layouts(f)
        if _digest(f, layouts) != facts["dtensor"]["layouts"].get(f.kind):
            raise CheckpointError(f"{path}: its keys or tensor layouts differ from rank 0's {f.kind} file the store "
                                  f"was planned from (a file of another checkpoint?)")
        split = {k: [fsdp_flat.Member(n, tuple(shape), start, key) for n, shape, start, key in held]
                 for k, held in facts["dtensor"].get("split", {}).items()} if f.kind == "optim" else {}
        for p, leaf in f.leaves.items():
            held = split.get(_flat_index(p))  # type: ignore[arg-type]
            if held is not None:
                _split_leaf(unit, f, p, leaf, layouts.get(p), held, mesh)
                continue
            if split and p == PARAM_GROUPS:
                unit.leaves[p] = _named_groups(leaf, split, path)
                continue
            if p not in layouts:
                unit.leaves[p] = leaf
                continue
            layout, local = layouts[p]
            if isinstance(leaf, DTensor):
                _check_coordinate(leaf, layout, f, p)
            mine = [(o, s) for r, o, s in _boxes(layout, f.world, mesh) if r == f.rank]
            shape = _global_shape(layout, mesh)
            if layout.kind == "whole" and f.rank != 0:
                unit.leaves[p] = ArrayLeaf(layout.dtype, shape, [])  # rank 0's copy is the one written
                continue
            if not mine:
                if math.prod(local.shape):
                    raise CheckpointError(f"{path}: {p}: holds {list(local.shape)} where its rank holds nothing")
                unit.leaves[p] = ArrayLeaf(layout.dtype, shape, [])
                continue
            (offsets, sizes), = mine
            if tuple(local.shape) != sizes:
                raise CheckpointError(f"{path}: {p}: local tensor {list(local.shape)} is not the {list(sizes)} box "
                                      f"its placements give rank {f.rank}; forged or damaged")
            tensors.check_view(f.zip, local, p)
            unit.leaves[p] = ArrayLeaf(layout.dtype, shape, [LocalPiece(offsets, sizes, local, f.zip)])
    return unit


def _named_groups(groups: Any, split: dict[str, list[fsdp_flat.Member]], where: str) -> Any:
    """The param groups with each flat parameter's index replaced by the names of the parameters it
    holds, as torch's full optimizer state dicts list them."""
    try:
        return [{**g, "params": [m.key for k in g["params"] for m in split[str(k)]]} for g in groups]
    except (TypeError, KeyError, AttributeError):
        raise CheckpointError(f"{where}: param_groups that do not list the flat parameters the state holds") from None


def _split_leaf(unit: FileUnit, f: _File, path: str, leaf: Any, planned: tuple[Layout, TensorRef] | None,
                held: list[fsdp_flat.Member], mesh: Mesh | None) -> None:
    """A flat parameter's state entry as the entries of the parameters it holds: a value (`step`) for
    each, or this rank's slice of the flat vector cut at the parameters' edges."""
    if planned is None:
        for _, place in _member_paths(path, held):
            unit.leaves[place] = leaf
        return
    layout, local = planned
    ((_, (first,), (count,)),) = [b for b in _boxes(layout, f.world, mesh) if b[0] == f.rank]
    pieces = {m.name: (lo, n) for m, lo, n in fsdp_flat.overlaps(held, first, count)}
    for m, place in _member_paths(path, held):
        if m.name not in pieces:
            unit.leaves[place] = ArrayLeaf(layout.dtype, m.shape, [])
            continue
        lo, n = pieces[m.name]
        view = TensorRef(local.storage, local.offset + m.start + lo - first, (n,), (1,), local.dtype)
        tensors.check_view(f.zip, view, place)
        unit.leaves[place] = ArrayLeaf(layout.dtype, m.shape, [LocalPiece((lo,), (n,), view, f.zip)])
