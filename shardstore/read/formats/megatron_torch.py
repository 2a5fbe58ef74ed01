"""Megatron-LM's `--ckpt-format torch` checkpoints: `iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`,
one full `torch.save` per tensor- and pipeline-parallel rank (the pipeline rank only when PP > 1).

Each file holds its rank's `model` (the Megatron-Core model's `state_dict_for_save_checkpoint()`: its own
part of every tensor, its stage's layers under local numbers from 0) beside the run's `args`, its RNG
state and, without the distributed optimizer, its optimizer state. The model is merged by Megatron's own
partition rules, read from the names (Megatron records them on the parameters, not in the file):
column-parallel weights and biases (q/k/v, fc1, the embedding and the output layer: the vocabulary) on
dim 0, row-parallel weights (proj, fc2) on dim 1, norms and row-parallel biases whole on every rank (taken
from tensor rank 0). SwiGLU's fc1 is [gate; up] on every rank, so each rank's two halves go to their own
places. A stage's layers are renumbered by the layers before it (uniform stages: `args` says how many).
Everything else each file holds (args, RNG and optimizer states) is kept per file, under
`ranks/mp_rank_{tp:02d}[_{pp:03d}]/`, as saved. The store's tree is `{"model": ..., "ranks": ...}`.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

from ... import dtypes, paths
from ...errors import CheckpointError, closed_on_error
from ...locations import StorageOptions, folder_of, join, listing, name_of, subfolders
from ...records import TensorRef
from ...tree import KeyEncoder, Node
from ..contract import SMALL_TENSOR_BYTES, ArrayLeaf, CheckpointSpec, LocalPiece, ShardedSpec, ShardSpec
from ..primitives.container import TorchZip
from ..primitives.flatten import flatten
from ..primitives.identity import refuse_copies
from ..primitives.tensors import check_view
from ..primitives.unpickle import load
from ..source import check_step
from ..unit import FileUnit, planned_place, relative
from .trainer import moved

FORMAT = "megatron-torch"
FILE = "model_optim_rng.pt"
DISTRIB = "distrib_optim.pt"  # the distributed optimizer's state, gathered to data-parallel rank 0
RANK_FOLDER = re.compile(r"mp_rank_(?P<tp>[0-9]{2})(?:_(?P<pp>[0-9]{3}))?\Z")
MODEL, RANKS, DISTRIB_KEY = "model", "ranks", "distrib_optim"
LAYER = re.compile(r"(.*?(?:^|\.)layers\.)([0-9]+)(\..*)")
# Megatron's tensor-parallel layers, by the end of a parameter's name
COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
          "mlp.linear_fc1.bias", "embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")
ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
WHOLE = ("norm.weight", "norm.bias", "layer_norm_weight", "layer_norm_bias", "linear_proj.bias", "linear_fc2.bias",
         "embedding.position_embeddings.weight")
GLU = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
# Megatron-LM arguments for layouts this reader does not place (uneven or interleaved stages, experts)
ITERATION = re.compile(r"\Aiter_([0-9]+)\Z")  # save_checkpoint's f"iter_{iteration:07d}" folder
# What every rank's file of one save records alike: save_checkpoint writes them from one moment's globals
MOMENT = ("iteration", "num_floating_point_operations_so_far")
ARGS_MOMENT = ("iteration", "consumed_train_samples", "consumed_valid_samples", "skipped_train_samples")
UNREAD = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
          "num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout")


# ---------------------------------------------------------------------------------------------- files
def _rank_folders(folder: str, storage_options: StorageOptions | None) -> list[str]:
    return [n for n in subfolders(folder, storage_options) if RANK_FOLDER.match(n)]


def detect(folder: str, storage_options: StorageOptions | None = None) -> bool:
    """An iter_N/ folder of mp_rank_* folders, the first holding model_optim_rng.pt."""
    found = _rank_folders(folder, storage_options)
    return bool(found) and join(join(folder, found[0]), FILE) in listing(join(folder, found[0]), storage_options)


def _place(name: str) -> tuple[int, int]:
    m = RANK_FOLDER.match(name)
    if m is None:
        raise CheckpointError(f"{name}: not a Megatron-LM rank folder (mp_rank_TT[_PPP])")
    return int(m["tp"]), int(m["pp"] or 0)


def units(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Every rank's file, pipeline stage by stage, tensor rank by tensor rank; the grid must be whole."""
    names = _rank_folders(folder, storage_options)
    if len({RANK_FOLDER.match(n)["pp"] is None for n in names}) > 1:  # type: ignore[index]
        raise CheckpointError(f"{folder}: mixes mp_rank_TT and mp_rank_TT_PPP folders (two saves?)")
    places = {_place(n): n for n in names}
    tp, pp = max(t for t, _ in places) + 1, max(p for _, p in places) + 1
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for p in range(pp) for t in range(tp)
               if (t, p) not in places]
    if missing:
        raise CheckpointError(f"{folder}: rank folders missing for a {tp} x {pp} grid: {', '.join(missing[:8])}")
    out, optimizer = [], []
    for p in range(pp):
        for t in range(tp):
            sub = join(folder, places[(t, p)])
            there = listing(sub, storage_options)
            if join(sub, FILE) not in there:
                raise CheckpointError(f"{sub}: has no {FILE} (a save that did not finish?)")
            out.append(join(sub, FILE))
            optimizer += [join(sub, DISTRIB)] if join(sub, DISTRIB) in there else []
    if optimizer and len(optimizer) != len(out):
        raise CheckpointError(f"{folder}: {DISTRIB} in {len(optimizer)} of {len(out)} rank folders")
    return out + optimizer  # the model's files first: unit i < TP x PP is grid place i


