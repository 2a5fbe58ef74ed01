"""Megatron-LM's `--ckpt-format torch` checkpoints:
`iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`, one full `torch.save` per tensor-,
pipeline- and expert-parallel rank (the pipeline rank only when PP > 1, the expert rank only when EP > 1:
`mp_rank_TT_NNN` is either, which the run's `args` tell).

Each file holds its rank's `model` (the Megatron-Core model's `state_dict_for_save_checkpoint()`: its own
part of every tensor, its stage's layers under local numbers from 0; `model0`, `model1`, ... with virtual
pipeline stages, one per chunk) beside the run's `args`, its RNG state and, without the distributed
optimizer, its optimizer state. The model is merged by Megatron's own partition rules, read from the
names (Megatron records them on the parameters, not in the file): column-parallel weights and biases
(q/k/v, fc1, the embedding and the output layer: the vocabulary; MLA's q and kv up projections, MTP's
eh_proj) on dim 0, row-parallel weights (proj, fc2) on dim 1, norms, row-parallel biases and the router
whole on every rank (taken from tensor rank 0). SwiGLU's fc1 (dense, shared expert, each routed expert)
is [gate; up] on every rank, so each rank's two halves go to their own places. A LoRA adapter
(Megatron-Bridge's, NeMo's `X.adapter.linear_in`/`linear_out`) is split as its linear's input and output. A chunk's layers are
renumbered by the layers before it (uniform stages: `args` say how many); MTP's `mtp.layers.{i}` are not
decoder layers and keep their numbers. Routed experts are numbered within their expert rank's file
(`local_experts.{l}`, Transformer Engine's `linear_fc1.weight{l}`) and become
`local_experts.{ep * (num_experts / EP) + l}` (SequentialMLP's names, as the torch_dist reading gives both);
what is not an expert is the same in every expert rank's file and is taken from expert rank 0's.
Everything else each file holds (args, RNG and optimizer states, and the distributed optimizer's
`distrib_optim.pt` beside it) is kept per file, under `ranks/mp_rank_.../`, as saved. The store's tree
is `{"model": ..., "ranks": ...}`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from typing import Any, NamedTuple

from ...facts import CheckpointFacts
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
from ...trainers import megatron
from ..source import check_step
from ..unit import FileUnit, planned_place, relative
from .trainer import moved

FORMAT = "megatron-torch"
FILE = "model_optim_rng.pt"
DISTRIB = "distrib_optim.pt"  # the distributed optimizer's state, gathered to data-parallel rank 0
RANK_FOLDER = re.compile(r"mp_rank_([0-9]{2})(?:_([0-9]{3}))?(?:_([0-9]{3}))?\Z")
MODEL, RANKS, DISTRIB_KEY = "model", "ranks", "distrib_optim"
# veRL's Megatron actor's LoRA adapter files (verl_adapters.py): `mp_rank_TT[_PPP][_EEE]_adapter.pt`, each
# `{"adapter_state_dict": its rank's part of every adapter}`, merged as a Megatron-LM file's model
ADAPTER_FILE, ADAPTER_MODEL = re.compile(r"(mp_rank_[0-9]{2}(?:_[0-9]{3}){0,2})_adapter\.pt\Z"), "adapter_state_dict"
CHUNK = re.compile(r"model([0-9]+)\Z")  # generate_state_dict's `model%d`, one per virtual pipeline chunk
LAYER = re.compile(r"(.*?(?:^|\.)layers\.)([0-9]+)(\..*)")
MTP = "mtp.layers."  # multi-token prediction's layers: numbered apart from the decoder's
# Routed experts, numbered within their expert rank: SequentialMLP's, and Transformer Engine's grouped GEMMs'
# (TEGroupedMLP's `linear_fc1.weight{l}`, one per local GEMM, named as SequentialMLP's expert l is, as the
# torch_dist reading names them: both save the same torch_dist keys)
EXPERT = re.compile(r"(?P<head>.*(?:^|\.)experts\.)local_experts\.(?P<n>[0-9]+)\.(?P<tail>.*)\Z")
GROUPED = re.compile(r"(?P<head>.*(?:^|\.)experts\.)(?P<tail>linear_fc[12]\.(?:weight|bias))(?P<n>[0-9]+)\Z")
ROUTER = re.compile(r"(?:^|\.)router\.(weight|bias|expert_bias)\Z")  # num_experts rows, on every rank
# Embedding's copy on the last stage (multi-token prediction's, or a tied output layer's)
EMBEDDING = "embedding.word_embeddings.weight"


def _tail(*alternatives: str) -> re.Pattern[str]:
    """Names ending in one of `alternatives` (patterns of their last dotted parts)."""
    return re.compile(rf"(?:^|\.)(?:{'|'.join(alternatives)})\Z")


# Megatron's tensor-parallel layers, by the end of a parameter's name. MLP: a dense MLP, the shared expert,
# a SequentialMLP expert (their TP split is the expert-TP one, which must be the TP one here)
MLP = r"(?:mlp|shared_experts|local_experts\.[0-9]+)"
GLU = _tail(rf"{MLP}\.linear_fc1\.(?:weight|bias)")
COLUMN = _tail(r"self_attention\.linear_qkv\.(?:weight|bias)", r"embedding\.word_embeddings\.weight",
               r"output_layer\.(?:weight|bias)", r"self_attention\.linear_(?:q_proj|q_up_proj|kv_up_proj)\.weight",
               r"eh_proj\.weight", r"core_attention\.softmax_offset")
ROW = _tail(r"self_attention\.linear_proj\.weight", rf"{MLP}\.linear_fc2\.weight")
WHOLE = _tail(r"[a-z_]*norm\.(?:weight|bias)", r"layer_norm_(?:weight|bias)", r"linear_proj\.bias",
              r"linear_fc2\.bias", r"embedding\.position_embeddings\.weight",
              r"router\.(?:weight|bias|expert_bias)", r"shared_experts\.gate_weight")
# A LoRA adapter of a linear (Megatron-Bridge's, NeMo's: its ParallelLinearAdapter), split as that linear's
# input and output are: A (linear_in) a column-parallel linear's on its r rows (dim 0), a row-parallel
# one's on its columns (dim 1); B (linear_out) on its rows (dim 0), SwiGLU fc1's [gate; up] on each rank
ADAPTER = re.compile(r"(?P<base>.+)\.adapter\.linear_(?P<part>in|out)\.weight\Z")
# A module's extra state (Transformer Engine's FP8 metadata, an empty uint8 tensor without FP8; the local
# spec's None): a value, kept as tensor rank 0's, not an array to merge
EXTRA = "._extra_state"
# MLA's down projections: duplicated on every rank (Transformer Engine's spec) or column-parallel (the local
# one); their rows tell which. The fused one is [q; kv].
DOWN = {"self_attention.linear_q_down_proj.weight": ("q",), "self_attention.linear_kv_down_proj.weight": ("kv",),
        "self_attention.linear_qkv_down_proj.weight": ("q", "kv")}
# What every rank's file of one save records alike: save_checkpoint writes them from one moment's globals
MOMENT = ("iteration", "num_floating_point_operations_so_far")
ARGS_MOMENT = ("iteration", "consumed_train_samples", "consumed_valid_samples", "skipped_train_samples")
# Megatron-LM arguments for pipeline layouts this reader does not place (uneven stages)
UNREAD = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
          "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


# ---------------------------------------------------------------------------------------------- files
def _rank_folders(folder: str, storage_options: StorageOptions | None) -> list[str]:
    return [n for n in subfolders(folder, storage_options) if RANK_FOLDER.match(n)]


def detect(folder: str, storage_options: StorageOptions | None = None) -> bool:
    """An iter_N/ folder of mp_rank_* folders, the first holding model_optim_rng.pt."""
    found = _rank_folders(folder, storage_options)
    return bool(found) and join(join(folder, found[0]), FILE) in listing(join(folder, found[0]), storage_options)


def _numbers(name: str) -> tuple[int, ...]:
    """A rank folder's numbers: (tp,), (tp, pp or ep) or (tp, pp, ep)."""
    m = RANK_FOLDER.match(name)
    if m is None:
        raise CheckpointError(f"{name}: not a Megatron-LM rank folder (mp_rank_TT[_PPP][_EEE])")
    return tuple(int(n) for n in m.groups() if n is not None)


