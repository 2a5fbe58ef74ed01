"""`--format torch` as each trainer resumes from it without FSDP: the files, names and keying it loads.

- The HF Trainer: `pytorch_model.bin` (the model's state dict, which `Trainer._load_from_checkpoint` takes
  when there is no model.safetensors) and `optimizer.pt` (what `torch.optim.Optimizer.state_dict()`
  gives: the state and the param_groups keyed by parameter number), beside the Trainer's own
  `scheduler.pt`, `rng_state.pth` (process 0's), `trainer_state.json` and `training_args.bin`, kept byte
  for byte (read/formats/resume.py): `trainer.train(resume_from_checkpoint=OUT)`.
- Accelerate's `save_state`: `pytorch_model.bin` and `optimizer.bin` (`_{i}` for the i-th prepared model
  and optimizer), beside its scheduler, sampler and process 0's RNG files: `accelerator.load_state(OUT)`.
- Lightning's Trainer: one `checkpoint.ckpt` as Lightning saves a full checkpoint, `state_dict` and
  `optimizer_states` (a list, keyed by parameter number) beside meta.pt's epoch, global_step, loops,
  callbacks and schedulers: `Trainer.fit(model, ckpt_path=OUT/checkpoint.ckpt)`. (Fabric's checkpoints keep
  the user's own keys, which `fabric.load` takes back from one checkpoint.pt as they are.)

FSDP saves an optimizer's state keyed by parameter name, its param_groups listing the names; the number of
a parameter is its place in those lists, group after group, as `Optimizer.state_dict()` numbers them.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from ..errors import ExportError
from ..tree import Node

MODEL = re.compile(r"model(?:_([0-9]+))?\Z")
OPTIMIZER = re.compile(r"optimizer(?:_([0-9]+))?\Z")
LIGHTNING_MODEL = ("model", "state_dict")  # FSDPStrategy's key in the DCP folder; ModelParallelStrategy's
LIGHTNING_FILE = "checkpoint.ckpt"


TorchForm = Callable[[Any], Any]  # what a torch file holds, shaped as its trainer saves it


def resume_layout(layout: str, tree: Node) -> list[tuple[str, Node, TorchForm]] | None:
    """(file name, the node it holds, the trainer's shape of it) of each torch file a trainer's layout
    gets; None for a layout that has no trainer's files (or holds parts the trainer does not save)."""
    if layout == "lightning":
        return [(LIGHTNING_FILE, tree, lightning_checkpoint)]
    if layout not in ("hf-trainer", "accelerate"):
        return None
    files: list[tuple[str, Node, TorchForm]] = []
    for _, child in tree.children:
        model, optimizer = MODEL.match(child.path), OPTIMIZER.match(child.path)
        if model is not None:
            files.append((f"pytorch_model_{model[1]}.bin" if model[1] else "pytorch_model.bin", child, _as_saved))
        elif optimizer is not None and layout == "hf-trainer" and not optimizer[1]:
            files.append(("optimizer.pt", child, by_parameter_number))
        elif optimizer is not None and layout == "accelerate":
            files.append((f"optimizer_{optimizer[1]}.bin" if optimizer[1] else "optimizer.bin", child,
                          by_parameter_number))
        else:
            return None
    return files


def _as_saved(state: Any) -> Any:
    return state


def by_parameter_number(optimizer: Any) -> dict[str, Any]:
    """An optimizer's state dict keyed by parameter name (FSDP's) keyed as `Optimizer.state_dict()` keys
    it, which `Optimizer.load_state_dict` needs."""
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise ExportError("the optimizer's state has no param_groups listing its parameters; export it with "
                          "--format dcp, or as saved with --format safetensors --select")
    names = [name for group in groups for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    if len(number) != len(names):
        raise ExportError(f"the optimizer's param_groups list a parameter twice "
                          f"({next(n for n in names if names.count(n) > 1)!r:.80})")
    state = optimizer.get("state", {})
    unlisted = next((name for name in state if name not in number), None)
    if unlisted is not None:
        raise ExportError(f"the optimizer's state of {unlisted!r:.80}: no param_group lists it")
    return {"state": {number[name]: state[name] for name in sorted(state, key=number.__getitem__)},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [number[n] for n in g["params"]]}
                             for g in groups]}


def lightning_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """What Lightning's Trainer saves as one full checkpoint, from its sharded folder's keys: the model
    as `state_dict`, `optimizer_{i}` as the list `optimizer_states`, meta.pt's keys as they were."""
    out: dict[str, Any] = {}
    optimizers: dict[int, Any] = {}
    for key, value in state.items():
        optimizer = OPTIMIZER.match(key) if isinstance(key, str) else None
        if key in LIGHTNING_MODEL:
            out["state_dict"] = value
        elif optimizer is not None and optimizer[1] is not None:
            optimizers[int(optimizer[1])] = by_parameter_number(value)
            out.setdefault("optimizer_states", [])
        else:
            out[key] = value
    if sorted(optimizers) != list(range(len(optimizers))):
        raise ExportError(f"Lightning's optimizers are numbered {sorted(optimizers)}, not from 0 on: one is missing")
    if optimizers:
        out["optimizer_states"] = [optimizers[i] for i in range(len(optimizers))]
    return out
