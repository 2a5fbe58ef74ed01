"""DeepSpeed ZeRO checkpoints (`engine.save_checkpoint`, stages 1, 2 and 3), read without DeepSpeed.

A save folder (the HF Trainer's `checkpoint-N/`) holds `latest` (the newest tag) and `<tag>/`
(`global_stepN/`, trainers/deepspeed.py):
- ZeRO-1/2: `mp_rank_00_model_states.pt` (`module`: the model's 16-bit or fp32 weights and buffers;
  `param_shapes`: per optimizer group, `{name: shape}` in flattening order; `frozen_param_shapes` and
  `frozen_param_fragments` (whole); `shared_params`: `{tied name: name}`; the engine's counters, LR
  scheduler and config), and `[bf16_]zero_pp_rank_{d}_mp_rank_00_optim_states.pt` per data-parallel rank:
  `single_partition_of_fp32_groups` (this rank's part of each group's flat fp32 masters), the base
  optimizer's state over the same parts (`base_optimizer_state`), `group_paddings`,
  `param_alignment_paddings`, `partition_count`. A group's parameters are laid end to end (each followed
  by its alignment padding), padded at the end, and cut into `partition_count` equal parts; the last
  rank's masters are saved without the end padding (its `group_paddings`), its moments with it. Saved
  with `elastic_checkpoint`, `base_optimizer_state` is a list of each group's state, the moments cut as the
  masters are, without the groups' hyperparameters (a resuming engine keeps its own; the step DeepSpeed's
  own optimizers keep in them is `base_optimizer_state_step`).
  ZeRO-1 with bf16 weights and fp32 gradient accumulation (`data_types.grad_accum_dtype`, as Megatron-
  DeepSpeed runs) is DeepSpeed's BF16_Optimizer instead: the same files, but no `zero_stage` and no
  alignment paddings (parameters end to end), and every rank's masters saved with its end padding.
  DeepSpeed's own `zero_to_fp32` refuses these ("is not a zero checkpoint").
- ZeRO-3: per rank `zero_pp_rank_{r}_mp_rank_00_model_states.pt` (`module` of size-0 placeholders, this
  rank's `frozen_param_fragments`) and `..._optim_states.pt` (`fp32_flat_groups`, the base optimizer's
  state under `optimizer_state_dict`). Every parameter is partitioned on its own: `ceil(numel / W)`
  elements per rank, the last zero-padded, laid end to end per group in each rank's flat part.

- ZeRO-0 (DeepSpeed without ZeRO: `zero_optimization.stage` 0, as Accelerate and the HF Trainer run it):
  `mp_rank_00_model_states.pt` alone, holding everything whole. `module` is the model in the dtype the
  run computed in (fp32, or bf16/fp16 under mixed precision), names sharing one tensor tied; `optimizer`
  is the torch optimizer's state, or DeepSpeed's fp16/bf16 wrapper's around it with the fp32 masters in
  `fp32_groups`, by group and position: the file does not say which parameter each is (nor which group
  a parameter is in), so they are kept as saved, not guessed. DeepSpeed's own `zero_to_fp32` refuses
  these folders.

This is DeepSpeed's own `zero_to_fp32.py` rule, derived here from `param_shapes` and checked against
every file's own part lengths (a part of the wrong length, or a file of another run, is refused naming
it). The store's tree: `model` (the fp32 masters of trainable parameters, frozen parameters in their own
dtype, buffers, in the module's order; a tied name is not a tensor of its own but a fact,
`CheckpointFacts.tied`), `optim` (`{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups":
[{hyperparameters..., "params": [names]}]}`, as torch's optimizers key state, by name), and beside them the rest of
the model-states file (the engine's counters, LR scheduler, config, client state). DeepSpeed's own classes in these pickles
(`ZeroStageEnum`, `LossScaler`, `fragment_address`) are inert records; nothing of DeepSpeed is imported.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from ...facts import CheckpointFacts
from ... import paths
from ...errors import CheckpointError, closed_on_error
from ...hf_files import hf_model_file
from ...locations import StorageOptions, folder_of, join, listing, subfolders
from ...records import Building, TensorRef, building_class
from ...tree import KeyEncoder, Node
from ..contract import ArrayLeaf, CheckpointSpec, LocalPiece, ShardedSpec, replica_count
from ..primitives import tensors
from ..primitives.container import TorchZip
from ..primitives.flatten import flatten
from ..primitives.identity import refuse_copies
from ..primitives.unpickle import load
from ...trainers.deepspeed import STEPS
from ..source import check_step, inside_run, pointed
from ..unit import FileUnit, flat_spec, planned_place, relative
from . import fsdp_flat

FORMAT = "deepspeed"
MODEL_STATES = re.compile(r"(?:zero_pp_rank_(?P<rank>[0-9]+)_)?mp_rank_(?P<mp>[0-9]+)_model_states\.pt\Z")
LAYER_STATES = re.compile(r"layer_[0-9]+-model_[0-9]+-model_states\.pt\Z")  # pipeline parallelism's (PipelineModule)
OPTIM_STATES = re.compile(r"(?P<bf16>bf16_)?zero_pp_rank_(?P<rank>[0-9]+)_mp_rank_(?P<mp>[0-9]+)_optim_states\.pt\Z")
# DeepSpeed's classes its checkpoints pickle: inert records (strict mode included), never imported.
PLACEHOLDERS = {key: building_class(*key) for key in (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)}
# What the model-states file holds besides the engine's own state (kept beside `model` and `optim`).
LAYOUT_KEYS = ("module", "buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
               "shared_params", "optimizer")


# ---------------------------------------------------------------------------------------------- finding
def _zero_files(folder: str, storage_options: StorageOptions | None) -> bool:
    """Whether `folder` is a tag folder (ZeRO-0's model-states file is alone: the rest is refused naming
    what is missing)."""
    return any(MODEL_STATES.match(p.rsplit("/", 1)[-1]) for p in listing(folder, storage_options))


def _tag_folder(folder: str, storage_options: StorageOptions | None) -> str | None:
    """The tag folder `folder` is, or the save folder's one tag folder, which its `latest` names (the HF
    Trainer's checkpoint-N/ holds global_stepN/); None otherwise. A save folder of several tags is a run:
    its `latest` names the newest, `--tag` or `--step` another (read/source.py `pick`)."""
    if _zero_files(folder, storage_options):
        return folder
    tags = [n for n in subfolders(folder, storage_options) if _zero_files(join(folder, n), storage_options)]
    if len(tags) != 1 or (pointed(folder, tags, storage_options) or (None,))[0] != tags[0]:
        return None
    return inside_run(folder, join(folder, tags[0]))  # a tag folder linking to another run's is that run's


def detect(folder: str, storage_options: StorageOptions | None = None) -> bool:
    """A tag folder of ZeRO files, or a save folder (the HF Trainer's checkpoint-N/) whose `latest` names one."""
    return _tag_folder(folder, storage_options) is not None


def run_of(unit: str) -> str:
    return folder_of(unit)


def _files(tag: str, storage_options: StorageOptions | None) -> tuple[dict[int, str], dict[int, str]]:
    model: dict[int, str] = {}
    optim: dict[int, str] = {}
    for p in listing(tag, storage_options):
        name = p.rsplit("/", 1)[-1]
        if LAYER_STATES.match(name):
            raise CheckpointError(f"{p}: a pipeline-parallel checkpoint (its layers in layer_*-model_states.pt "
                                  f"files, as Megatron-DeepSpeed saves them); only data-parallel ZeRO "
                                  f"checkpoints are read")
        m, o = MODEL_STATES.match(name), OPTIM_STATES.match(name)
        for found, into in ((m, model), (o, optim)):
            if found is None:
                continue
            if int(found["mp"]) != 0:
                raise CheckpointError(f"{p}: a model-parallel rank's file (tensor or pipeline parallelism); only "
                                      f"data-parallel ZeRO checkpoints (mp_rank_00) are read")
            into[int(found["rank"] or 0)] = p
    return model, optim


def units(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """The model-states file(s), then every rank's optimizer file, in rank order; refused naming what is
    missing."""
    tag = _tag_folder(folder, storage_options)
    if tag is None:
        raise CheckpointError(f"{folder}: not a DeepSpeed checkpoint folder")
    model, optim = _files(tag, storage_options)
    world = max(optim) + 1 if optim else 0
    per_rank_models = len(model) > 1 or 0 not in model  # ZeRO-3's, else the one mp_rank_00 file
    for found, kind in ((optim, "optim"), (model if per_rank_models else {}, "model")):
        missing = [r for r in range(world) if r not in found] if found else []
        if missing:
            raise CheckpointError(f"{join(tag, f'zero_pp_rank_{missing[0]}_mp_rank_00_{kind}_states.pt')}: "
                                  f"missing (the checkpoint is incomplete)")
    return [model[r] for r in sorted(model)] + [optim[r] for r in range(world)]


def side_files(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """The model's Hugging Face files the HF Trainer puts beside the tag folder (config, generation config,
    tokenizer), which `--format hf` uses with no flag."""
    tag = _tag_folder(folder, storage_options)
    above = folder_of(tag) if tag is not None else folder
    return [p for p in listing(above, storage_options)
            if hf_model_file(p.rsplit("/", 1)[-1])]


def unit_kind(name: str) -> str:
    return "model-states files" if MODEL_STATES.match(name.rsplit("/", 1)[-1]) else "optimizer files"


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class _File:
    path: str
    zip: TorchZip
    state: Any


def _read(path: str, storage_options: StorageOptions | None, strict: bool) -> _File:
    zf = TorchZip(path, storage_options)
    with closed_on_error(zf.close, path):
        zf.verify("data.pkl")
        state = load(zf.record("data.pkl"), path, strict, PLACEHOLDERS)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: not a DeepSpeed checkpoint file (holds a {type(state).__name__})")
        # a model-states file records the engine's step: a file of another save copied into a tag folder
        # named by its step is refused (a tag named otherwise says nothing; optimizer files record none)
        check_step(path, "global_steps", state.get("global_steps"), folder_of(path), STEPS.exact)
        return _File(path, zf, state)


def _get(d: Any, key: str, where: str, kind: type | tuple[type, ...] = object) -> Any:
    if not isinstance(d, dict) or key not in d or not isinstance(d[key], kind):
        raise CheckpointError(f"{where}: no {key!r} of the expected kind (not a DeepSpeed ZeRO checkpoint file?)")
    return d[key]


def _count(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise CheckpointError(f"{where}: {value!r:.40} is not a count (corrupt file)")
    return value


@dataclass(frozen=True)
class Layout:
    """What the model-states file and rank 0's optimizer file say of the whole checkpoint."""

    stage: int
    world: int
    groups: list[list[tuple[str, tuple[int, ...]]]]  # per optimizer group, its parameters in order
    frozen: dict[str, tuple[int, ...]]
    shared: dict[str, str]  # tied name -> the name it is
    paddings: list[list[int]]  # ZeRO-1/2: each parameter's alignment padding after it
    parts: list[int]  # per group: each rank's part length (ZeRO-1/2, padding included; ZeRO-3: ignored)
    padded_masters: bool = False  # BF16_Optimizer: the last rank's fp32 part is saved with its end padding
    elastic: bool = False  # ZeRO-1/2 `elastic_checkpoint`: the moments saved as the fp32 parts are, unpadded

    def members(self, g: int) -> list[fsdp_flat.Member]:
        """ZeRO-1/2: group g's parameters where they lie in the group's flat vector."""
        out, start = [], 0
        for (name, shape), pad in zip(self.groups[g], self.paddings[g]):
            out.append(fsdp_flat.Member(name, shape, start, name))
            start += math.prod(shape) + pad
        return out

    def end(self, g: int) -> int:
        return sum(math.prod(s) + p for (_, s), p in zip(self.groups[g], self.paddings[g]))

    def z3_share(self, numel: int, rank: int) -> tuple[int, int]:
        """ZeRO-3: (first element, count) of a parameter's `numel` that `rank` holds: `ceil(numel / W)` per
        rank, the last ones short or empty (their parts zero-padded)."""
        per = -(-numel // self.world)
        return rank * per, max(0, min(per, numel - rank * per))

    def z3_offsets(self, g: int) -> list[tuple[str, tuple[int, ...], int, int]]:
        """ZeRO-3: (name, shape, offset in each rank's flat part, elements per rank) of group g's parameters."""
        out, offset = [], 0
        for name, shape in self.groups[g]:
            per = -(-math.prod(shape) // self.world)
            out.append((name, shape, offset, per))
            offset += per
        return out

    def digest(self) -> str:
        return hashlib.blake2b(repr((self.stage, self.world, self.groups, self.frozen, self.shared, self.paddings,
                                     self.parts, self.padded_masters, self.elastic)).encode(),
                              digest_size=16).hexdigest()

    def facts(self) -> dict[str, Any]:
        """The layout as the store keeps it for the workers (`from_facts` reads it back)."""
        return {"stage": self.stage, "world": self.world, "groups": [[[n, list(s)] for n, s in g] for g in self.groups],
                "frozen": {n: list(s) for n, s in self.frozen.items()}, "paddings": self.paddings,
                "parts": self.parts, "shared": self.shared, "padded_masters": self.padded_masters,
                "elastic": self.elastic}

    @classmethod
    def from_facts(cls, ds: dict[str, Any]) -> "Layout":
        return cls(ds["stage"], ds["world"], [[(n, tuple(s)) for n, s in g] for g in ds["groups"]],
                   {n: tuple(s) for n, s in ds["frozen"].items()}, ds["shared"], ds["paddings"], ds["parts"],
                   ds.get("padded_masters", False), ds.get("elastic", False))


def _shapes(value: Any, where: str) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: param_shapes that are not {{name: shape}} (corrupt file)")
    out = []
    for name, shape in value.items():
        if not isinstance(name, str) or not isinstance(shape, (tuple, list)) \
                or not all(type(n) is int and n >= 0 for n in shape):
            raise CheckpointError(f"{where}: a parameter shape {name!r:.60}: {shape!r:.40} (corrupt file)")
        out.append((name, tuple(shape)))
    return out


def _bf16_optimizer(optim: dict[str, Any]) -> bool:
    """BF16_Optimizer's state (ZeRO-1, bf16 with fp32 gradient accumulation): ZeRO-1's keys but no stage."""
    return "zero_stage" not in optim and all(k in optim for k in ("single_partition_of_fp32_groups",
                                                                      "base_optimizer_state", "group_paddings"))


def _stage(optim: dict[str, Any], where: str) -> int:
    if _bf16_optimizer(optim):
        return 1
    stage = _get(optim, "zero_stage", where)
    value = stage.args[0] if isinstance(stage, Building) and stage.args else stage
    if type(value) is not int or value not in (1, 2, 3):
        raise CheckpointError(f"{where}: ZeRO stage {value!r:.20}; stages 1, 2 and 3 are read")
    return value


def _world(optim: dict[str, Any], where: str) -> int:
    count = _get(optim, "partition_count", where)
    counts = count if isinstance(count, list) else [count]
    if not counts or len(set(counts)) != 1:
        raise CheckpointError(f"{where}: groups partitioned over {counts!r:.60} ranks (expert parallelism); one "
                              f"data-parallel size is read")
    return _count(counts[0], where)


def _layout(model: _File, optim: _File) -> Layout:
    ms, od = model.state, _get(optim.state, "optimizer_state_dict", optim.path, dict)
    stage, world = _stage(od, optim.path), _world(od, optim.path)
    groups = [_shapes(g, model.path) for g in _get(ms, "param_shapes", model.path, list)]
    frozen = dict(_shapes(ms.get("frozen_param_shapes") or {}, model.path))
    shared = ms.get("shared_params") or {}
    if not isinstance(shared, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in shared.items()):
        raise CheckpointError(f"{model.path}: shared_params that are not {{name: name}} (corrupt file)")
    if stage < 3:
        pads = od.get("param_alignment_paddings") or [[0] * len(g) for g in groups]
        if not isinstance(pads, list) or len(pads) != len(groups) or \
                any(not isinstance(p, list) or len(p) != len(g) for p, g in zip(pads, groups)):
            raise CheckpointError(f"{optim.path}: param_alignment_paddings that do not match param_shapes")
        paddings = [[_count(x, optim.path) for x in p] for p in pads]
        fp32 = _get(od, "single_partition_of_fp32_groups", optim.path, list)
        own = _get(od, "group_paddings", optim.path, list)
        if len(fp32) != len(groups) or len(own) != len(groups):
            raise CheckpointError(f"{optim.path}: {len(fp32)} fp32 groups for {len(groups)} groups of parameters")
        padded = _bf16_optimizer(od)
        parts = [_part(t, optim.path) + (0 if padded else _count(p, optim.path)) for t, p in zip(fp32, own)]
    else:
        paddings, parts, padded = [[0] * len(g) for g in groups], [0] * len(groups), False
    return Layout(stage, world, groups, frozen, shared, paddings, parts, padded, _elastic(od))


def _flat_order(layout: Layout, module: dict[str, Any], mappings_of: Callable[[int], Any]) -> Layout:
    """ZeRO-1/2's groups in the order their parameters lie in the flat vectors. That is param_shapes' order,
    but under `round_robin_gradients` DeepSpeed (0.19 at least) saves param_shapes in its round-robin order
    while the flat vectors keep the module's; its own zero_to_fp32 trusts param_shapes and rebuilds such a
    checkpoint wrong. The files' `param_slice_mappings` say which: ranks' mappings (`mappings_of(rank)`)
    are read until one order alone agrees with them. Every rank's file is checked against the order
    chosen when it is ingested."""
    position = {name: i for i, name in enumerate(module)}
    by_module = [sorted(g, key=lambda p: position.get(p[0], len(position))) for g in layout.groups]
    candidates = [layout, replace(layout, groups=by_module)] if by_module != layout.groups else [layout]
    for rank in range(layout.world if len(candidates) > 1 else 0):
        mappings = mappings_of(rank)
        if not isinstance(mappings, list) or len(mappings) != len(layout.groups):
            return layout  # no mappings to tell: param_shapes' order, as zero_to_fp32 reads it
        candidates = [c for c in candidates if all(_mapping_holds(mappings[g], c, g, rank)
                                                   for g in range(len(c.groups)))]
        if len(candidates) <= 1:
            break
    return candidates[0] if candidates else layout


def _part(t: Any, where: str) -> int:
    if not isinstance(t, TensorRef) or len(t.shape) != 1:
        raise CheckpointError(f"{where}: a flat part that is not a 1-D tensor (corrupt file)")
    return t.shape[0]


# ---------------------------------------------------------------------------------------------- spec
def _rank(path: str) -> tuple[str, int]:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    m, o = MODEL_STATES.match(name), OPTIM_STATES.match(name)
    if o is not None:
        return "optim", int(o["rank"])
    if m is not None:
        return "model", int(m["rank"] or 0)
    raise CheckpointError(f"{path}: not a DeepSpeed ZeRO checkpoint file")


def _train_tree(model: _File, encode_key: KeyEncoder) -> tuple[Node, dict[str, Any]]:
    rest = {k: v for k, v in model.state.items() if k not in LAYOUT_KEYS and k not in ("model", "optim")}
    return flatten(rest, encode_key)


def _model_names(layout: Layout, ms: dict[str, Any], where: str) -> list[str]:
    """Every tensor of the model, in the module's order (its state dict's), tied names left out: trainable
    and frozen parameters, buffers, and under ZeRO-1 frozen weights `module` alone keeps."""
    module = _get(ms, "module", where, dict)
    known = {n for g in layout.groups for n, _ in g} | set(layout.frozen)
    return [n for n in module if n not in layout.shared] + [n for n in known if n not in module]


def _whole(layout: Layout, name: str, ms: dict[str, Any], where: str) -> Any:
    """What the model-states file holds whole for a name no optimizer part holds (a buffer, a frozen
    parameter but ZeRO-3's): a tensor, or a value kept as it is."""
    fragments = ms.get("frozen_param_fragments") or {}
    ref = fragments.get(name) if name in fragments else ms["module"].get(name)
    if not isinstance(ref, TensorRef):
        if name in ms["module"]:
            return ms["module"][name]  # a value, kept as it is
        raise CheckpointError(f"{where}: parameter {name} is in no optimizer group and not in the module")
    if layout.stage == 3 and not math.prod(ref.shape) and ref.shape != ():
        raise CheckpointError(f"{where}: {name} is a ZeRO-3 placeholder, but in no optimizer group and not frozen")
    frozen = layout.frozen.get(name) if name in fragments else None
    if frozen is not None and tuple(ref.shape) != tuple(frozen):  # ZeRO-1/2 keep a frozen parameter whole
        raise CheckpointError(f"{where}: frozen parameter {name} is {list(ref.shape)} in frozen_param_fragments but "
                              f"{list(frozen)} in frozen_param_shapes (damaged or forged)")
    return ref


def _elastic(od: dict[str, Any]) -> bool:
    """ZeRO-1/2 saved with `elastic_checkpoint`: the base optimizer's state is a list, one dict a group."""
    return isinstance(od.get("base_optimizer_state"), list)


def _optim_state(od: dict[str, Any], stage: int, where: str) -> dict[str, Any]:
    """The base optimizer's state over the flat parts as torch's state dict has it: `state` by group,
    `param_groups`. An elastic save (`_elastic`) keeps each group's state alone, its moments cut as the
    fp32 parts are; the step DeepSpeed's own optimizers keep in their groups is `base_optimizer_state_step`,
    and no hyperparameters are saved (a resuming engine keeps its own): its groups hold that step or
    nothing."""
    base = od.get("base_optimizer_state" if stage < 3 else "optimizer_state_dict")
    if stage < 3 and isinstance(base, list) and all(isinstance(g, dict) for g in base):
        step = {"step": od["base_optimizer_state_step"]} if "base_optimizer_state_step" in od else {}
        return {"state": dict(enumerate(base)), "param_groups": [dict(step) for _ in base]}
    if not isinstance(base, dict) or not isinstance(base.get("state"), dict) or \
            not isinstance(base.get("param_groups"), list):
        raise CheckpointError(f"{where}: no torch optimizer state over its flat parts (an already-stripped "
                              f"checkpoint?); not read")
    return base


def spec(folder: str, unit_paths: list[str], encode_key: KeyEncoder, strict: bool,
         storage_options: StorageOptions | None) -> CheckpointSpec:
    """Planned from the (rank 0) model-states file and rank 0's optimizer file: with `param_shapes` and
    the partition rule they place every rank's part."""
    models = [u for u in unit_paths if _rank(u)[0] == "model"]
    optims = [u for u in unit_paths if _rank(u)[0] == "optim"]
    model, optim = _read(models[0], storage_options, strict), None
    if not optims:
        return _unpartitioned_spec(model, unit_paths, encode_key)
    try:
        optim = _read(optims[0], storage_options, strict)
        layout = _layout(model, optim)
        if layout.stage < 3:
            layout = _flat_order(layout, _get(model.state, "module", model.path, dict),
                                 lambda r: _mappings(optim if r == 0 else None, optims[r], storage_options, strict))
        if len(optims) != layout.world:
            raise CheckpointError(f"{optims[0]}: partitioned over {layout.world} ranks, but the folder holds "
                                  f"{len(optims)} optimizer files")
        if layout.stage == 3 and len(models) != layout.world:
            raise CheckpointError(f"{models[0]}: ZeRO-3 keeps a model-states file per rank; {len(models)} of "
                                  f"{layout.world} are there")
        if layout.stage == 3:  # ZeRO-1/2 files are told apart by their own slice mappings (_check_mapping)
            refuse_copies(optims, storage_options, "optimizer file")
        od = optim.state["optimizer_state_dict"]
        base = _optim_state(od, layout.stage, optim.path)
        arrays: dict[str, ShardedSpec] = {}
        objects: list[str] = []
        leaves: dict[str, str] = {}
        m0, o0 = 0, len(models)  # unit indices of the first model-states and optimizer files
        trainable = {m.name: (g, m) for g in range(len(layout.groups)) for m in layout.members(g)}
        fp32_dtype = _fp32_dtype(od, layout.stage, optim.path)
        names = _model_names(layout, model.state, model.path)
        for name in names:
            path = leaves[name] = f"model/{encode_key(name)}"
            if name in trainable:
                g, member = trainable[name]
                arrays[path] = flat_spec(fp32_dtype, member.shape, _ranges(layout, member, g, o0))
            elif layout.stage == 3 and name in layout.frozen:
                arrays[path] = _z3_frozen_spec(layout, name, model, m0)
            else:
                ref = _whole(layout, name, model.state, model.path)
                whole = _whole_spec(ref, m0)
                if whole is not None:
                    arrays[path] = whole
                else:
                    objects.append(path)
        state_nodes = []
        for name in [n for n in names if n in trainable]:
            g, member = trainable[name]
            children = []
            moments = _expected_part(layout, g, 0, od, optim.path)[1]  # rank 0's length of them
            for key, value in base["state"].get(g, {}).items():
                path = f"optim/state/{encode_key(name)}/{encode_key(key)}"
                if isinstance(value, TensorRef) and value.shape == (moments,):
                    arrays[path] = flat_spec(value.dtype, member.shape, _ranges(layout, member, g, o0))
                else:
                    objects.append(path)
                children.append((key, Node("leaf", path)))
            state_nodes.append((name, Node("dict", f"optim/state/{encode_key(name)}", children)))
        objects.append("optim/param_groups")
        train_tree, _ = _train_tree(model, encode_key)
        objects += train_tree.leaf_paths()
        model_node = Node("dict", "model", [(n, Node("leaf", leaves[n])) for n in names])
        optim_node = Node("dict", "optim", [("state", Node("dict", "optim/state", state_nodes)),
                                             ("param_groups", Node("leaf", "optim/param_groups"))])
        tree = Node("dict", "", [("model", model_node), ("optim", optim_node)] + train_tree.children)
    finally:
        model.zip.close()
        if optim is not None:
            optim.zip.close()
    listed = [relative(u) for u in unit_paths]
    facts = CheckpointFacts(units=tuple(listed), metadata=layout.digest(), replicas=replica_count(arrays),
                            tied=tuple((("model", a), f"model/{encode_key(b)}") for a, b in layout.shared.items()
                                       if b in names), reader={"deepspeed": layout.facts()})
    return CheckpointSpec(FORMAT, len(listed), len(listed), tree, arrays, {}, objects, facts)


def _unpartitioned(f: _File, encode_key: KeyEncoder) -> tuple[Node, dict[str, Any], dict[str, str]]:
    """ZeRO-0's file: (tree, leaves by path, {tied name: name}). `module` becomes `model` (a name viewing
    the same tensor as an earlier one is tied to it, not a tensor of its own), `optimizer` becomes `optim`
    as saved, and the engine's state sits beside them."""
    ms = f.state
    if ms.get("param_shapes") is not None:
        raise CheckpointError(f"{f.path}: a ZeRO checkpoint, but its optimizer files (*zero_pp_rank_*_optim_"
                              f"states.pt) are missing")
    first: dict[tuple[Any, ...], str] = {}
    tied: dict[str, str] = {}
    model: dict[str, Any] = {}
    for name, value in _get(ms, "module", f.path, dict).items():
        if isinstance(value, TensorRef) and value.shape:
            same = (value.storage.key, value.offset, tuple(value.shape), tuple(value.stride), value.dtype)
            if same in first:
                tied[name] = first[same]
                continue
            first[same] = name
        model[name] = value
    state = {"model": model, **({"optim": ms["optimizer"]} if ms.get("optimizer") is not None else {}),
             **{k: v for k, v in ms.items() if k not in LAYOUT_KEYS and k not in ("model", "optim")}}
    tree, leaves = flatten(state, encode_key)
    return tree, leaves, tied


def _unpartitioned_spec(model: _File, unit_paths: list[str], encode_key: KeyEncoder) -> CheckpointSpec:
    """ZeRO-0: one file, every tensor whole in it."""
    try:
        tree, leaves, tied = _unpartitioned(model, encode_key)
    finally:
        model.zip.close()
    arrays = {path: whole for path, ref in leaves.items() if (whole := _whole_spec(ref, 0)) is not None}
    layout = Layout(0, 1, [], {}, tied, [], [])
    facts = CheckpointFacts(units=tuple(relative(u) for u in unit_paths), metadata=layout.digest(),
                            replicas=replica_count(arrays), reader={"deepspeed": layout.facts()},
                            tied=tuple((("model", a), paths.join("model", paths.escape(b))) for a, b in tied.items()))
    objects = [p for p in leaves if p not in arrays]
    return CheckpointSpec(FORMAT, 1, 1, tree, arrays, {}, objects, facts)


def _mappings(opened: _File | None, path: str, storage_options: StorageOptions | None, strict: bool) -> Any:
    """An optimizer file's `param_slice_mappings` (its pickle read, if not open already)."""
    f = opened if opened is not None else _read(path, storage_options, strict)
    try:
        return _get(f.state, "optimizer_state_dict", f.path, dict).get("param_slice_mappings")
    finally:
        if opened is None:
            f.zip.close()


def _fp32_dtype(od: dict[str, Any], stage: int, where: str) -> str:
    groups = _get(od, "single_partition_of_fp32_groups" if stage < 3 else "fp32_flat_groups", where, list)
    kinds = {t.dtype for t in groups if isinstance(t, TensorRef)}
    if len(kinds) != 1:
        raise CheckpointError(f"{where}: fp32 groups of dtypes {sorted(kinds)} (corrupt file)")
    return kinds.pop()


def _ranges(layout: Layout, member: fsdp_flat.Member, g: int, base: int) -> list[tuple[int, int, int]]:
    """(unit, first element, count) of each rank's part of parameter `member` (group g); only the ranks
    whose parts it overlaps are looked at."""
    if layout.stage == 3:
        return [(base + r, *share) for r in range(layout.world) if (share := layout.z3_share(member.numel, r))[1]]
    part = layout.parts[g]
    if not part or not member.numel:
        return []
    first, last = member.start // part, (member.start + member.numel - 1) // part
    return [(base + r, lo, n) for r in range(first, min(last, layout.world - 1) + 1)
            for _, lo, n in fsdp_flat.overlaps([member], r * part, part)]


def _z3_frozen_spec(layout: Layout, name: str, model: _File, base: int) -> ShardedSpec:
    """A frozen parameter under ZeRO-3: `ceil(numel / W)` elements in each rank's model-states file."""
    shape = layout.frozen[name]
    ref = (model.state.get("frozen_param_fragments") or {}).get(name)
    if not isinstance(ref, TensorRef):
        raise CheckpointError(f"{model.path}: frozen parameter {name} has no fragment")
    return flat_spec(ref.dtype, shape, [(base + r, *share) for r in range(layout.world)
                                        if (share := layout.z3_share(math.prod(shape), r))[1]])


# ---------------------------------------------------------------------------------------------- units
def open_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
              facts: dict[str, Any]) -> FileUnit:
    """One file, checked against the plan: its stage, world and part lengths are the plan's, then each of
    its parts is cut at the parameters' edges."""
    index, count = planned_place(relative(path), path, facts, "deepspeed", "DeepSpeed")
    layout = Layout.from_facts(facts["deepspeed"])
    kind, rank = _rank(path)
    f = _read(path, storage_options, strict)
    unit = FileUnit(path, index, count, index, count, facts["metadata"], {}, f.zip)
    with closed_on_error(unit.close, path):
        if layout.stage == 0:
            _, leaves, _ = _unpartitioned(f, encode_key)
            unit.leaves.update({p: _held_whole(f, v, p) for p, v in leaves.items()})
        elif kind == "model":
            _model_unit(unit, f, layout, rank, encode_key)
        else:
            _optim_unit(unit, f, layout, rank, encode_key)
    return unit


def _model_unit(unit: FileUnit, f: _File, layout: Layout, rank: int, encode_key: KeyEncoder) -> None:
    """Rank 0's model-states file: the tensors it holds whole and the engine's state; under ZeRO-3 every
    rank's also its frozen parameters' fragments."""
    ms = f.state
    groups = [dict(_shapes(g, f.path)) for g in _get(ms, "param_shapes", f.path, list)]
    if groups != [dict(g) for g in layout.groups] or \
            dict(_shapes(ms.get("frozen_param_shapes") or {}, f.path)) != layout.frozen:
        raise CheckpointError(f"{f.path}: its parameters differ from the checkpoint the store was planned from "
                              f"(a file of another run?)")
    trainable = {n for g in layout.groups for n, _ in g}
    for name in _model_names(layout, ms, f.path):
        place = f"model/{encode_key(name)}"
        if name in trainable:
            continue
        if layout.stage == 3 and name in layout.frozen:
            unit.leaves[place] = _z3_fragment(f, layout, name, rank, place)
        elif rank == 0:
            unit.leaves[place] = _held_whole(f, _whole(layout, name, ms, f.path), place)
    # Every model-states file's engine state (ZeRO-3 keeps one per rank): the export takes rank 0's, and
    # the others' global_steps, ds_version and scheduler state prove the files are of one save (onesave).
    _, values = _train_tree(f, encode_key)
    unit.leaves.update(values)


def _z3_fragment(f: _File, layout: Layout, name: str, rank: int, place: str) -> ArrayLeaf:
    shape = layout.frozen[name]
    ref = (f.state.get("frozen_param_fragments") or {}).get(name)
    per = -(-math.prod(shape) // layout.world)
    if not isinstance(ref, TensorRef) or tuple(ref.shape) != (per,):
        raise CheckpointError(f"{f.path}: frozen fragment {name} is not the {per} elements each of "
                              f"{layout.world} ranks holds")
    first, n = layout.z3_share(math.prod(shape), rank)
    if not n:
        return ArrayLeaf(ref.dtype, shape, [])
    view = TensorRef(ref.storage, ref.offset, (n,), (1,), ref.dtype)
    tensors.check_view(f.zip, view, place)
    return ArrayLeaf(ref.dtype, shape, [LocalPiece((first,), (n,), view, f.zip)])


def _whole_spec(value: Any, unit: int) -> ShardedSpec | None:
    """A tensor one file holds whole (`unit`), as a flat array; None for a value (a 0-d tensor included),
    which the store keeps as it is. `_held_whole` is what that file's unit holds of it."""
    if not isinstance(value, TensorRef) or not value.shape:
        return None
    return flat_spec(value.dtype, tuple(value.shape), [(unit, 0, math.prod(value.shape))])


def _held_whole(f: _File, value: Any, place: str) -> Any:
    """What the file holds of a value `_whole_spec` planned: a tensor as the one piece of its flat array
    (its elements, one contiguous run), anything else as it is."""
    if not isinstance(value, TensorRef) or not value.shape:
        return value
    if tensors.byte_range(f.zip, value) is None:
        raise CheckpointError(f"{f.path}: {place} is not contiguous in its storage; not read")
    numel = math.prod(value.shape)
    flat = TensorRef(value.storage, value.offset, (numel,), (1,), value.dtype)
    tensors.check_view(f.zip, flat, place)
    return ArrayLeaf(value.dtype, tuple(value.shape), [LocalPiece((0,), (numel,), flat, f.zip)])


def _optim_unit(unit: FileUnit, f: _File, layout: Layout, rank: int, encode_key: KeyEncoder) -> None:
    od = _get(f.state, "optimizer_state_dict", f.path, dict)
    mine = (_stage(od, f.path), _world(od, f.path), _bf16_optimizer(od), _elastic(od))
    if mine != (layout.stage, layout.world, layout.padded_masters, layout.elastic):
        kind = [f"ZeRO-{stage}{' (BF16_Optimizer)' if bf16 else ''}{' (elastic)' if elastic else ''} over {world} "
                f"ranks" for stage, world, bf16, elastic in
                (mine, (layout.stage, layout.world, layout.padded_masters, layout.elastic))]
        raise CheckpointError(f"{f.path}: {kind[0]}, but the store holds {kind[1]}")
    if not 0 <= rank < layout.world:
        raise CheckpointError(f"{f.path}: rank {rank} outside the {layout.world} the checkpoint has")
    base = _optim_state(od, layout.stage, f.path)
    fp32 = _get(od, "single_partition_of_fp32_groups" if layout.stage < 3 else "fp32_flat_groups", f.path, list)
    if len(fp32) != len(layout.groups):
        raise CheckpointError(f"{f.path}: {len(fp32)} fp32 groups, the checkpoint {len(layout.groups)}")
    mappings = od.get("param_slice_mappings")
    for g, part in enumerate(fp32):
        have = _part(part, f.path)
        want, keep = _expected_part(layout, g, rank, od, f.path)
        if layout.stage < 3 and isinstance(mappings, list) and len(mappings) == len(fp32):
            _check_mapping(f.path, mappings[g], layout, g, rank)
        if have != want:
            raise CheckpointError(f"{f.path}: group {g}'s fp32 part holds {have} elements, not the {want} this "
                                  f"rank's share of the plan is (a file of another run, or damaged)")
        _cut(unit, f, layout, g, rank, part, have, lambda n: f"model/{encode_key(n)}")
        state = base["state"].get(g, {})
        for key, value in state.items():
            # a moment; anything else is a value (so a moment of another length is refused by the
            # ingest's check against the plan, which has an array there)
            if isinstance(value, TensorRef) and tuple(value.shape) == (keep,):
                _cut(unit, f, layout, g, rank, value, keep, lambda n, k=key: f"optim/state/{encode_key(n)}/{encode_key(k)}")
            else:
                for name, _ in layout.groups[g]:
                    unit.leaves[f"optim/state/{encode_key(name)}/{encode_key(key)}"] = value
    # every rank's, compared across the save's files (onesave); the export takes rank 0's
    groups = base["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(layout.groups) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{f.path}: param_groups that do not match param_shapes (corrupt file)")
    unit.leaves["optim/param_groups"] = [{**{k: v for k, v in g.items() if k != "params"},
                                          "params": [n for n, _ in layout.groups[i]]} for i, g in enumerate(groups)]


def _mapping_holds(saved: Any, layout: Layout, g: int, rank: int) -> bool:
    """Whether a ZeRO-1/2 file's own `param_slice_mappings` of group g (which parameters its part holds,
    where) are what the layout gives rank `rank`'s part."""
    part = layout.parts[g]
    want = {m.name: (m.start + lo - rank * part, n) for m, lo, n in fsdp_flat.overlaps(layout.members(g), rank * part, part)}
    got = {}
    for name, address in (saved.items() if isinstance(saved, dict) else ()):
        fields = getattr(address, "state", None)
        if isinstance(fields, dict):
            got[name] = (fields.get("start"), fields.get("numel"))
    return got == want


def _check_mapping(where: str, saved: Any, layout: Layout, g: int, rank: int) -> None:
    """A rank's file copied over another's holds the same lengths, but not its slices."""
    if not _mapping_holds(saved, layout, g, rank):
        raise CheckpointError(f"{where}: holds the slices of other parameters than rank {rank}'s part of group {g} "
                              f"(a file of another rank or run)")


def _expected_part(layout: Layout, g: int, rank: int, od: dict[str, Any], where: str) -> tuple[int, int]:
    """(the fp32 part's length, the moments' length) this rank's file must hold of group g: the moments
    padded as the optimizer holds them, but in an elastic save cut as the fp32 part is."""
    if layout.stage == 3:
        n = sum(per for _, _, _, per in layout.z3_offsets(g))
        return n, n
    part = layout.parts[g]
    pad = max(0, min(part, (rank + 1) * part - layout.end(g)))  # the end padding this rank's part holds
    own = _get(od, "group_paddings", where, list)
    if len(own) != len(layout.groups) or own[g] != pad:
        raise CheckpointError(f"{where}: group {g}'s padding is {own[g] if g < len(own) else None}, not the {pad} "
                              f"its rank's share of the plan has")
    fp32 = part if layout.padded_masters else part - pad
    return fp32, fp32 if layout.elastic else part


def _cut(unit: FileUnit, f: _File, layout: Layout, g: int, rank: int, flat: TensorRef, length: int,
         place: Any) -> None:
    """This rank's flat part of group g cut at its parameters' edges, one piece each it holds."""
    if tuple(flat.stride) != (1,):
        raise CheckpointError(f"{f.path}: a flat part that is not contiguous (corrupt file)")
    if layout.stage == 3:
        pieces = [(name, shape, offset, *layout.z3_share(math.prod(shape), rank))
                  for name, shape, offset, _ in layout.z3_offsets(g)]
    else:
        part = layout.parts[g]
        pieces = [(m.name, m.shape, m.start + lo - rank * part, lo, n)
                  for m, lo, n in fsdp_flat.overlaps(layout.members(g), rank * part, min(part, length))]
        held = {p[0] for p in pieces}
        pieces += [(n, s, 0, 0, 0) for n, s in layout.groups[g] if n not in held]
    for name, shape, at, first, n in pieces:
        path = place(name)
        if n <= 0:
            unit.leaves[path] = ArrayLeaf(flat.dtype, shape, [])
            continue
        view = TensorRef(flat.storage, flat.offset + at, (n,), (1,), flat.dtype)
        tensors.check_view(f.zip, view, path)
        unit.leaves[path] = ArrayLeaf(flat.dtype, shape, [LocalPiece((first,), (n,), view, f.zip)])