def _folder_name(numbers: tuple[int, ...]) -> str:
    return f"mp_rank_{numbers[0]:02d}" + "".join(f"_{n:03d}" for n in numbers[1:])


def units(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Every rank's file, pipeline stage by stage, expert rank by expert rank, tensor rank by tensor rank;
    the grid its folders make must be whole (the args, read later, say which grid it must be)."""
    places = {_numbers(n): n for n in _rank_folders(folder, storage_options)}
    if len({len(p) for p in places}) > 1:
        raise CheckpointError(f"{folder}: mixes mp_rank_TT, mp_rank_TT_NNN and mp_rank_TT_NNN_NNN folders "
                              f"(two saves?)")
    sizes = [max(p[i] for p in places) + 1 for i in range(len(next(iter(places))))]
    order = sorted(itertools.product(*(range(s) for s in sizes)), key=lambda p: p[1:] + p[:1])
    missing = [_folder_name(p) for p in order if p not in places]
    if missing:
        raise CheckpointError(f"{folder}: rank folders missing for a {' x '.join(map(str, sizes))} grid: "
                              f"{', '.join(missing[:8])}")
    out, optimizer = [], []
    for place in order:
        sub = join(folder, places[place])
        there = listing(sub, storage_options)
        if join(sub, FILE) not in there:
            raise CheckpointError(f"{sub}: has no {FILE} (a save that did not finish?)")
        out.append(join(sub, FILE))
        optimizer += [join(sub, DISTRIB)] if join(sub, DISTRIB) in there else []
    if optimizer and len(optimizer) != len(out):
        raise CheckpointError(f"{folder}: {DISTRIB} in {len(optimizer)} of {len(out)} rank folders")
    return out + optimizer  # the model's files first


def unit_kind(name: str) -> str:
    return f"{name_of(name)} files" if name_of(name) in (FILE, DISTRIB) else "files"


def _rank_name(path: str) -> str:
    """The rank's folder name, `mp_rank_TT[_PPP][_EEE]` (of a veRL adapter file: its name's)."""
    adapter = ADAPTER_FILE.match(name_of(path))
    return adapter[1] if adapter else name_of(folder_of(path))


# ---------------------------------------------------------------------------------------------- layout
def _whole_number(state: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = state.get(key)
    value = default if value is None else value
    if type(value) is not int or value <= 0:
        raise CheckpointError(f"{where}: args set {key}={value!r:.20}: not a positive whole number")
    return value


def _grid(args: Any, where: str) -> dict[str, Any]:
    """The facts the merge needs, from rank 0's `args` (or a dict of them): refused where they name a
    layout not read."""
    state = args if isinstance(args, dict) else getattr(args, "state", None)
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: holds no Megatron-LM args (the parallel layout is read from them)")
    tp, pp = (_whole_number(state, k, where) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    layers = _whole_number(state, "num_layers", where)
    ep = _whole_number(state, "expert_model_parallel_size", where, 1)
    vp = _whole_number(state, "virtual_pipeline_model_parallel_size", where, 1)
    for key in UNREAD:
        if state.get(key) not in (None, False):
            raise CheckpointError(f"{where}: args set {key}={state[key]!r:.40}: a pipeline layout shardstore does "
                                  f"not merge yet")
    if layers % (pp * vp) or state.get("num_layers_per_virtual_pipeline_stage") not in (None, layers // (pp * vp)):
        raise CheckpointError(f"{where}: {layers} layers over {pp} stages of {vp} virtual chunks (args "
                              f"num_layers_per_virtual_pipeline_stage="
                              f"{state.get('num_layers_per_virtual_pipeline_stage')!r:.20}): not a layout shardstore "
                              f"merges yet")
    if _whole_number(state, "expert_tensor_parallel_size", where, tp) != tp:
        raise CheckpointError(f"{where}: args set expert_tensor_parallel_size={state['expert_tensor_parallel_size']} "
                              f"with tensor_model_parallel_size={tp}: the experts' own tensor split, which "
                              f"shardstore does not merge yet")
    experts = state.get("num_experts")
    if ep > 1 and (type(experts) is not int or experts <= 0 or experts % ep):
        raise CheckpointError(f"{where}: args set num_experts={experts!r:.20} over expert_model_parallel_size={ep}: "
                              f"not a whole number of experts per expert rank")
    kv = [k for k in (state.get("kv_lora_rank"), state.get("qk_pos_emb_head_dim")) if type(k) is int]
    mla = {"q": state.get("q_lora_rank"), "kv": sum(kv) if len(kv) == 2 else None} \
        if state.get("multi_latent_attention") else None  # MLA's down projections' rows: q's; kv's [latent; rope]
    return {"tp": tp, "pp": pp, "ep": ep, "vp": vp, "per_chunk": layers // (pp * vp), "experts": experts,
            "local": experts // ep if type(experts) is int else None, "mla": mla,
            "glu": bool(state.get("swiglu") or state.get("gated_linear_unit"))}


def _names(grid: dict[str, Any]) -> list[str]:
    """Every rank folder the args' grid has, as get_checkpoint_name names it."""
    return [_folder_name((t, *([p] if grid["pp"] > 1 else []), *([e] if grid["ep"] > 1 else [])))
            for t, p, e in itertools.product(range(grid["tp"]), range(grid["pp"]), range(grid["ep"]))]


