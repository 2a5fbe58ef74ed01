"""veRL's checkpoint managers (FSDP and Megatron workers): their files are read through their own
formats (read/formats/verl.py, dcp.py); here, how its runs name them.

Its trainer saves f"global_step_{N}/" in the run's default_local_dir and then
latest_checkpointed_iteration.txt there, naming N.
"""

from __future__ import annotations

from .contract import Steps

STEPS = Steps(r"(?:global_)?step_([0-9]+)", "latest_checkpointed_iteration.txt", "step")
# its actor's record of a LoRA run's adapter, beside the rank files: {"r", "lora_alpha", "task_type"}
LORA_META = "lora_train_meta.json"
