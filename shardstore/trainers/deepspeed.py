"""DeepSpeed's engine (`save_checkpoint`): its ZeRO files are read through their own format
(read/formats/deepspeed.py); here, how its runs name them.

A save folder (the HF Trainer's checkpoint-N/ under DeepSpeed) holds f"global_step{N}/", the engine's
default tag, and `latest`, a file whose text is the newest tag.
"""

from __future__ import annotations

from .contract import Steps

STEPS = Steps(r"global_step([0-9]+)", "latest", "tag")
