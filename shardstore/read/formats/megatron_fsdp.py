"""Megatron-FSDP's checkpoints (Megatron-LM's `--ckpt-format fsdp_dtensor`): a plain DCP folder
(`iter_{N:07d}/.metadata` + `__{rank}_0.distcp`, no metadata.json) of the state dict Megatron-LM's
`preprocess_fsdp_dtensor_state_dict` makes of Megatron-FSDP's own. What is Megatron's in it:

- the model's tensors are `model.` and the wrappers' names (`module.` of Megatron-FSDP, of Float16Module)
  before Megatron's (`model.module.decoder.layers.{i}.…`), one key per layer;
- SwiGLU's fc1 (dense, shared expert, each routed expert; weight and bias) is split into its gate
  `…linear_fc1.weight_w` and its up `…linear_fc1.weight_v`, each a DTensor of its own;
- routed experts carry their global index (`local_experts.{e}.…`, or Transformer Engine's grouped
  `experts.linear_fc1.weight{e}`), one 2-D tensor per expert;
- every tensor's chunks are whole rows, uneven across the data-parallel ranks, some ranks' empty (not
  written): ordinary DCP boxes, which the plan's tiling check proves;
- the optimizer's state is `optimizer.state.<the parameter's wrapped name>.<exp_avg|exp_avg_sq|step>`,
  split and renamed as the model's; Megatron-LM's `args` (a Namespace) and `iteration` are top-level values.

The tensors are named as the torch_dist reading names Megatron's (read/formats/dcp.py), so that one export
serves both: `decoder.layers.{i}.mlp.linear_fc1.weight` is the gate's rows then the up's (torch_dist's
global fc1), experts are `mlp.experts.local_experts.{e}.…`, a parameter's state is
`optimizer.state.{kind}.{its name}`. Only names and chunk offsets change; every byte is read where it is.
A state of no elements (Adam's `step`) of a split parameter keeps its `_w`/`_v` name: two values cannot be
one. The args refuse by name what these names cannot place: layers of several pipeline stages (each
stage numbers its own from 0), virtual pipeline chunks, Megatron-FSDP v2's optimizer state (a
checkpoint Megatron's checkpoint_inspector converted from torch_dist carries that run's args and torch_dist's
global layer numbers: read whatever its pipeline was).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ...errors import CheckpointError
from .dcp_checkpoint import DcpCheckpoint
from .megatron_torch import GROUPED

ARGS = "args"
COMMON = (ARGS, "iteration")  # generate_state_dict's top-level values that Megatron's common state holds
MODEL, OPTIMIZER_STATE = "model.", "optimizer.state."
WRAPPERS = ("module", "model")  # Megatron's _strip_wrapper_prefixes
# handle_swiglu_in_state_dict's is_swiglu_key, with the half it names
SWIGLU = re.compile(r"(?P<base>.*\.mlp\.(?:experts\.local_experts\.[0-9]+\.|shared_experts\.)?linear_fc1\.(?:weight|bias)"
                    r"|.*\.mlp\.experts\.linear_fc1\.(?:weight|bias)[0-9]+)_(?P<half>[wv])\Z")
KINDS = re.compile(r"(?P<param>.+)\.(?P<kind>[A-Za-z0-9_]+)\Z")  # a parameter's state: its last segment
EXPERT_INDEX = re.compile(r"(?P<head>.*\.mlp\.experts\.local_experts\.)(?P<e>[0-9]+)(?P<tail>\..+)\Z")
UNPLACEABLE = {"pipeline_model_parallel_size": "each pipeline stage numbers its own layers from 0",
               "virtual_pipeline_model_parallel_size": "each virtual pipeline chunk numbers its own layers"}


def detect(ckpt: DcpCheckpoint) -> bool:
    """Megatron-FSDP's save: Megatron-LM's `args` beside model keys under a wrapper's `module.` (Megatron-
    LM's other DCP format, torch_dcp, saves the unwrapped model: `model.decoder.…`)."""
    return ARGS in ckpt.values and any(f.startswith(f"{MODEL}module.") for f in ckpt.tensors)


def unwrapped(name: str) -> str:
    """Megatron's `_strip_wrapper_prefixes`: any leading run of `module`/`model` segments off."""
    parts = name.split(".")
    while parts and parts[0] in WRAPPERS:
        parts = parts[1:]
    return ".".join(parts)


def _megatron_name(name: str) -> tuple[str, str | None]:
    """A parameter's torch_dist name and, for a SwiGLU half, which ("w" gate, "v" up): experts by
    SequentialMLP's names (`experts.linear_fc1.weight{e}` -> `experts.local_experts.{e}.linear_fc1.weight`)."""
    m = SWIGLU.fullmatch(name)
    base, half = (m.group("base"), m.group("half")) if m else (name, None)
    g = GROUPED.fullmatch(base)
    if g is not None:
        base = f"{g.group('head')}local_experts.{g.group('n')}.{g.group('tail')}"
    return base, half


def _renamed(fqn: str, size: tuple[int, ...]) -> tuple[str, str | None, tuple[str, ...]]:
    """(the torch_dist name, the SwiGLU half or None, the store path) of a saved key."""
    if fqn.startswith(MODEL):
        name, half = _megatron_name(unwrapped(fqn[len(MODEL):]))
        return name, half, ("model", name)
    m = KINDS.fullmatch(fqn[len(OPTIMIZER_STATE):]) if fqn.startswith(OPTIMIZER_STATE) else None
    if m is None:
        return fqn, None, ()
    param, half = _megatron_name(unwrapped(m.group("param")))
    if half is not None and not size:  # a value per half (Adam's step): kept apart
        param, half = f"{param}_{half}", None
    name = f"{OPTIMIZER_STATE}{m.group('kind')}.{param}"
    return name, half, ("optimizer", name)


