"""torchtitan's CheckpointManager: a DCP folder per step (read/formats/dcp.py, in torch DCP's own
nesting); here, how its runs name them.

It saves f"step-{step}/" under its checkpoint folder and records the step as `train_state.step`; the
newest is the highest step.
"""

from __future__ import annotations

from .contract import Steps

# dcp.save writes the folder's .metadata once every rank's files are written
STEPS = Steps(r"step-([0-9]+)", marker=".metadata")
STEP_KEY = "train_state.step"  # the bytes item its folder's step is recorded in