def _place_of(name: str, path: str, grid: dict[str, Any]) -> tuple[int, int, int]:
    """A rank folder's (tensor, pipeline, expert) ranks: `mp_rank_TT_NNN` is a pipeline rank or an expert
    rank as the args' grid has PP > 1 or EP > 1."""
    numbers = list(_numbers(name))
    sizes = [grid["tp"]] + [grid[k] for k in ("pp", "ep") if grid[k] > 1]
    if len(numbers) != len(sizes) or any(n >= size for n, size in zip(numbers, sizes)):
        raise CheckpointError(f"{path}: {name} is not a rank folder of the args' TP={grid['tp']} x PP={grid['pp']} x "
                              f"EP={grid['ep']} grid")
    t = numbers.pop(0)
    p = numbers.pop(0) if grid["pp"] > 1 else 0
    return t, p, numbers.pop(0) if grid["ep"] > 1 else 0


class _Name(NamedTuple):
    """A tensor's global name, and where the model's tree puts it: its chunk's place in the model, and for
    a routed expert its layer's experts (`group`), its number and which of each expert's tensors it is
    (`param`, the name with `*` for the number)."""

    name: str
    chunk: int
    group: str | None
    expert: int
    param: str


def _global_name(key: str, place: tuple[int, int, int, int], grid: dict[str, Any], where: str) -> _Name:
    """A chunk's local name made global: its layer renumbered by the layers before its chunk (virtual
    chunk v of stage p: v * L / VP + p * L / (PP * VP)), a routed expert by the experts before its rank's."""
    _, p, e, v = place
    m = LAYER.fullmatch(key)
    if m is not None and not m[1].endswith(MTP):
        if int(m[2]) >= grid["per_chunk"]:
            raise CheckpointError(f"{where}: {key}: layer {m[2]} of a stage of {grid['per_chunk']} layers")
        key = f"{m[1]}{int(m[2]) + (v * grid['pp'] + p) * grid['per_chunk']}{m[3]}"
    chunk = v * grid["pp"] + p
    m = EXPERT.fullmatch(key) or GROUPED.fullmatch(key)
    if m is None:
        return _Name(key, chunk, None, -1, "")
    local = int(m["n"])
    if grid["local"] is not None and local >= grid["local"]:
        raise CheckpointError(f"{where}: {key}: expert {local} of an expert rank's {grid['local']} (num_experts "
                              f"{grid['experts']} over {grid['ep']} expert ranks)")
    number = local + e * (grid["local"] or 0)
    group = f"{m['head']}local_experts."
    return _Name(f"{group}{number}.{m['tail']}", chunk, group, number, f"{group}*.{m['tail']}")