def unit_kind(name: str) -> str:
    return f"{name_of(name)} files" if name_of(name) in (FILE, DISTRIB) else "files"


def _rank_name(path: str) -> str:
    return name_of(folder_of(path))


# ---------------------------------------------------------------------------------------------- layout
def _grid(args: Any, count: int, where: str) -> dict[str, Any]:
    """The facts the merge needs, from rank 0's `args`: refused where they name a layout not read."""
    state = getattr(args, "state", None)
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: holds no Megatron-LM args (the parallel layout is read from them)")
    tp, pp = state.get("tensor_model_parallel_size"), state.get("pipeline_model_parallel_size")
    layers = state.get("num_layers")
    if not (type(tp) is int and type(pp) is int and type(layers) is int) or min(tp, pp, layers) <= 0 \
            or tp * pp != count:
        raise CheckpointError(f"{where}: args say TP={tp!r:.20} x PP={pp!r:.20} over {layers!r:.20} layers; the "
                              f"folder holds {count} rank files")
    for key in UNREAD:
        if state.get(key) not in (None, 1 if key == "virtual_pipeline_model_parallel_size" else None):
            raise CheckpointError(f"{where}: args set {key}={state[key]!r:.40}: a pipeline layout shardstore does "
                                  f"not merge yet")
    if (state.get("expert_model_parallel_size") or 1) > 1 or layers % pp:
        raise CheckpointError(f"{where}: {layers} layers over {pp} stages with expert parallelism "
                              f"{state.get('expert_model_parallel_size')}: not a layout shardstore merges yet")
    return {"tp": tp, "pp": pp, "per_stage": layers // pp,
            "glu": bool(state.get("swiglu") or state.get("gated_linear_unit"))}


def _global_name(key: str, stage: int, grid: dict[str, Any], where: str) -> str:
    m = LAYER.fullmatch(key)
    if m is None:
        return key
    if int(m[2]) >= grid["per_stage"]:
        raise CheckpointError(f"{where}: {key}: layer {m[2]} of a stage of {grid['per_stage']} layers")
    return f"{m[1]}{int(m[2]) + stage * grid['per_stage']}{m[3]}"


