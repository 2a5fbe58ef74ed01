"""veRL's FSDP checkpoints (`global_step_N/actor/`), one `torch.save` per rank.

Each rank saves `model_world_size_{W}_rank_{r}.pt` (the model's state dict: DTensors under FSDP2 and under
FSDP1 built with a device mesh, plain tensors at world size 1), `optim_world_size_{W}_rank_{r}.pt` (the
optimizer's state dict: DTensor moments under FSDP2; under FSDP1 with `use_orig_params=False`, veRL's
default, the 1-D shards of its flat parameters, keyed 0..N) and `extra_state_world_size_{W}_rank_{r}.pt`
(the LR scheduler and RNG states). The store's tree is `{"model": ..., "optim": ..., "extra_state": ...}`.

How every rank's box of a DTensor is read from the files is read/formats/dtensor.py. An FSDP1 flat parameter's
optimizer state is split per parameter where the model files and FSDP's flattening rule say exactly how
(read/formats/fsdp_flat.py), else kept as the flat vector it is, the shards of one replica group in their mesh
order (padding included).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

from ...facts import CheckpointFacts
from ...errors import CheckpointError, closed_on_error
from ...hf_files import hf_model_file
from ...locations import StorageOptions, join, listing
from ...patterns import digits
from ...records import TensorRef
from ...trainers.verl import LORA_META
from ...tree import KeyEncoder, Node
from ..contract import ArrayLeaf, CheckpointSpec, LocalPiece, ShardedSpec, replica_count
from ..primitives import tensors
from ..primitives.identity import refuse_copies
from ..unit import FileUnit, flat_spec, planned_place, relative
from . import fsdp_flat
from .dtensor import (STATE, File, Layout, Mesh, array_leaf, array_spec, box_of, boxes, digest_of, layouts_of,
                      mesh_from_json, mesh_json, model_mesh, read_file)

FORMAT = "verl"
ACTOR = "actor"
UNIT_FOLDERS = (ACTOR,)  # a path to it names the step folder's checkpoint
KINDS = ("model", "optim", "extra_state")
UNIT_FILE = re.compile(r"(?P<kind>model|optim|extra_state)_world_size_(?P<world>[0-9]+)_rank_(?P<rank>[0-9]+)\.pt\Z")
PARAM_GROUPS = "optim/param_groups"
HF_FOLDER = "huggingface"
SIDE_FILES = ("fsdp_config.json", LORA_META)


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
    """What veRL's rank 0 saves beside the rank files: `fsdp_config.json`, a LoRA run's `lora_train_meta.json`,
    and `huggingface/` (the model's config, generation config and tokenizer files), which `--format hf`
    uses without a flag."""
    actor = join(folder, ACTOR)
    here = [p for p in listing(actor, storage_options) if p.rsplit("/", 1)[-1] in SIDE_FILES]
    return here + [p for p in listing(join(actor, HF_FOLDER), storage_options)
                   if hf_model_file(p.rsplit("/", 1)[-1])]




def _read(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder) -> File:
    return read_file(path, *_parse(path), storage_options, strict, encode_key)


# ---------------------------------------------------------------------------------------------- spec
def _flat_index(path: str) -> str | None:
    """The optimizer's key of the state entry a path lies in ("3" for optim/state/3/exp_avg)."""
    return path[len(STATE):].split("/", 1)[0] if path.startswith(STATE) else None


def _member_paths(path: str, held: list[fsdp_flat.Member]) -> list[tuple[fsdp_flat.Member, str]]:
    """optim/state/{k}/{key} -> optim/state/{parameter}/{key} for each parameter flat parameter k holds."""
    tail = path[len(STATE):].split("/", 1)[1]
    return [(m, f"{STATE}{m.name}/{tail}") for m in held]


def _split(model: File, model_layouts: dict[str, tuple[Layout, TensorRef]], optim: File,
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
    params, model_keys = _parameters(model, model_layouts)
    found = fsdp_flat.split(params, list(lengths.values()), 1 if mesh is None else mesh.shape[-1], model_keys)
    return None if found is None else dict(zip(lengths, found))


def _parameters(model: File, model_layouts: dict[str, tuple[Layout, TensorRef]]) -> \
        tuple[list[tuple[str, tuple[int, ...]]], dict[str, Any]]:
    """The model's parameters in order (store name, global shape), a tied weight once; and each store
    name's key as the state dict has it."""
    params, seen = [], set()
    for path, (layout, _) in model_layouts.items():
        leaf = model.leaves[path]
        if id(leaf) in seen:  # a tied weight: one parameter under two keys
            continue
        seen.add(id(leaf))
        if layout.kind == "dtensor" or model.world == 1:
            params.append((path[len("model/"):], layout.shape))
    keys = {node.path[len("model/"):]: key for key, node in _walk_nodes(model.tree) if node.path.startswith("model/")}
    return params, keys


def _group_count(optim: File) -> int | None:
    """How many parameters the optimizer's param_groups list."""
    groups: Any = optim.leaves.get(PARAM_GROUPS)  # as pickled: its shape is checked by the sum
    try:
        return sum(len(g["params"]) for g in groups)
    except (TypeError, KeyError):
        return None


@dataclass(frozen=True)
class _Ragged:
    """Every rank's optimizer file under `use_orig_params=True`, as planning needs them."""

    trees: list[Node]
    digests: list[str]  # per rank: each file is checked against its own
    parts: dict[int, list[tuple[int, int, int]]]  # parameter index -> (rank, first element, count)
    split: dict[str, list[fsdp_flat.Member]]  # each parameter as a one-member split
    leaves: dict[str, Any]  # every path any rank holds, the lowest rank's leaf
    layouts: dict[str, tuple[Layout, TensorRef]]


def _ragged(model: File, model_layouts: dict[str, tuple[Layout, TensorRef]], optim: File, paths: list[str],
            mesh: Mesh | None, storage_options: StorageOptions | None, strict: bool,
            encode_key: KeyEncoder) -> _Ragged | None:
    """FSDP1 with `use_orig_params=True` (veRL's choice when part of a model is frozen): the optimizer's
    state is per original parameter, each rank holding a differently sized 1-D part, or none
    (fsdp_flat.ragged). Told apart from flat parameters by its param_groups listing every model parameter.
    Every rank's optimizer file is read (its pickle) to place the parts; None when the files are not so."""
    params, keys = _parameters(model, model_layouts)
    if mesh is None or _group_count(optim) != len(params) or len(params) == len(mesh.ranks):
        return None
    files = [optim] + [_read(p, storage_options, strict, encode_key) for p in paths[1:]]
    try:
        lengths: dict[int, dict[int, int]] = {}
        digests = []
        per_file = [layouts_of(f) for f in files]
        for f, layouts in zip(files, per_file):
            digests.append(digest_of(f, layouts))
            mine: dict[int, int] = {}
            for path, (layout, _) in layouts.items():
                index = _flat_index(path) or ""
                if layout.kind != "flat" or not digits(index):
                    return None
                if mine.setdefault(int(index), layout.shape[0]) != layout.shape[0]:
                    raise CheckpointError(f"{f.path}: {path}: {layout.shape[0]} elements, but the other state of "
                                          f"parameter {index} here has {mine[int(index)]}")
            lengths[f.rank] = mine
        groups = [list(mesh.ranks[i:i + mesh.shape[-1]]) for i in range(0, len(mesh.ranks), mesh.shape[-1])]
        parts = fsdp_flat.ragged([math.prod(shape) for _, shape in params], lengths, groups)
        if parts is None:
            raise CheckpointError(f"{optim.path}: optimizer state per original parameter (use_orig_params=True) "
                                  f"whose ranks' parts do not add up to the model's parameters; not guessed at")
        leaves = {p: leaf for f in reversed(files) for p, leaf in f.leaves.items()}  # the lowest rank's
        layouts = {p: lay for lay_of in reversed(per_file) for p, lay in lay_of.items()}
    finally:
        for f in files[1:]:
            f.zip.close()
    split = {str(i): [fsdp_flat.Member(name, shape, 0, keys.get(name, name))] for i, (name, shape) in enumerate(params)}
    return _Ragged([f.tree for f in files], digests, parts, split, leaves, layouts)


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


def _union_state(tree: Node, trees: list[Node]) -> None:
    """The optimizer's state entries of every rank's file (each holds only the parameters its shard
    covers), in index order, the lowest rank's node for each."""
    states = [next(node for _, node in _walk_nodes(t) if node.path == STATE.rstrip("/")) for t in trees]
    entries: dict[Any, Node] = {}
    for state in states:
        for key, node in state.children:
            entries.setdefault(key, node)
    mine = next(node for _, node in _walk_nodes(tree) if node.path == STATE.rstrip("/"))
    mine.children = sorted(entries.items(), key=lambda kv: int(kv[1].path[len(STATE):]))


def _walk_nodes(node: Node) -> list[tuple[Any, Node]]:
    out = []
    for key, child in node.children:
        out.append((key, child))
        out += _walk_nodes(child)
    return out


def spec(folder: str, unit_paths: list[str], encode_key: KeyEncoder, strict: bool,
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
        model = layouts_of(files[0])
        mesh = model_mesh(model)
        arrays: dict[str, ShardedSpec] = {}
        objects: list[str] = []
        digests = {}
        optim = next((f for f in files if f.kind == "optim"), None)
        if optim is not None and mesh is not None:  # ranks at one coordinate of the shard dimension are replicas
            refuse_copies([u for u in unit_paths if _parse(u)[0] == "optim"], storage_options, "optimizer file",
                          lambda path: (mesh.coordinate(_parse(path)[2]) or (None,))[-1])
        ragged = None if optim is None else _ragged(
            files[0], model, optim, [u for u in unit_paths if _parse(u)[0] == "optim"], mesh, storage_options,
            strict, encode_key)
        split: dict[str, list[fsdp_flat.Member]] | None
        if ragged is not None:
            split = ragged.split
            _union_state(tree, ragged.trees)
        else:
            split = _split(files[0], model, optim, layouts_of(optim), mesh) if optim is not None else None
        for f in files:
            leaves, layouts = (ragged.leaves, ragged.layouts) if ragged and f.kind == "optim" else \
                (f.leaves, model if f.kind == "model" else layouts_of(f))
            if any(l.kind == "flat" for l, _ in layouts.values()) and mesh is None and f.world > 1:
                raise CheckpointError(f"{f.path}: FSDP1 flat-parameter optimizer shards, but the model files do not "
                                      f"say which mesh dimension they are sharded over")
            digests[f.kind] = digest_of(f, layouts) if not (ragged and f.kind == "optim") else \
                hashlib.blake2b(repr(ragged.digests).encode(), digest_size=16).hexdigest()
            base = first[f.kind] - f.rank  # unit index of this kind's rank 0
            for path in leaves:
                index = _flat_index(path) or ""
                held = split.get(index) if split and f.kind == "optim" else None
                if held is not None:  # a flat parameter's state: one leaf per parameter it holds
                    for member, place in _member_paths(path, held):
                        if path not in layouts:
                            objects.append(place)
                            continue
                        layout, _ = layouts[path]
                        ranges = [(base + r, lo, n) for r, lo, n in ragged.parts[int(index)]] if ragged else \
                            [(base + r, lo, n) for r, (o,), (size,) in boxes(layout, f.world, mesh)
                             for _, lo, n in fsdp_flat.overlaps([member], o, size)]
                        arrays[place] = flat_spec(layout.dtype, member.shape, ranges)
                    continue
                if path not in layouts:
                    objects.append(path)
                    continue
                arrays[path] = array_spec(layouts[path][0], f.world, mesh, base)
        if split:
            _retree(tree, split)
    finally:
        for f in files:
            f.zip.close()
    digest = hashlib.blake2b(repr(sorted(digests.items())).encode(), digest_size=16).hexdigest()
    facts = {"layouts": digests, "mesh": mesh_json(mesh),
             "split": {k: [[m.name, list(m.shape), m.start, m.key] for m in held] for k, held in (split or {}).items()}}
    if ragged is not None:
        facts["ragged"] = {"digests": ragged.digests,
                           "parts": {str(i): [list(p) for p in ps] for i, ps in ragged.parts.items()}}
    kept = CheckpointFacts(units=tuple(names), metadata=digest, replicas=replica_count(arrays), reader={"verl": facts})
    return CheckpointSpec(FORMAT, len(names), len(names), tree, arrays, {}, objects, kept)


# ---------------------------------------------------------------------------------------------- units
def open_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
              facts: dict[str, Any]) -> FileUnit:
    """One rank's file, checked against the plan: the same keys and layouts as rank 0's file of its kind
    (a digest of them), and a local tensor that is exactly the box its rank holds."""
    index, count = planned_place(relative(path), path, facts, "verl", "veRL")
    f = _read(path, storage_options, strict, encode_key)
    unit = FileUnit(path, index, count, index, count, facts["metadata"], {}, f.zip)
    with closed_on_error(unit.close, path):
        mesh = mesh_from_json(facts["verl"]["mesh"])
        layouts = layouts_of(f)
        ragged = facts["verl"].get("ragged") if f.kind == "optim" else None
        want = ragged["digests"][f.rank] if ragged and f.rank < len(ragged["digests"]) else \
            facts["verl"]["layouts"].get(f.kind)
        if digest_of(f, layouts) != want:
            raise CheckpointError(f"{path}: its keys or tensor layouts differ from " +
                                  (f"rank {f.rank}'s" if ragged else f"rank 0's {f.kind}") +
                                  " file the store was planned from (a file of another checkpoint?)")
        split = {k: [fsdp_flat.Member(n, tuple(shape), start, key) for n, shape, start, key in held]
                 for k, held in facts["verl"].get("split", {}).items()} if f.kind == "optim" else {}
        for p, leaf in f.leaves.items():
            held = split.get(_flat_index(p))
            if held is not None and ragged:
                _part_leaf(unit, f, p, leaf, layouts.get(p), held[0], ragged["parts"][_flat_index(p)])
                continue
            if held is not None:
                _split_leaf(unit, f, p, leaf, layouts.get(p), held, mesh)
                continue
            if split and p == PARAM_GROUPS:
                unit.leaves[p] = _named_groups(leaf, split, path)
                continue
            if p not in layouts:
                unit.leaves[p] = leaf
                continue
            unit.leaves[p] = array_leaf(f, p, leaf, *layouts[p], mesh)
    return unit


def _named_groups(groups: Any, split: dict[str, list[fsdp_flat.Member]], where: str) -> Any:
    """The param groups with each flat parameter's index replaced by the names of the parameters it
    holds, as torch's full optimizer state dicts list them."""
    try:
        return [{**g, "params": [m.key for k in g["params"] for m in split[str(k)]]} for g in groups]
    except (TypeError, KeyError, AttributeError):
        raise CheckpointError(f"{where}: param_groups that do not list the flat parameters the state holds") from None


def _split_leaf(unit: FileUnit, f: File, path: str, leaf: Any, planned: tuple[Layout, TensorRef] | None,
                held: list[fsdp_flat.Member], mesh: Mesh | None) -> None:
    """A flat parameter's state entry as the entries of the parameters it holds: a value (`step`) for
    each, or this rank's slice of the flat vector cut at the parameters' edges."""
    if planned is None:
        for _, place in _member_paths(path, held):
            unit.leaves[place] = leaf
        return
    layout, local = planned
    (first,), (count,) = box_of(layout, f.rank, mesh)  # type: ignore[misc]
    pieces = {m.name: (lo, n) for m, lo, n in fsdp_flat.overlaps(held, first, count)}
    for m, place in _member_paths(path, held):
        if m.name not in pieces:
            unit.leaves[place] = ArrayLeaf(layout.dtype, m.shape, [])
            continue
        lo, n = pieces[m.name]
        view = TensorRef(local.storage, local.offset + m.start + lo - first, (n,), (1,), local.dtype)
        tensors.check_view(f.zip, view, place)
        unit.leaves[place] = ArrayLeaf(layout.dtype, m.shape, [LocalPiece((lo,), (n,), view, f.zip)])


def _part_leaf(unit: FileUnit, f: File, path: str, leaf: Any, planned: tuple[Layout, TensorRef] | None,
               member: fsdp_flat.Member, parts: list[list[int]]) -> None:
    """A parameter's state entry under `use_orig_params=True`: a value (`step`), or this rank's part of the
    parameter's elements, where the plan placed it."""
    (_, place), = _member_paths(path, [member])
    if planned is None:
        unit.leaves[place] = leaf
        return
    layout, local = planned
    mine = next(((lo, n) for r, lo, n in parts if r == f.rank), None)
    if mine is None or (mine[1],) != tuple(local.shape):
        raise CheckpointError(f"{f.path}: {path}: {list(local.shape)} elements where the plan gives rank {f.rank} "
                              f"{mine[1] if mine else 'none'}")
    tensors.check_view(f.zip, local, place)
    unit.leaves[place] = ArrayLeaf(layout.dtype, member.shape, [LocalPiece((mine[0],), (mine[1],), local, f.zip)])
