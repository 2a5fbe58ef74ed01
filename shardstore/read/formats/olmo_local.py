"""OLMo's `local` sharded checkpoints (LocalShardedCheckpointer): FSDP1's raw flat parameters, per rank.

    model/rank{r}.pt   {"modules": [{"name", "handles": [{"flat_param.data", "flat_param._fqns", ...}]}]}
    optim/rank{r}.pt   the plain optim.state_dict(): state by parameter id, 1-D pieces of original parameters
    train/rank{r}.pt   trainer state
    metadata.yaml      world_size; config.yaml beside it

A handle's flat parameter is its original parameters flattened and concatenated (with alignment padding
from torch 2.1), padded to divide evenly, and split into equal contiguous slices, one per rank of the
sharding group. Each original parameter's piece on a rank is therefore one element range of it: the
store receives exactly those ranges (`ShardedSpec.flat`), so no flat parameter is ever assembled.

Only rank 0's model file is read to plan: the layout of every other rank follows from its handles (their
parameters' sizes, the padding FSDP inserted, the group size), and each rank's file is checked against
that derivation when it is ingested: a file's own shard metadata must say exactly what the plan says.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ...facts import CheckpointFacts
from ... import dtypes
from ...errors import CheckpointError, closed_on_error
from ...locations import StorageOptions, join, listing
from ...records import TensorRef
from ...tree import KeyEncoder, Node
from ..contract import ArrayLeaf, CheckpointSpec, LocalPiece, whole_numbers
from ..primitives.container import TorchZip, read_small
from ..primitives.tensors import check_view
from ..primitives.unpickle import load
from ..unit import FileUnit, Place, flat_spec, relative
from .olmo import MODEL, OPTIM, PARAM_GROUPS, clean, model_path, model_tree, open_olmo_unit, optim_tree, state_path
from .rankfile import MAX_WORLD_SIZE
from .trainer import join_trainer_state, trainer_files

FORMAT = "olmo-local"
_RANK = re.compile(r"^rank(0|[1-9][0-9]*)\.pt$")


@dataclass(frozen=True)
class Param:
    fqn: str  # as OLMo's unsharder names it: module prefix and relative name, wrapper names removed
    shape: tuple[int, ...]
    start: int  # its first element in the handle's unsharded flat parameter
    numel: int


@dataclass(frozen=True)
class Handle:
    """One flat parameter, as every rank shares it."""

    dtype: str
    total: int  # unsharded flat numel, padding included
    params: tuple[Param, ...]
    old: bool  # torch <= 2.0.1 metadata (_shard_indices, _shard_param_offsets)

    def shard(self, group_rank: int, group_size: int) -> tuple[int, int, int]:
        """(first element, stop, padded length) of the slice `group_rank` holds (torch.chunk semantics)."""
        size = -(-self.total // group_size)
        first = min(group_rank * size, self.total)
        return first, min(first + size, self.total), size

    def pieces(self, group_rank: int, group_size: int) -> list[tuple[int, int, int, int]]:
        """(param index, first element within the param, count, offset in the rank's slice) of every
        parameter the rank holds some of."""
        first, stop, _ = self.shard(group_rank, group_size)
        out = []
        for i, p in enumerate(self.params):
            lo, hi = max(p.start, first), min(p.start + p.numel, stop)
            if lo < hi:
                out.append((i, lo - p.start, hi - lo, lo - first))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "total": self.total, "old": self.old,
                "params": [[p.fqn, list(p.shape), p.start, p.numel] for p in self.params]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Handle":
        return cls(d["dtype"], d["total"], tuple(Param(f, tuple(s), st, n) for f, s, st, n in d["params"]), d["old"])


def detect(folder: str, storage_options: StorageOptions | None = None) -> bool:
    """A `local` checkpoint: model/rank{r}.pt files (and no model/metadata.json, which is OLMo-core's)."""
    names = [n.rsplit("/", 1)[-1] for n in listing(join(folder, MODEL), storage_options)]
    return "metadata.json" not in names and any(_RANK.match(n) for n in names)


def _ranked(folder: str, storage_options: StorageOptions | None) -> dict[int, str]:
    found = {}
    for path in listing(folder, storage_options):
        m = _RANK.match(path.rsplit("/", 1)[-1])
        if m:
            found[int(m.group(1))] = path
    return found


def _world_size(folder: str, model_files: dict[int, str], storage_options: StorageOptions | None) -> int:
    """metadata.yaml's world_size (OLMo writes `world_size: N`), else the number of model files."""
    path = join(folder, "metadata.yaml")
    if path not in listing(folder, storage_options):
        return len(model_files)
    text = read_small(path, storage_options, 1 << 16, "OLMo's metadata.yaml").decode("utf-8", "replace")
    m = re.search(r"^world_size:\s*([0-9]+)\s*$", text, re.M)
    if not m or not 0 < int(m.group(1)) <= MAX_WORLD_SIZE:
        raise CheckpointError(f"{path}: no world_size a checkpoint can have")
    return int(m.group(1))


def units(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Every unit of work: model files, optimizer files, trainer-state files, each in rank order."""
    out = []
    for kind in (MODEL, OPTIM):
        ranked = _ranked(join(folder, kind), storage_options)
        out += [ranked[r] for r in sorted(ranked)]
    return out + trainer_files(folder, storage_options)


# ---------------------------------------------------------------------------------------------- model files
def _model_handles(obj: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """(module prefix, handle dict) of every flat parameter in a model file, in order."""
    modules = obj.get("modules") if isinstance(obj, dict) else None
    if not isinstance(modules, list):
        raise CheckpointError(f"{where}: not an OLMo `local` model file (no \"modules\" list)")
    out = []
    for module in modules:
        if not isinstance(module, dict) or not isinstance(module.get("name"), str) \
                or not isinstance(module.get("handles"), list):
            raise CheckpointError(f"{where}: a module entry without a name and handles")
        for handle in module["handles"]:
            if not isinstance(handle, dict) or not isinstance(handle.get("flat_param.data"), TensorRef):
                raise CheckpointError(f"{where}: module {module['name']!r:.60}: a handle without flat_param.data")
            out.append((clean(module["name"]), handle))
    return out


def _field(handle: dict[str, Any], name: str, where: str) -> Any:
    try:
        return handle[f"flat_param.{name}"]
    except KeyError:
        raise CheckpointError(f"{where}: its flat parameter metadata has no {name}") from None


def _handles(prefix: str, h: dict[str, Any], where: str) -> list[Handle]:
    """Every layout one rank's copy of a handle's metadata can describe: where each parameter starts
    depends on the alignment FSDP used, which the file does not record (`_layouts`)."""
    data: TensorRef = h["flat_param.data"]
    dtypes.info(data.dtype)
    fqns = _field(h, "_fqns", where)
    shapes = _field(h, "_shapes", where)
    if not isinstance(fqns, (list, tuple)) or not all(isinstance(f, str) for f in fqns) \
            or not isinstance(shapes, (list, tuple)) or len(shapes) != len(fqns):
        raise CheckpointError(f"{where}: malformed _fqns / _shapes")
    shapes = [tuple(whole_numbers(s, f"{where}: shape of {f}")) for f, s in zip(fqns, shapes)]
    numels = list(whole_numbers(_field(h, "_numels", where), f"{where}: _numels"))
    if numels != [math.prod(s) for s in shapes]:
        raise CheckpointError(f"{where}: _numels disagree with _shapes")
    old = "flat_param._shard_param_infos" not in h
    # torch 2.0.x's FlatParameter had no padding list; 2.1+ saves one even when it equals _numels
    padded = list(whole_numbers(h.get("flat_param._numels_with_padding", numels), f"{where}: _numels_with_padding"))
    layouts = _layouts(numels, padded)
    if not layouts:
        raise CheckpointError(f"{where}: _numels_with_padding is not FSDP's padding of _numels")
    names = [clean(f"{prefix}.{f}" if prefix else f) for f in fqns]
    return [Handle(data.dtype, sum(padded), tuple(Param(f, s, st, n) for f, s, st, n in zip(names, shapes, starts, numels)),
                   old) for starts in layouts]


# FSDP1 (torch >= 2.1, use_orig_params) starts each original parameter on a multiple of 16 bytes of the
# dtype it computes in: 16 // itemsize elements, so 8 for bf16/fp16 mixed precision over fp32 storage,
# 4 for fp32, 16 for an 8-bit dtype, 2 for fp64; 1 is no alignment (torch 2.0, use_orig_params=False).
ALIGNMENTS = (1, 2, 4, 8, 16)


def _layouts(numels: list[int], padded: list[int]) -> list[list[int]]:
    """The start of every parameter in the flat parameter, for each alignment that reproduces
    `_numels_with_padding` exactly by FSDP's rule (flat_param.py, `_init_flat_param_and_metadata`): a
    padding entry before each parameter whose start is not aligned, and, when aligning, one final entry
    that makes the total divide by the group size. Usually one layout fits; a tie is resolved by the
    ranks' own `_shard_param_infos` (`read_layout`)."""
    out: list[list[int]] = []
    for align in ALIGNMENTS:
        starts, expected, pos = [], [], 0
        for n in numels:
            if pos % align:
                expected.append(align - pos % align)
                pos += expected[-1]
            starts.append(pos)
            expected.append(n)
            pos += n
        tail = padded[len(expected):]
        if padded[:len(expected)] == expected and (not tail or (align > 1 and len(tail) == 1 and tail[0] > 0)) \
                and starts not in out:
            out.append(starts)
    return out


def _group_size(handles: list[Handle], local_numels: list[int], world: int, where: str) -> int:
    """The sharding group's size: the divisor of the world size (the largest, FULL_SHARD, first) that
    gives every handle the slice length rank 0 holds."""
    for g in sorted((d for d in range(1, world + 1) if world % d == 0), reverse=True):
        if all(h.shard(0, g)[2] == n for h, n in zip(handles, local_numels)):
            return g
    raise CheckpointError(f"{where}: its flat parameter slices fit no sharding of {world} ranks")


def check_model_file(handles: list[Handle], found: list[tuple[str, dict[str, Any]]], group_rank: int,
                     group_size: int, where: str) -> None:
    """A rank's model file must describe the handles of the plan and hold exactly its slice of each."""
    if len(found) != len(handles):
        raise CheckpointError(f"{where}: {len(found)} flat parameters, the checkpoint has {len(handles)}")
    for n, (h, (prefix, raw)) in enumerate(zip(handles, found)):
        here = f"{where}: flat parameter {n}"
        if h not in _handles(prefix, raw, here):
            raise CheckpointError(f"{here}: its parameters differ from rank 0's (a file of another checkpoint?)")
        why = _slice_error(h, raw, group_rank, group_size, here)
        if why:
            raise CheckpointError(f"{here}: {why}")


def _slice_error(h: Handle, raw: dict[str, Any], group_rank: int, group_size: int, here: str) -> str | None:
    """Why a rank's copy of a handle is not exactly that rank's slice of `h`, or None when it is."""
    data: TensorRef = raw["flat_param.data"]
    first, stop, size = h.shard(group_rank, group_size)
    if tuple(data.shape) != (size,):
        return f"holds {list(data.shape)} elements, its slice has {size}"
    if _field(raw, "_shard_numel_padded", here) != size - (stop - first):
        return "_shard_numel_padded disagrees with its slice"
    pieces = h.pieces(group_rank, group_size)
    if h.old:
        offsets = [tuple(o) for o in _field(raw, "_shard_param_offsets", here)]
        if offsets != [(lo, lo + n - 1) for _, lo, n, _ in pieces]:
            return "_shard_param_offsets disagree with its slice of the parameters"
        indices = _field(raw, "_shard_indices", here)
        if pieces and tuple(indices) != (pieces[0][0], pieces[-1][0]):
            return "_shard_indices disagree with its slice of the parameters"
        return None
    infos = _field(raw, "_shard_param_infos", here)
    held = {i: (True, off, n, lo, lo + n - 1) for i, lo, n, off in pieces}
    expected = [held.get(i, (False, None, None, None, None)) for i in range(len(h.params))]
    if not isinstance(infos, (list, tuple)) or [tuple(x) for x in infos] != expected:
        return "_shard_param_infos disagree with its slice of the parameters"
    return None


# ---------------------------------------------------------------------------------------------- the spec
def _read_handles(path: str, storage_options: StorageOptions | None, strict: bool) -> list[tuple[str, dict[str, Any]]]:
    with TorchZip(path, storage_options) as zf:
        zf.verify("data.pkl")
        return _model_handles(load(zf.record("data.pkl"), path, strict), path)


def _narrow(candidates: list[list[Handle]], found: list[tuple[str, dict[str, Any]]], group_rank: int,
            group: int, where: str) -> list[list[Handle]]:
    """Keep the layouts a rank's own `_shard_param_infos` confirm (all, if none does: the check that
    follows then names what is wrong)."""
    return [[h for h in hs if _slice_error(h, raw, group_rank, group, where) is None] or hs
            for hs, (_, raw) in zip(candidates, found)] if len(candidates) == len(found) else candidates


def read_layout(folder: str, storage_options: StorageOptions | None, strict: bool) -> dict[str, Any]:
    """The checkpoint's facts, from metadata.yaml and rank 0's model file: handles, world and group size.

    Where rank 0's slice cannot tell two alignments apart (both reproduce `_numels_with_padding` and
    agree on what rank 0 holds), the next ranks' model files decide, each by its own metadata."""
    models = _ranked(join(folder, MODEL), storage_options)
    if 0 not in models:
        raise CheckpointError(f"{join(folder, MODEL)}: no rank0.pt")
    world = _world_size(folder, models, storage_options)
    stray = [r for r in models if r >= world]
    if stray:
        raise CheckpointError(f"{models[stray[0]]}: rank {stray[0]}, but metadata.yaml says the world has {world}")
    found = _read_handles(models[0], storage_options, strict)
    candidates = [_handles(prefix, raw, f"{models[0]}: flat parameter {n}") for n, (prefix, raw) in enumerate(found)]
    group = _group_size([hs[0] for hs in candidates], [raw["flat_param.data"].shape[0] if raw["flat_param.data"].shape
                                                       else -1 for _, raw in found], world, models[0])
    candidates = _narrow(candidates, found, 0, group, models[0])
    for r in range(1, group):
        if all(len(hs) == 1 for hs in candidates):
            break
        if r in models:
            candidates = _narrow(candidates, _read_handles(models[r], storage_options, strict), r, group, models[r])
    handles = [hs[0] for hs in candidates]
    check_model_file(handles, found, 0, group, models[0])
    names = [p.fqn for h in handles for p in h.params]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{models[0]}: two parameters named {next(n for n in names if names.count(n) > 1)!r:.80}")
    return {"handles": [h.to_json() for h in handles], "world": world, "group": group}


def _holders(handles: list[Handle], group: int) -> dict[str, list[tuple[int, int, int]]]:
    """fqn -> (group rank, first element, count) of every piece of it, in rank order."""
    out: dict[str, list[tuple[int, int, int]]] = {p.fqn: [] for h in handles for p in h.params}
    for h in handles:
        for r in range(group):
            for i, lo, n, _ in h.pieces(r, group):
                out[h.params[i].fqn].append((r, lo, n))
    return out


def _groups(state: Any, where: str) -> tuple[dict[Any, str], list[Any]]:
    """(param id -> clean fqn, the param groups with clean names) of an optimizer file."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not isinstance(state.get("state"), dict):
        raise CheckpointError(f"{where}: not an optimizer state dict (state and param_groups)")
    ids: dict[Any, str] = {}
    cleaned = []
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) \
                or not isinstance(g.get("param_names"), list) or len(g["params"]) != len(g["param_names"]):
            raise CheckpointError(f"{where}: a param group without matching params and param_names (OLMo adds "
                                  f"the names; without them the state cannot be matched to parameters)")
        ids.update(zip(g["params"], (clean(n) if isinstance(n, str) else n for n in g["param_names"])))
        cleaned.append({**g, "param_names": [clean(n) if isinstance(n, str) else n for n in g["param_names"]]})
    return ids, cleaned


def spec(folder: str, unit_paths: list[str], encode_key: KeyEncoder, strict: bool,
         storage_options: StorageOptions | None) -> CheckpointSpec:
    facts = read_layout(folder, storage_options, strict)
    handles = [Handle.from_json(h) for h in facts["handles"]]
    world, group = facts["world"], facts["group"]
    holders = _holders(handles, group)
    shapes = {p.fqn: (h.dtype, p.shape) for h in handles for p in h.params}
    arrays = {model_path(fqn): flat_spec(dtype, shape, holders[fqn]) for fqn, (dtype, shape) in shapes.items()}
    tree, objects = Node("dict", "", [(encode_key(MODEL), model_tree(list(shapes), encode_key))]), []
    optims = _ranked(join(folder, OPTIM), storage_options)
    if optims:
        state, keys = _optim_spec(folder, optims, holders, shapes, strict, storage_options)
        tree.children.append((encode_key(OPTIM), optim_tree(state, encode_key)))
        objects.append(PARAM_GROUPS)
        for path, (kind, dtype, fqn) in keys.items():
            if kind == "array" and dtype is not None:
                arrays[path] = flat_spec(dtype, shapes[fqn][1], holders[fqn])
            else:
                objects.append(path)
    train = trainer_files(folder, storage_options)
    if train:
        join_trainer_state(tree, objects, train[0], encode_key, storage_options, strict)
    names = [relative(u) for u in unit_paths]
    layout = json.dumps(facts, sort_keys=True)
    kept = CheckpointFacts(units=tuple(names), metadata=hashlib.blake2b(layout.encode(), digest_size=16).hexdigest(),
                           replicas=world // group, reader={"olmo_local": facts})
    return CheckpointSpec(FORMAT, len(names), len(names), tree, arrays, {}, objects, kept)


def _optim_spec(folder: str, optims: dict[int, str], holders: dict[str, list[tuple[int, int, int]]],
                shapes: dict[str, tuple[str, tuple[int, ...]]], strict: bool, storage_options: StorageOptions | None
                ) -> tuple[list[tuple[Any, list[Any]]], dict[str, tuple[str, str | None, str]]]:
    """(param id, its state keys) in order, and every state leaf's kind ("array" with its dtype, or
    "value") and parameter. Which keys a parameter has, and their dtypes, are read from the first rank
    holding a piece of it (the ranks that hold none have no state for it)."""
    if 0 not in optims:
        raise CheckpointError(f"{join(folder, OPTIM)}: no rank0.pt")
    needed = sorted({pieces[0][0] for pieces in holders.values() if pieces} | {0})
    per_rank = {}
    for r in needed:
        if r not in optims:
            raise CheckpointError(f"{join(folder, OPTIM)}: no rank{r}.pt")
        with TorchZip(optims[r], storage_options) as zf:
            per_rank[r] = load(zf.record("data.pkl"), optims[r], strict)
    ids, _ = _groups(per_rank[0], optims[0])
    unknown = [f for f in ids.values() if f not in shapes]
    if unknown:
        raise CheckpointError(f"{optims[0]}: param_names name {unknown[0]!r:.80}, which no flat parameter holds")
    state: list[tuple[Any, list[Any]]] = []
    keys: dict[str, tuple[str, str | None, str]] = {}
    for pid, fqn in ids.items():
        if not holders[fqn]:
            continue
        first, _, count = holders[fqn][0]
        entry = per_rank[first]["state"].get(pid)
        if not isinstance(entry, dict):
            continue  # no state (a parameter without gradients)
        for key, value in entry.items():
            if isinstance(value, TensorRef) and len(value.shape) == 1 and value.shape[0] == count:
                keys[state_path(pid, key)] = ("array", value.dtype, fqn)
            elif isinstance(value, TensorRef) and value.shape:
                raise CheckpointError(f"{optims[first]}: state {pid}/{key!r:.40} has shape {list(value.shape)}; "
                                      f"expected this rank's {count} elements of {fqn}")
            else:
                keys[state_path(pid, key)] = ("value", None, fqn)
        state.append((pid, list(entry)))
    return state, keys


# ---------------------------------------------------------------------------------------------- units
def open_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
              facts: dict[str, Any]) -> Any:
    """Open one unit; `facts` are the store's (the layout planned from rank 0)."""
    return open_olmo_unit(path, storage_options, strict, encode_key, facts, "olmo_local", "`local`", _open_file)


def _open_file(path: str, kind: str, name: str, place: Place, facts: dict[str, Any],
               storage_options: StorageOptions | None, strict: bool) -> FileUnit:
    layout = facts["olmo_local"]
    handles = [Handle.from_json(h) for h in layout["handles"]]
    m = _RANK.match(name)
    if m is None:
        raise CheckpointError(f"{path}: not a rank<N>.pt file")
    group_rank, group = int(m.group(1)) % layout["group"], layout["group"]
    zf = TorchZip(path, storage_options)
    unit = FileUnit(path, place.index, place.count, place.index, place.count, place.digest, {}, zf)
    with closed_on_error(unit.close, path):
        zf.verify("data.pkl")
        obj = load(zf.record("data.pkl"), path, strict)
        (_model_leaves if kind == MODEL else _optim_leaves)(unit, obj, handles, group_rank, group)
    return unit


def _slice(zf: TorchZip, data: TensorRef, offset: int, count: int, where: str) -> TensorRef:
    """Elements [offset, offset + count) of a 1-D tensor, as a tensor of their own (checked in place)."""
    check_view(zf, data, where)
    if len(data.shape) != 1 or offset + count > data.shape[0]:
        raise CheckpointError(f"{zf.path}: {where}: holds {list(data.shape)} elements, needs {offset + count}")
    return TensorRef(data.storage, data.offset + offset * data.stride[0], (count,), data.stride, data.dtype)


def _model_leaves(unit: FileUnit, obj: Any, handles: list[Handle], group_rank: int, group: int) -> None:
    found = _model_handles(obj, unit.path)
    check_model_file(handles, found, group_rank, group, unit.path)
    for h, (_, raw) in zip(handles, found):
        data = raw["flat_param.data"]
        for i, lo, n, off in h.pieces(group_rank, group):
            p = h.params[i]
            piece = LocalPiece((lo,), (n,), _slice(unit.container, data, off, n, p.fqn), unit.container)
            unit.leaves[model_path(p.fqn)] = ArrayLeaf(h.dtype, p.shape, [piece])


def _optim_leaves(unit: FileUnit, obj: Any, handles: list[Handle], group_rank: int, group: int) -> None:
    ids, cleaned = _groups(obj, unit.path)
    mine = {h.params[i].fqn: (lo, n, h.params[i].shape) for h in handles for i, lo, n, _ in h.pieces(group_rank, group)}
    for pid, entry in obj["state"].items():
        fqn = ids.get(pid)
        if fqn is None or not isinstance(entry, dict):
            raise CheckpointError(f"{unit.path}: state for parameter id {pid!r:.40}, which no param group lists")
        for key, value in entry.items():
            path = state_path(pid, key)
            if isinstance(value, TensorRef) and len(value.shape) == 1 and fqn in mine:
                lo, n, shape = mine[fqn]
                if value.shape[0] != n:
                    raise CheckpointError(f"{unit.path}: state {pid}/{key}: {value.shape[0]} elements, but this rank "
                                          f"holds {n} of {fqn}")
                piece = LocalPiece((lo,), (n,), _slice(unit.container, value, 0, n, f"{fqn} {key}"), unit.container)
                unit.leaves[path] = ArrayLeaf(value.dtype, shape, [piece])
            elif isinstance(value, TensorRef) and value.shape and math.prod(value.shape) == 0:
                continue  # state for a parameter this rank holds none of
            elif isinstance(value, TensorRef) and value.shape:
                raise CheckpointError(f"{unit.path}: state {pid}/{key!r:.40} has shape {list(value.shape)}, "
                                      f"but this rank holds none of {fqn}")
            else:
                unit.leaves[path] = value
    unit.leaves[PARAM_GROUPS] = cleaned
