"""Megatron-LM (and NeMo, veRL's Megatron workers, which save through it): its checkpoints are read
through formats of their own (read/formats/megatron_torch.py, dcp.py); here, how its runs name them.

save_checkpoint writes f"iter_{iteration:07d}/" and then latest_checkpointed_iteration.txt, naming that
iteration, or "release" for a checkpoint converted from elsewhere (in release/).
"""

from __future__ import annotations

from .contract import Steps

STEPS = Steps(r"iter_([0-9]+)", "latest_checkpointed_iteration.txt", "step")
RELEASE = "release"  # what that pointer says of the release/ folder
