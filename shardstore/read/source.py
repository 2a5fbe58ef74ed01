"""A checkpoint found on disk (or object storage): its `Source`, whichever format it is in.

What every format shares when it finds its checkpoint: the Source record, picking one checkpoint of
several by `--tag` or `--step`, and the small side files (a run's config) a checkpoint keeps beside its
units. Asking the formats in turn is read/discover.py's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..errors import CheckpointError
from ..locations import StorageOptions, is_url, join, listing, local

MAX_SIDE_FILE = 64 << 20  # a tokenizer.json of a large vocabulary is several MB
CONFIG = "config.yaml"  # OLMo's run config, copied beside every export as OLMo's unsharder does
JSON_CONFIG = "config.json"  # OLMo-core's experiment config in each checkpoint; the HF Trainer's model config
LATEST = "latest_checkpointed_iteration.txt"  # veRL's (and Megatron's) pointer to the newest step
RELEASE = "release"  # what that pointer says of Megatron-LM's release/ folder
@dataclass
class Source:
    """One checkpoint: its format (a registry name) and its units of work, in order."""

    format: str
    units: list[str]
    storage_options: StorageOptions | None = None
    side_files: list[str] = field(default_factory=list)  # the run's config: copied beside the export
    trainer: str | None = None  # the trainer whose resume files it has (read/formats/resume.py)
    resume_files: dict[str, str] = field(default_factory=dict)  # their output names -> their paths

    @property
    def folder(self) -> str:
        """The folder every file of the checkpoint is in: where it was found."""
        return "/".join(os.path.commonprefix([u.split("/")[:-1] for u in self.units]))


# ---------------------------------------------------------------------------------------------- shared
def pick(src: str, candidates: list[str], tag: str | None, step: int | None) -> str:
    """The one of `candidates` (checkpoint folders found in `src`, by name) that `tag` or `step` names.
    Without either, the one `src`'s latest_checkpointed_iteration.txt names, else the newest when every
    one names its step (the HF Trainer's get_last_checkpoint, torchtitan's, DeepSpeed's rule), or the only
    one (`--step`: `names_step`)."""
    there = candidates
    if tag in (None, "latest") and step is None and len(candidates) > 1:
        latest = _latest_step(src)
        if latest == RELEASE:
            tag, step = RELEASE, None
        else:
            step = latest if isinstance(latest, int) else _newest(candidates)
    if tag not in (None, "latest"):
        candidates = [c for c in candidates if c == tag]
    if step is not None:
        candidates = [c for c in candidates if names_step(c, step)]
    if len(candidates) != 1:
        if not candidates:
            raise CheckpointError(f"{src}: no checkpoint matches {'--tag ' + tag if tag else f'--step {step}'}; "
                                  f"it holds {', '.join(there)}")
        raise CheckpointError(f"{src}: holds more than one checkpoint ({', '.join(candidates)}); pick one with "
                              f"--tag or --step")
    return candidates[0]


STEP_NAME = re.compile(r"(?:^|[-_/])(?:step[-_=]?|ba|checkpoint-|iter_)(\d+)(?:\.ckpt)?$")


def _newest(candidates: list[str]) -> int | None:
    """The highest step the candidates' names say, when every one says its own."""
    steps = [STEP_NAME.search(c) for c in candidates]
    numbers = {int(m.group(1)) for m in steps if m is not None}
    return max(numbers) if None not in steps and len(numbers) == len(candidates) else None


def names_step(name: str, step: int) -> bool:
    """Whether a checkpoint's name (a folder, or a rank file's tag) is of step `step`: it ends in `stepN`,
    `step_N` (veRL's global_step_N, DeepSpeed's global_stepN), `step-N` (torchtitan's), `step=N[.ckpt]`
    (Lightning's epoch=0-step=4.ckpt), `baN` (Composer's ep0-baN), `checkpoint-N` (the HF Trainer's) or
    `iter_N` (Megatron-LM's iter_0000010), the number with or without zeros."""
    m = STEP_NAME.search(name)
    return m is not None and int(m.group(1)) == step


def _latest_step(run: str) -> int | str | None:
    """The step a run folder's latest_checkpointed_iteration.txt names, if it has one (or "release": a
    Megatron-LM checkpoint converted from elsewhere lives in release/, and its pointer says so)."""
    if is_url(run):
        return None
    path = os.path.join(local(run), LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        text = f.read(64).strip()
    if text == RELEASE.encode():
        return RELEASE
    if not text.isdigit():
        raise CheckpointError(f"{path}: names no step ({text[:20]!r}); pick a checkpoint with --tag or --step")
    return int(text)


def config_files(folder: str, storage_options: StorageOptions | None, *names: str) -> list[str]:
    """Those of `names` (default: the run's config.yaml) that are files in `folder`."""
    there = listing(folder, storage_options)
    return [join(folder, n) for n in (names or (CONFIG,)) if join(folder, n) in there]