Box = tuple[tuple[int, ...], tuple[int, ...], int, int]  # global offsets, sizes, first and last local row


def _boxes(name: str, shape: tuple[int, ...], t: int, grid: dict[str, Any], where: str
           ) -> tuple[tuple[int, ...], list[Box]]:
    """The global shape of a tensor, and the boxes tensor rank `t`'s part fills (with the local rows
    each comes from)."""
    tp, rows = grid["tp"], shape[0] if shape else 0
    whole = (tuple(0 for _ in shape), shape, 0, rows)
    if tp == 1:
        return shape, [whole]
    if name.endswith(WHOLE) or not shape:
        return shape, [whole] if t == 0 else []
    if name.endswith(GLU) and grid["glu"]:
        if rows % 2:
            raise CheckpointError(f"{where}: {name}: SwiGLU's fc1 of {rows} rows cannot be [gate; up]")
        half = rows // 2
        return (rows * tp, *shape[1:]), [((t * half, *(0,) * (len(shape) - 1)), (half, *shape[1:]), 0, half),
                                         ((tp * half + t * half, *(0,) * (len(shape) - 1)), (half, *shape[1:]),
                                          half, rows)]
    if name.endswith(COLUMN):
        return (rows * tp, *shape[1:]), [((t * rows, *(0,) * (len(shape) - 1)), shape, 0, rows)]
    if name.endswith(ROW) and len(shape) == 2:
        return (rows, shape[1] * tp), [((0, t * shape[1]), shape, 0, rows)]
    raise CheckpointError(f"{where}: {name}: a tensor whose tensor-parallel split shardstore does not know; "
                          f"it cannot be merged exactly")


class _Read:
    """One rank's file read: its model (global names, tensors and values) and everything else."""

    def __init__(self, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder):
        self.path, self.name = path, _rank_name(path)
        self.t, self.p = _place(self.name)
        self.optimizer = name_of(path) == DISTRIB  # its whole content: ranks/<rank>/distrib_optim/
        self.zip = TorchZip(path, storage_options)
        with closed_on_error(self.zip.close, path):
            self.zip.verify("data.pkl")
            obj = load(self.zip.record("data.pkl"), path, strict)
            if not isinstance(obj, dict) or not (self.optimizer or isinstance(obj.get(MODEL), dict)):
                raise CheckpointError(f"{path}: not a Megatron-LM checkpoint file (a dict with a `model` state dict)")
            self.model: dict[str, Any] = {} if self.optimizer else obj[MODEL]
            self.args = obj.get("args")
            self.moment = _moment(obj, self.args) if not self.optimizer else None
            try:
                tree, leaves = flatten(obj if self.optimizer else {k: v for k, v in obj.items() if k != MODEL},
                                       encode_key)
            except RecursionError:
                raise CheckpointError(f"{path}: values nested too deeply, or containing themselves") from None
            under = paths.join(RANKS, paths.escape(self.name), *([DISTRIB_KEY] if self.optimizer else []))
            self.shape_of_rest = tree.to_json()
            self.rest = moved(tree, under)
            self.leaves = {paths.join(under, k): v for k, v in leaves.items()}

    def place(self, grid: dict[str, Any]) -> None:
        """Its model's entries placed by the grid, once: `entries`, (global name, local tensor or value,
        global shape, boxes) each; `model_digest`, of their names, dtypes and shapes (what every tensor
        rank of a stage shares); `digest`, of those and its other keys."""
        self.entries: list[tuple[str, Any, tuple[int, ...], list[Box]]] = []
        for key, value in self.model.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{self.path}: model key {key!r:.40} is not a string")
            name = _global_name(key, self.p, grid, self.path)
            if isinstance(value, TensorRef):
                check_view(self.zip, value, f"{self.path}: {key}")
                shape, boxes = _boxes(name, tuple(value.shape), self.t, grid, self.path)
                self.entries.append((name, value, shape, boxes))
            else:
                self.entries.append((name, value, (), []))
        model = [(n, v.dtype, list(v.shape)) if isinstance(v, TensorRef) else (n, type(v).__name__)
                 for n, v, _, _ in self.entries]
        self.model_digest = hashlib.blake2b(repr(model).encode(), digest_size=16).hexdigest()
        self.digest = hashlib.blake2b(repr((self.model_digest, self.shape_of_rest)).encode(),
                                      digest_size=16).hexdigest()