Box = tuple[tuple[int, ...], tuple[int, ...], int, int]  # global offsets, sizes, first and last local row


def _split(shape: tuple[int, ...], t: int, tp: int, parts: list[int]) -> tuple[tuple[int, ...], list[Box]]:
    """A tensor each rank holds 1/tp of each of `parts` (global row counts) of, end to end: its global
    shape and the boxes rank `t`'s rows fill."""
    boxes: list[Box] = []
    local = start = 0
    for part in parts:
        rows = part // tp
        boxes.append(((start + t * rows, *(0,) * (len(shape) - 1)), (rows, *shape[1:]), local, local + rows))
        local, start = local + rows, start + part
    return (start, *shape[1:]), boxes


def _down(name: str, shape: tuple[int, ...], t: int, grid: dict[str, Any], where: str
          ) -> tuple[tuple[int, ...], list[Box]]:
    """MLA's down projection: whole on every rank when it holds all its rows (Transformer Engine's spec
    duplicates it), column-parallel when it holds 1/TP of each of them (the local spec's)."""
    mla, tp, rows = grid["mla"], grid["tp"], shape[0]
    said = [mla[p] if mla else None for p in next(v for k, v in DOWN.items() if name.endswith(k))]
    parts = [p for p in said if type(p) is int and p > 0]
    if len(parts) != len(said):
        raise CheckpointError(f"{where}: {name}: the args name no multi_latent_attention with q_lora_rank, "
                              f"kv_lora_rank and qk_pos_emb_head_dim: its tensor-parallel split cannot be told")
    if rows == sum(parts):
        return shape, [((0,) * len(shape), shape, 0, rows)] if t == 0 else []
    if all(p % tp == 0 for p in parts) and rows * tp == sum(parts):
        return _split(shape, t, tp, parts)
    raise CheckpointError(f"{where}: {name}: {rows} rows, neither all {sum(parts)} of its args' widths {parts} nor "
                          f"1/{tp} of each")


