"""Accelerate's `save_state` (FSDP plugin, SHARDED_STATE_DICT).

Known from its folder: process 0's `random_states_0.pkl` (read/formats/resume.py). `--format torch` writes
`pytorch_model.bin` and `optimizer.bin` (`_{i}` for the i-th prepared model and optimizer), beside its
scheduler, sampler and process 0's RNG files: `accelerator.load_state(OUT)`.
"""

from __future__ import annotations

from .contract import Steps, Trainer, never
from .hf_trainer import models_and_optimizers

# ProjectConfiguration(automatic_checkpoint_naming=True): checkpoints/checkpoint_{iteration}
STEPS = Steps(r"checkpoint_([0-9]+)")

TRAINER = Trainer(
    "accelerate", "accelerate (Accelerate's save_state: models, optimizers, schedulers, RNG states)", ("model",),
    never, lambda tree, ranked: models_and_optimizers(tree, "optimizer{i}.bin"),
    writes=r"pytorch_model(_[0-9]+)?\.bin|optimizer(_[0-9]+)?\.bin|(scheduler|sampler|dl_state_dict)(_[0-9]+)?\.bin"
           r"|scaler\.pt|random_states_0\.pkl|custom_checkpoint_[0-9]+\.pkl",
    steps=STEPS)