def _moment(obj: dict[str, Any], args: Any) -> dict[str, Any]:
    """The save's moment as a file records it (MOMENT, and ARGS_MOMENT from its args), where it is plain."""
    state = getattr(args, "state", None)
    state = state if isinstance(state, dict) else {}
    found = {k: obj.get(k) for k in MOMENT} | {f"args.{k}": state.get(k) for k in ARGS_MOMENT}
    return {k: v for k, v in found.items() if isinstance(v, (int, float, str, type(None)))}


def check_iteration(where: str, state: Any, folder: str) -> None:
    """The iteration a save records (in every rank's file here; in its common state under torch_dist,
    read/formats/dcp.py) against its folder's name, save_checkpoint's `iter_{iteration:07d}`."""
    check_step(where, "iteration", state.get("iteration") if isinstance(state, dict) else None, folder, ITERATION)


def _same_moment(f: _Read, moment: dict[str, Any], first: str) -> None:
    """Refuse a rank's file of another save than `first`'s (whose moment is `moment`): Megatron-LM's files
    of one iteration and those of the next share every shape, and only this tells them apart."""
    for key, value in (f.moment or {}).items():
        if key in moment and moment[key] != value:
            raise CheckpointError(f"{f.path}: records {key} {value!r:.40}, but {first} records {moment[key]!r:.40}: "
                                  f"files of two saves; take every rank's file from the same iter_N folder")


def _model_path(name: str) -> str:
    return paths.join(MODEL, paths.escape(name))


def _big(value: Any) -> bool:
    return isinstance(value, TensorRef) and bool(value.shape) \
        and math.prod(value.shape) * dtypes.info(value.dtype).itemsize > SMALL_TENSOR_BYTES


# ---------------------------------------------------------------------------------------------- spec
def spec(folder: str, unit_paths: list[str], encode_key: KeyEncoder, strict: bool,
         storage_options: StorageOptions | None) -> CheckpointSpec:
    """Planned from every rank's file (their pickles, not their tensors): the grid from rank 0's args,
    each stage's names and shapes from its files, checked equal across a stage's tensor ranks."""
    refuse_copies(unit_paths, storage_options, FILE)  # no two ranks' parts of a model are the same bytes
    files: list[_Read] = []
    try:
        for path in unit_paths:
            files.append(_Read(path, storage_options, strict, encode_key))
        grid = _grid(files[0].args, sum(not f.optimizer for f in files), files[0].path)
        check_iteration(files[0].path, files[0].moment, folder)
        for f in files:
            _same_moment(f, files[0].moment or {}, files[0].path)
            f.place(grid)
        digests = [f.digest for f in files]
        first_of = {f.p: f for f in files if f.t == 0 and not f.optimizer}
        for f in files:
            first = first_of[f.p]
            if f.t and not f.optimizer and f.model_digest != first.model_digest:
                raise CheckpointError(f"{f.path}: its keys or shapes differ from {first.path}'s, the same stage's "
                                      f"tensor rank 0 (a file of another checkpoint?)")
        arrays: dict[str, ShardedSpec] = {}
        shards: dict[str, list[ShardSpec]] = {}
        model: list[tuple[Any, Node]] = []
        placed: set[str] = set()  # the model's store paths, stage by stage
        objects: list[str] = []
        for i, f in enumerate(files):
            for name, value, shape, boxes in f.entries:
                path = _model_path(name)
                if f.t == 0:
                    if path in placed:
                        raise CheckpointError(f"{f.path}: {name} is also in an earlier stage's file")
                    placed.add(path)
                    model.append((encode_key(name), Node("leaf", path)))
                if not isinstance(value, TensorRef):
                    if f.t == 0:
                        objects.append(path)
                    continue
                arrays[path] = ShardedSpec(value.dtype, shape, ())
                shards.setdefault(path, []).extend(ShardSpec(o, s, i) for o, s, _, _ in boxes)
            for path, value in f.leaves.items():
                if _big(value):
                    arrays[path] = ShardedSpec(value.dtype, tuple(value.shape),
                                               (ShardSpec((0,) * len(value.shape), tuple(value.shape), i),))
                else:
                    objects.append(path)
        for path, held in shards.items():
            arrays[path] = ShardedSpec(arrays[path].dtype, arrays[path].shape, tuple(held))
        ranks = Node("dict", RANKS, _per_rank(files, encode_key))
        tree = Node("dict", "", [(encode_key(MODEL), Node("odict", MODEL, model)), (encode_key(RANKS), ranks)])
    finally:
        for f in files:
            f.zip.close()
    names = [relative(u) for u in unit_paths]
    digest = hashlib.blake2b(repr(digests).encode(), digest_size=16).hexdigest()
    extra = {"units": names, "metadata": digest,
             "megatron": {"grid": grid, "digests": digests, "moment": files[0].moment, "first": names[0]},
             "megatron_common": ranks.children[0][1].path if ranks.children else None}  # the first rank's values
    return CheckpointSpec(FORMAT, len(names), len(names), tree, arrays, {}, objects, extra)


