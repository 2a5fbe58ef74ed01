"""The HF Trainer (transformers' `Trainer` under FSDP with SHARDED_STATE_DICT).

Known from its folder: `trainer_state.json` beside the model and optimizer (read/formats/resume.py).
`--format torch` writes `pytorch_model.bin` (the model's state dict, which `Trainer._load_from_checkpoint`
takes when there is no model.safetensors) and `optimizer.pt` (keyed by parameter number), beside the
Trainer's own `scheduler.pt`, `rng_state.pth` (process 0's), `trainer_state.json` and
`training_args.bin`, kept byte for byte: `trainer.train(resume_from_checkpoint=OUT)`.
"""

from __future__ import annotations

import re

from ..tree import Node
from .contract import ResumeFile, Steps, Trainer, never
from .optimizer import by_parameter_number

MODEL = re.compile(r"model(?:_([0-9]+))?\Z")
OPTIMIZER = re.compile(r"optimizer(?:_([0-9]+))?\Z")
# f"{PREFIX_CHECKPOINT_DIR}-{global_step}" in its output_dir; the newest is the highest (get_last_checkpoint)
# Trainer._save_checkpoint writes trainer_state.json after the model, optimizer, scheduler and RNG states
STEPS = Steps(r"checkpoint-([0-9]+)", marker="trainer_state.json")


def models_and_optimizers(tree: Node, optimizer_name: str) -> list[ResumeFile] | None:
    """`pytorch_model[_i].bin` for each model of the tree's top level and `optimizer_name` (its `{i}`
    filled, or dropped with the `_` for the first) for each optimizer; None for anything else there."""
    files: list[ResumeFile] = []
    for _, child in tree.children:
        model, optimizer = MODEL.match(child.path), OPTIMIZER.match(child.path)
        if model is not None:
            files.append(ResumeFile(f"pytorch_model_{model[1]}.bin" if model[1] else "pytorch_model.bin", child))
        elif optimizer is not None and (optimizer[1] is None or "{i}" in optimizer_name):
            name = optimizer_name.format(i=f"_{optimizer[1]}" if optimizer[1] else "")
            files.append(ResumeFile(name, child, form=by_parameter_number))
        else:
            return None
    return files


TRAINER = Trainer(
    "hf-trainer", "hf-trainer (the HF Trainer's model, optimizer, scheduler, RNG and trainer state)", ("model",),
    never, lambda tree, ranked: models_and_optimizers(tree, "optimizer.pt"),
    writes=r"pytorch_model\.bin|optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state\.pth|trainer_state\.json"
           r"|training_args\.bin", steps=STEPS)
