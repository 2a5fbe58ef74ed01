"""Megatron-LM (and NeMo, veRL's Megatron workers, which save through it): its checkpoints are read
through formats of their own (read/formats/megatron_torch.py, dcp.py); here, how its runs name them.

save_checkpoint writes f"iter_{iteration:07d}/" and then latest_checkpointed_iteration.txt, naming that
iteration, or "release" for a checkpoint converted from elsewhere (in release/).
"""

from __future__ import annotations

from .contract import Steps

STEPS = Steps(r"iter_([0-9]+)", "latest_checkpointed_iteration.txt", "step")
RELEASE = "release"  # what that pointer says of the release/ folder
# Megatron-Bridge's config of the run, in each iter_N/: its model (`model:`, a TransformerConfig) and its
# PEFT (`peft:`, the LoRA's `dim`, `alpha`, `target_modules`), which its adapter-only saves record nowhere else
RUN_CONFIG = "run_config.yaml"