def _boxes(name: str, shape: tuple[int, ...], t: int, grid: dict[str, Any], where: str
           ) -> tuple[tuple[int, ...], list[Box]]:
    """The global shape of a tensor, and the boxes tensor rank `t`'s part fills (with the local rows
    each comes from)."""
    tp, rows = grid["tp"], shape[0] if shape else 0
    router = ROUTER.search(name)
    if router and grid["experts"] is not None and rows != grid["experts"]:
        raise CheckpointError(f"{where}: {name}: {rows} rows for the args' num_experts {grid['experts']}")
    if tp == 1:
        return shape, [((0,) * len(shape), shape, 0, rows)]
    if WHOLE.search(name) or not shape:
        return shape, [((0,) * len(shape), shape, 0, rows)] if t == 0 else []
    if any(name.endswith(k) for k in DOWN):
        return _down(name, shape, t, grid, where)
    adapter = ADAPTER.match(name)
    if adapter is not None and len(shape) == 2:
        return _adapter_boxes(adapter, shape, t, grid, where)
    if GLU.search(name) and grid["glu"]:
        if rows % 2:
            raise CheckpointError(f"{where}: {name}: SwiGLU's fc1 of {rows} rows cannot be [gate; up]")
        return _split(shape, t, tp, [rows // 2 * tp] * 2)
    if COLUMN.search(name) or GLU.search(name):
        return _split(shape, t, tp, [rows * tp])
    if ROW.search(name) and len(shape) == 2:
        return (rows, shape[1] * tp), [((0, t * shape[1]), shape, 0, rows)]
    raise CheckpointError(f"{where}: {name}: a tensor whose tensor-parallel split shardstore does not know; "
                          f"it cannot be merged exactly")


def _adapter_boxes(adapter: re.Match[str], shape: tuple[int, ...], t: int, grid: dict[str, Any], where: str
                   ) -> tuple[tuple[int, ...], list[Box]]:
    """A LoRA adapter's A or B, split as its base linear's input and output are (`ADAPTER`)."""
    base, rows = f"{adapter['base']}.weight", shape[0]
    column = bool(COLUMN.search(base) or GLU.search(base))
    if not column and not ROW.search(base):
        raise CheckpointError(f"{where}: {adapter[0]}: the adapter of a linear whose tensor-parallel split "
                              f"shardstore does not know; it cannot be merged exactly")
    if adapter["part"] == "in" and not column:  # A of a row-parallel linear: its input's columns
        return (rows, shape[1] * grid["tp"]), [((0, t * shape[1]), shape, 0, rows)]
    if adapter["part"] == "out" and GLU.search(base) and grid["glu"]:
        if rows % 2:
            raise CheckpointError(f"{where}: {adapter[0]}: SwiGLU's fc1 adapter of {rows} rows cannot be [gate; up]")
        return _split(shape, t, grid["tp"], [rows // 2 * grid["tp"]] * 2)
    return _split(shape, t, grid["tp"], [rows * grid["tp"]])


class _Entry(NamedTuple):
    """One model entry of a rank's file, placed: its global name (and tree place), local tensor or value,
    global shape, the boxes it fills, and whether its file is one the merged model takes it from (expert
    rank 0's for what every expert rank repeats; stage 0's for the embedding the last stage repeats; of
    those, tensor rank 0's for a value or a tensor whole on every rank)."""

    name: _Name
    value: Any
    shape: tuple[int, ...]
    boxes: list[Box]
    owner: bool


class _Read:
    """One rank's file read: its model (global names, tensors and values) and everything else."""

    def __init__(self, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder):
        self.path, self.name = path, _rank_name(path)
        self.optimizer = name_of(path) == DISTRIB  # its whole content: ranks/<rank>/distrib_optim/
        self.zip = TorchZip(path, storage_options)
        with closed_on_error(self.zip.close, path):
            self.zip.verify("data.pkl")
            obj = load(self.zip.record("data.pkl"), path, strict)
            self.chunks = [] if self.optimizer else _chunks(obj, path)
            self.args = obj.get("args") if isinstance(obj, dict) else None
            self.moment = _moment(obj, self.args) if not self.optimizer else None
            rest = obj if self.optimizer else {k: v for k, v in obj.items()
                                               if k not in (MODEL, ADAPTER_MODEL) and not CHUNK.match(str(k))}
            try:  # (veRL's adapter files hold nothing else)
                tree, leaves = flatten(rest, encode_key) if rest else (Node("dict", "", []), {})
            except RecursionError:
                raise CheckpointError(f"{path}: values nested too deeply, or containing themselves") from None
            under = paths.join(RANKS, paths.escape(self.name), *([DISTRIB_KEY] if self.optimizer else []))
            self.shape_of_rest = tree.to_json()
            self.rest = moved(tree, under)
            self.leaves = {paths.join(under, k): v for k, v in leaves.items()}

    def place(self, grid: dict[str, Any]) -> None:
        """Its model's entries placed by the grid, once: `entries`; `model_digest`, of their names, dtypes
        and shapes (what every tensor rank of a stage's expert rank shares); `dense_digest`, of those not
        routed experts' (what every expert rank of a tensor rank and stage shares); `digest`, of those and
        its other keys."""
        self.entries: list[_Entry] = []
        if not self.optimizer:
            self._place_model(grid)
        model = [(x.name.name, x.value.dtype, list(x.value.shape)) if isinstance(x.value, TensorRef)
                 else (x.name.name, type(x.value).__name__) for x in self.entries]
        self.model_digest = _digest(model)
        self.dense_digest = _digest([m for m, x in zip(model, self.entries) if x.name.group is None])
        self.digest = _digest((self.model_digest, self.shape_of_rest))

    def _place_model(self, grid: dict[str, Any]) -> None:
        self.t, self.p, self.e = _place_of(self.name, self.path, grid)
        if len(self.chunks) != grid["vp"]:
            raise CheckpointError(f"{self.path}: holds {len(self.chunks)} model chunks, its args "
                                  f"virtual_pipeline_model_parallel_size {grid['vp']}")
        experts: dict[str, set[int]] = {}
        last = grid["pp"] > 1 and self.p == grid["pp"] - 1
        for v, chunk in enumerate(self.chunks):
            for key, value in chunk.items():
                if not isinstance(key, str):
                    raise CheckpointError(f"{self.path}: model key {key!r:.40} is not a string")
                name = _global_name(key, (self.t, self.p, self.e, v), grid, self.path)
                if name.group is not None:
                    experts.setdefault(name.param, set()).add(name.expert)
                owner = (self.e == 0 or name.group is not None) and not (last and name.name == EMBEDDING)
                if isinstance(value, TensorRef):
                    check_view(self.zip, value, f"{self.path}: {key}")
                if isinstance(value, TensorRef) and not key.endswith(EXTRA):
                    shape, boxes = _boxes(name.name, tuple(value.shape), self.t, grid, self.path)
                    self.entries.append(_Entry(name, value, shape, boxes if owner else [], owner))
                else:
                    self.entries.append(_Entry(name, value, (), [], owner))
        self._all_experts(experts, grid)

    def _all_experts(self, experts: dict[str, set[int]], grid: dict[str, Any]) -> None:
        """Each routed-expert parameter of a layer, for every one of its rank's experts (num_experts / EP):
        a grouped GEMM's weights of another count, or a SequentialMLP missing an expert, would leave
        experts unplaced."""
        if grid["local"] is None:
            return
        want = set(range(self.e * grid["local"], (self.e + 1) * grid["local"]))
        for param, found in experts.items():
            if found != want:
                raise CheckpointError(f"{self.path}: {param}: holds experts {sorted(found)[:8]}, its expert rank's are "
                                      f"{min(want)}..{max(want)} (num_experts {grid['experts']} over {grid['ep']} "
                                      f"expert ranks)")


def _array(x: _Entry) -> bool:
    """An entry merged as an array (a tensor that is not a module's extra state)."""
    return isinstance(x.value, TensorRef) and not x.name.name.endswith(EXTRA)


def _chunks(obj: Any, path: str) -> list[dict[str, Any]]:
    """A rank file's model state dicts: `model`, or one per virtual pipeline chunk (`model0`, `model1`, ...)."""
    found = {int(m[1]): v for k, v in obj.items() if isinstance(k, str) and (m := CHUNK.match(k))} \
        if isinstance(obj, dict) else {}
    model = next((k for k in (MODEL, ADAPTER_MODEL) if isinstance(obj, dict) and k in obj), None)
    chunks = [obj[model]] if model is not None and not found else \
        [found[v] for v in range(len(found))] if set(found) == set(range(len(found))) else []
    if not chunks or not all(isinstance(c, dict) for c in chunks):
        raise CheckpointError(f"{path}: not a Megatron-LM checkpoint file (a dict with a `model` state dict, or "
                              f"`model0`, `model1`, ... one per virtual pipeline chunk)")
    return chunks


def _digest(value: Any) -> str:
    return hashlib.blake2b(repr(value).encode(), digest_size=16).hexdigest()


def _moment(obj: dict[str, Any], args: Any) -> dict[str, Any]:
    """The save's moment as a file records it (MOMENT, and ARGS_MOMENT from its args), where it is plain."""
    state = getattr(args, "state", None)
    state = state if isinstance(state, dict) else {}
    found = {k: obj.get(k) for k in MOMENT} | {f"args.{k}": state.get(k) for k in ARGS_MOMENT}
    return {k: v for k, v in found.items() if isinstance(v, (int, float, str, type(None)))}


def check_iteration(where: str, state: Any, folder: str) -> None:
    """The iteration a save records (in every rank's file here; in its common state under torch_dist,
    read/formats/dcp.py) against its folder's name, save_checkpoint's `iter_{iteration:07d}`."""
    check_step(where, "iteration", state.get("iteration") if isinstance(state, dict) else None, folder, megatron.STEPS.exact)


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
def _whole_grid(folder: str, files: list[_Read], grid: dict[str, Any]) -> None:
    """Every rank folder of the args' grid is there (a missing expert rank's too), refused up front."""
    have = {f.name for f in files}
    missing = [n for n in _names(grid) if n not in have]
    if missing:
        raise CheckpointError(f"{folder}: rank folders missing for the args' TP={grid['tp']} x PP={grid['pp']} x "
                              f"EP={grid['ep']} grid: {', '.join(missing[:8])}")


def _same_parts(files: list[_Read]) -> None:
    """A stage's tensor ranks hold the same names and shapes, and so do its expert ranks but for their
    experts: a file of another checkpoint (or another rank's) in a rank's place shows here."""
    models = {(f.t, f.p, f.e): f for f in files if not f.optimizer}
    for f in models.values():
        first = models[(0, f.p, f.e)]
        if f.model_digest != first.model_digest:
            raise CheckpointError(f"{f.path}: its keys or shapes differ from {first.path}'s, the same stage's "
                                  f"tensor rank 0 (a file of another checkpoint?)")
        first = models[(f.t, f.p, 0)]
        if f.dense_digest != first.dense_digest:
            raise CheckpointError(f"{f.path}: what is not a routed expert differs in its keys or shapes from "
                                  f"{first.path}'s, the same stage's expert rank 0 (a file of another checkpoint?)")


def spec(folder: str, unit_paths: list[str], encode_key: KeyEncoder, strict: bool,
         storage_options: StorageOptions | None, args: dict[str, Any] | None = None) -> CheckpointSpec:
    """Planned from every rank's file (their pickles, not their tensors): the grid from rank 0's args (or
    `args`, for files that keep none), each stage's names and shapes from its files, checked equal across
    a stage's tensor and expert ranks."""
    refuse_copies(unit_paths, storage_options, FILE)  # no two ranks' parts of a model are the same bytes
    files: list[_Read] = []
    try:
        for path in unit_paths:
            files.append(_Read(path, storage_options, strict, encode_key))
        grid = _grid(files[0].args if args is None else args, files[0].path)
        check_iteration(files[0].path, files[0].moment, folder)
        _whole_grid(folder, [f for f in files if not f.optimizer], grid)
        for f in files:
            _same_moment(f, files[0].moment or {}, files[0].path)
            f.place(grid)
        _same_parts(files)
        digests = [f.digest for f in files]
        arrays: dict[str, ShardedSpec] = {}
        shards: dict[str, list[ShardSpec]] = {}
        model: list[tuple[tuple[int, int, int, int], Any, Node]] = []
        placed: set[str] = set()  # the model's store paths
        blocks: dict[str, int] = {}  # a layer's routed experts: where the first of them is in the model
        objects: list[str] = []
        for i, f in enumerate(files):
            for x in f.entries:
                path = _model_path(x.name.name)
                if not x.owner:
                    _same_copy(f, x, arrays.get(path))
                    continue
                if f.t == 0:
                    if path in placed:
                        raise CheckpointError(f"{f.path}: {x.name.name} is also in an earlier stage's file")
                    placed.add(path)
                    block = blocks.setdefault(x.name.group, len(model)) if x.name.group else len(model)
                    model.append(((x.name.chunk, block, x.name.expert, len(model)), encode_key(x.name.name),
                                  Node("leaf", path)))
                if not _array(x):
                    if f.t == 0:
                        objects.append(path)
                    continue
                arrays[path] = ShardedSpec(x.value.dtype, x.shape, ())
                shards.setdefault(path, []).extend(ShardSpec(o, s, i) for o, s, _, _ in x.boxes)
            for path, value in f.leaves.items():
                if _big(value):
                    arrays[path] = ShardedSpec(value.dtype, tuple(value.shape),
                                               (ShardSpec((0,) * len(value.shape), tuple(value.shape), i),))
                else:
                    objects.append(path)
        for path, held in shards.items():
            arrays[path] = ShardedSpec(arrays[path].dtype, arrays[path].shape, tuple(held))
        ranks = Node("dict", RANKS, _per_rank(files, encode_key))
        ordered = [(k, n) for _, k, n in sorted(model, key=lambda m: m[0])]  # chunk by chunk, experts in order
        tree = Node("dict", "", [(encode_key(MODEL), Node("odict", MODEL, ordered)), (encode_key(RANKS), ranks)])
    finally:
        for f in files:
            f.zip.close()
    names = [relative(u) for u in unit_paths]
    facts = CheckpointFacts(units=tuple(names), metadata=_digest(digests),
                            reader={"megatron": {"grid": grid, "digests": digests, "moment": files[0].moment,
                                                 "first": names[0]}},
                            megatron_common=ranks.children[0][1].path if ranks.children else None)  # the first rank's
    return CheckpointSpec(FORMAT, len(names), len(names), tree, arrays, {}, objects, facts)


def _same_copy(f: _Read, x: _Entry, kept: ShardedSpec | None) -> None:
    """A repeated entry the model is taken from elsewhere (an expert rank's copy of what is not an
    expert, the last stage's embedding): it must be there, of the same dtype and shape."""
    if not _array(x):
        return
    if kept is None or (kept.dtype, kept.shape) != (x.value.dtype, x.shape):
        raise CheckpointError(f"{f.path}: {x.name.name} ({x.value.dtype} {list(x.shape)}) is a copy of what no "
                              f"earlier rank's file holds alike (a file of another checkpoint?)")


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
        for x in f.entries:
            if not _array(x):
                if f.t == 0 and x.owner:
                    unit.leaves[_model_path(x.name.name)] = x.value
                continue
            value, row = x.value, x.value.stride[0] if x.value.shape else 0
            pieces = [LocalPiece(o, s, TensorRef(value.storage, value.offset + lo * row, s, value.stride, value.dtype),
                                 f.zip) for o, s, lo, _ in x.boxes]
            unit.leaves[_model_path(x.name.name)] = ArrayLeaf(value.dtype, x.shape, pieces)
        for p, value in f.leaves.items():
            if _big(value):
                check_view(f.zip, value, f"{path}: {p}")
                unit.leaves[p] = ArrayLeaf(value.dtype, tuple(value.shape),
                                           [LocalPiece((0,) * len(value.shape), tuple(value.shape), value, f.zip)])
            else:
                unit.leaves[p] = value
    return unit