def named(ckpt: DcpCheckpoint) -> DcpCheckpoint:
    """The checkpoint under torch_dist's names: SwiGLU halves one tensor (the gate's rows, then the up's,
    each chunk moved down by the gate's rows), experts by SequentialMLP's names, wrappers off."""
    halves: dict[str, dict[str, tuple[str, Any]]] = {}  # name -> half -> (its key, its metadata)
    renamed: dict[str, tuple[str, str | None]] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    for fqn in ckpt.paths:
        size = ckpt.tensors[fqn][1] if fqn in ckpt.tensors else ()
        name, half, path = _renamed(fqn, size)
        renamed[fqn] = (name, half)
        paths.setdefault(name, path or ckpt.paths[fqn])
        if half is not None:
            halves.setdefault(name, {})[half] = (fqn, ckpt.tensors[fqn])
    tensors = {name: _joined(name, pair) for name, pair in halves.items()}
    for fqn, (dtype, size, chunks) in ckpt.tensors.items():
        name, half = renamed[fqn]
        if half is None:
            if name in tensors:
                raise CheckpointError(f"{fqn}: its name {name!r:.80} is another key's too")
            tensors[name] = (dtype, size, chunks)
    shift = {pair["v"][0]: pair["w"][1][1][0] for pair in halves.values()}  # the up's chunks: below the gate's
    items = []
    for item in ckpt.items:
        name, _ = renamed[item.fqn]
        offsets = item.offsets
        if offsets is not None and item.fqn in shift:
            offsets = (offsets[0] + shift[item.fqn], *offsets[1:])
        items.append(replace(item, fqn=name, offsets=offsets))
    values = list(dict.fromkeys(renamed[f][0] for f in ckpt.values))
    if len(values) != len(ckpt.values) or set(values) & set(tensors):
        raise CheckpointError("Megatron-FSDP keys that one name would share (a damaged metadata?)")
    return replace(ckpt, tensors=tensors, values=values, paths=paths, items=items)


def _joined(name: str, pair: dict[str, tuple[str, Any]]) -> tuple[str, tuple[int, ...], list[Any]]:
    """A SwiGLU tensor's metadata from its halves': the gate's chunks where they are, the up's below its
    rows. Both halves must be there, alike but for their rows."""
    if set(pair) != {"w", "v"}:
        have, want = next(iter(pair.items())), "v" if "w" in pair else "w"
        raise CheckpointError(f"{have[1][0]}: SwiGLU's {'gate' if have[0] == 'w' else 'up'} half of {name} without "
                              f"its {'up' if want == 'v' else 'gate'} half (…_{want}) in the checkpoint")
    (w, (wtype, wsize, wchunks)), (v, (vtype, vsize, vchunks)) = pair["w"], pair["v"]
    if wtype != vtype or wsize != vsize or not wsize:
        raise CheckpointError(f"{v}: torch.{vtype}{list(vsize)}, but its gate half {w} is torch.{wtype}{list(wsize)}")
    rows = wsize[0]
    return wtype, (2 * rows, *wsize[1:]), wchunks + [((o[0] + rows, *o[1:]), s) for o, s in vchunks]


def check_args(args: dict[str, Any] | None, ckpt: DcpCheckpoint, where: str) -> None:
    """What the args say that these names cannot place, refused by the argument's name; and every routed
    expert of every MoE layer there (a missing one would be a model that still loads). Megatron-FSDP's own
    save says `ckpt_format` fsdp_dtensor; Megatron's checkpoint_inspector (convert-torch-dist-to-fsdp-
    dtensor) writes the torch_dist run's args, and its layers by torch_dist's global numbers."""
    if args is None:
        raise CheckpointError(f"{where}: Megatron-FSDP's keys without Megatron-LM's args (its {ARGS} value)")
    native = args.get("ckpt_format") == "fsdp_dtensor"
    for key, why in UNPLACEABLE.items():
        if native and args.get(key) not in (None, 1):
            raise CheckpointError(f"{where}: {key} {args[key]!r:.20}: {why}, which Megatron-FSDP's keys do not say; "
                                  f"shardstore reads fsdp_dtensor checkpoints of one pipeline stage")
    state = [f for f in ckpt.tensors if f.startswith(OPTIMIZER_STATE)]
    if native and args.get("megatron_fsdp_version") == 2 and state:
        raise CheckpointError(f"{where}: megatron_fsdp_version 2: its optimizer state ({state[0]!r:.80}) has no "
                              f"layout Megatron-LM documents; save without it (--no-save-optim)")
    _all_experts(ckpt, args.get("num_experts"), where)


def _all_experts(ckpt: DcpCheckpoint, count: Any, where: str) -> None:
    """Every module of every layer's experts, for each of the args' `num_experts` experts."""
    seen: dict[tuple[str, str], set[int]] = {}
    for fqn in ckpt.tensors:
        m = EXPERT_INDEX.fullmatch(fqn)
        if m is not None:
            seen.setdefault((m.group("head"), m.group("tail")), set()).add(int(m.group("e")))
    want = set(range(count)) if type(count) is int and count > 0 else set().union(*seen.values())
    for (head, tail), have in sorted(seen.items()):
        missing = sorted(want - have)
        if missing:
            raise CheckpointError(f"{where}: {head}{missing[0]}{tail} is missing ({len(have)} of the "
                                  f"{len(want)} experts' {tail[1:]}): a file or key of the save is lost")
        extra = sorted(have - want)
        if extra:
            raise CheckpointError(f"{where}: {head}{extra[0]}{tail}: an expert past the args' num_experts {count}")