def _per_rank(files: list[_Read], encode_key: KeyEncoder) -> list[tuple[Any, Node]]:
    """Each rank's own values: its model file's, and its distributed optimizer's under distrib_optim."""
    out: dict[str, Node] = {}
    for f in files:
        if not f.optimizer:
            out[f.name] = f.rest
            continue
        node = out[f.name]
        if node.kind not in ("dict", "odict") or any(child.path == f.rest.path for _, child in node.children):
            raise CheckpointError(f"{f.path}: its rank's {FILE} already holds a `{DISTRIB_KEY}`")
        node.children.append((encode_key(DISTRIB_KEY), f.rest))
    return [(encode_key(name), node) for name, node in out.items()]


# ---------------------------------------------------------------------------------------------- units
def open_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
              facts: dict[str, Any]) -> FileUnit:
    """One rank's file, checked against the plan (its digest), its model's parts placed by the grid."""
    index, count = planned_place(relative(path), path, facts, "megatron", "Megatron-LM")
    f = _Read(path, storage_options, strict, encode_key)
    unit = FileUnit(path, index, count, index, count, facts["metadata"], {}, f.zip)
    with closed_on_error(unit.close, path):
        f.place(facts["megatron"]["grid"])
        if f.digest != facts["megatron"]["digests"][index]:
            raise CheckpointError(f"{path}: its keys or shapes differ from the file the store was planned from "
                                  f"(a file of another checkpoint?)")
        _same_moment(f, facts["megatron"].get("moment") or {}, facts["megatron"].get("first", "the first file"))
        for name, value, shape, boxes in f.entries:
            if not isinstance(value, TensorRef):
                if f.t == 0:
                    unit.leaves[_model_path(name)] = value
                continue
            row = value.stride[0] if value.shape else 0
            pieces = [LocalPiece(o, s, TensorRef(value.storage, value.offset + lo * row, s, value.stride, value.dtype),
                                 f.zip) for o, s, lo, _ in boxes]
            unit.leaves[_model_path(name)] = ArrayLeaf(value.dtype, shape, pieces)
        for p, value in f.leaves.items():
            if _big(value):
                check_view(f.zip, value, f"{path}: {p}")
                unit.leaves[p] = ArrayLeaf(value.dtype, tuple(value.shape),
                                           [LocalPiece((0,) * len(value.shape), tuple(value.shape), value, f.zip)])
            else:
                unit.leaves[p] = value
    return unit
