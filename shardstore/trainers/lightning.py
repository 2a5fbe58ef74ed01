"""Lightning's Trainer (FSDPStrategy and ModelParallelStrategy, sharded).

Known from its tree: every checkpoint it saves holds `pytorch-lightning_version`. `--format torch` writes
one `checkpoint.ckpt` as Lightning saves a full checkpoint: `state_dict` and `optimizer_states` (a list,
keyed by parameter number) beside meta.pt's epoch, global_step, loops, callbacks and schedulers:
`Trainer.fit(model, ckpt_path=OUT/checkpoint.ckpt)`. (Fabric's checkpoints keep the user's own keys,
which `fabric.load` takes back from one checkpoint.pt as they are: no trainer of their own here.)

A LightningModule holds the transformers model as an attribute (`self.model = AutoModelForCausalLM...`):
every name of its state dict starts with it (`module_prefix`).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ExportError
from .contract import ResumeFile, Steps, Trainer, top_keys
from .hf_trainer import OPTIMIZER
from .optimizer import by_parameter_number

VERSION_KEY = "pytorch-lightning_version"  # in every checkpoint Lightning's Trainer saves
MODEL = ("model", "state_dict")  # FSDPStrategy's key in the DCP folder; ModelParallelStrategy's
# ModelCheckpoint's default filename f"epoch={epoch}-step={step}.ckpt", and save_last's last.ckpt: a link
# to the newest, or a copy of it
STEPS = Steps(r"(?:epoch=[0-9]+-)?step=([0-9]+)(?:\.ckpt)?", "last.ckpt", "link")
# `{epoch}-{step}` (its default filename: `key=value` of trainer.current_epoch and trainer.global_step as it
# saves, which dump_checkpoint records as `epoch` and `global_step`), wherever a user's template puts them;
# the start or a separator (not `_`) before the key: a metric `train_step` is not it
NAMED = {"global_step": re.compile(r"(?:^|[^A-Za-z0-9_])step=([0-9]+)(?![0-9])"),
         "epoch": re.compile(r"(?:^|[^A-Za-z0-9_])epoch=([0-9]+)(?![0-9])")}


def lightning_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """What Lightning's Trainer saves as one full checkpoint, from its sharded folder's keys: the model
    as `state_dict`, `optimizer_{i}` as the list `optimizer_states`, meta.pt's keys as they were."""
    out: dict[str, Any] = {}
    optimizers: dict[int, Any] = {}
    for key, value in state.items():
        optimizer = OPTIMIZER.match(key) if isinstance(key, str) else None
        if key in MODEL:
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


TRAINER = Trainer(
    "lightning", "lightning (Lightning's state_dict, optimizer_N and loops, callbacks, schedulers)", MODEL,
    lambda tree, reader: VERSION_KEY in top_keys(tree),
    lambda tree, ranked: [ResumeFile("checkpoint.ckpt", tree, form=lightning_checkpoint)],
    writes=r"checkpoint\.ckpt", module_prefix=True, steps=STEPS)
