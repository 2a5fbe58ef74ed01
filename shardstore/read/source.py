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
from ..hf_files import hf_model_file
from ..locations import StorageOptions, is_url, join, listing, local, name_of, subfolders
from ..trainers.megatron import RELEASE
from ..trainers.registry import RUNS
from .primitives.container import read_small

MAX_SIDE_FILE = 64 << 20  # a tokenizer.json of a large vocabulary is several MB
CONFIG = "config.yaml"  # OLMo's run config, copied beside every export as OLMo's unsharder does
JSON_CONFIG = "config.json"  # OLMo-core's experiment config in each checkpoint; the HF Trainer's model config
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
def pick(src: str, candidates: list[str], tag: str | None, step: int | None,
         storage_options: StorageOptions | None = None) -> str:
    """The one of `candidates` (checkpoint folders found in `src`, by name) that `tag` or `step` names.
    Without either (or with the tag "latest"), the one `src`'s pointer names (a trainer's, `pointed`), else
    the newest when every one names its step (the HF Trainer's get_last_checkpoint, torchtitan's,
    DeepSpeed's rule), or the only one (`--step`: `names_step`)."""
    there, named = candidates, f"--tag {tag}" if tag else f"--step {step}"
    if tag in (None, "latest") and step is None and len(candidates) > 1:
        latest = pointed(src, candidates, storage_options)
        if latest is not None:
            (tag, step), named = latest[:2], latest[2]
        else:
            step = _newest(candidates)
    if tag not in (None, "latest"):
        candidates = [c for c in candidates if c == tag]
    if step is not None:
        candidates = [c for c in candidates if names_step(c, step)]
    if len(candidates) != 1:
        if not candidates:
            raise CheckpointError(f"{src}: no checkpoint matches {named}; it holds {', '.join(there)}")
        raise CheckpointError(f"{src}: holds more than one checkpoint ({', '.join(candidates)}); pick one with "
                              f"--tag or --step")
    inside_run(src, join(src, candidates[0]))
    return candidates[0]


# Any trainer's name of a checkpoint (trainers/registry.py RUNS) at the end of a name, after its start or a
# separator: veRL's global_step_N, torchtitan's .../step-N, Composer's ep0-baN-rank0.pt tag
STEP_NAME = re.compile(rf"(?:^|[-_/])(?:{'|'.join(f'(?:{steps.name})' for steps in RUNS)})$")
MAX_TAG = 256  # a pointer file's text: a step or a checkpoint's name


def inside_run(run: str, pointer: str) -> str:
    """Where `pointer` (a link, or a folder a pointer file names, in the folder `run` the user named) leads,
    refused when that is outside `run`: a run's `last.ckpt`, `latest` or step folder linking to another
    run's checkpoint would export that run's tensors under this one's name. The user can name the target
    itself. Object storage has no links."""
    if is_url(pointer):
        return pointer
    target, top = os.path.realpath(local(pointer)), os.path.realpath(local(run))
    if os.path.commonpath([target, top]) != top:
        raise CheckpointError(f"{pointer}: leads to {target}, outside {run}: name that checkpoint itself to read it")
    return target


def check_step(path: str, key: str, recorded: object, named_by: str, named: re.Pattern[str]) -> None:
    """A trainer names a checkpoint's folder (or file: `named_by`) by the step it records in file `path`:
    `named`, searched in that name, gives the step (group 1). A file recording another step than the name
    says is of another save (a copy into an older save's folder), and is refused. A name `named` does not
    fit (renamed, Lightning's last.ckpt) says nothing; a file recording no `key` as a number neither."""
    m = named.search(name_of(named_by))
    if m is not None and type(recorded) is int and recorded != int(m.group(1)):
        raise CheckpointError(f"{path}: records {key} {recorded!r:.40}, but its {'name' if named_by == path else 'folder'}"
                              f" is {name_of(named_by)}: files of two saves?")


def step_of(name: str) -> int | None:
    """The step a checkpoint's name (a folder, or a rank file's tag) says by any trainer's convention: it
    ends in `stepN` (OLMo's), `step_N` (veRL's global_step_N), `global_stepN` (DeepSpeed's), `step-N`
    (torchtitan's), `step=N[.ckpt]` (Lightning's epoch=0-step=4.ckpt), `ep{E}-baN` (Composer's),
    `checkpoint-N` (the HF Trainer's), `checkpoint_N` (Accelerate's) or `iter_N` (Megatron-LM's
    iter_0000010), the number with or without zeros."""
    m = STEP_NAME.search(name)
    return None if m is None else int(next(g for g in m.groups() if g is not None))


def names_step(name: str, step: int) -> bool:
    """Whether a checkpoint's name is of step `step` (`step_of`)."""
    return step_of(name) == step


def _newest(candidates: list[str]) -> int | None:
    """The highest step the candidates' names say, when every one says its own."""
    steps = [step_of(c) for c in candidates]
    numbers = {s for s in steps if s is not None}
    return max(numbers) if None not in steps and len(numbers) == len(candidates) else None


def pointed(run: str, candidates: list[str],
            storage_options: StorageOptions | None = None) -> tuple[str | None, int | None, str] | None:
    """The newest checkpoint a run folder's pointer names (the first of the trainers' `RUNS` that has one
    there), as (tag, step, how it was named): Megatron-LM's and veRL's latest_checkpointed_iteration.txt
    (a step, or "release": a Megatron-LM checkpoint converted from elsewhere lives in release/), a link
    to a folder of the run (OLMo's `latest`, Lightning's `last.ckpt`), DeepSpeed's `latest` file naming
    one of `candidates`. Object storage has no links."""
    there = {name_of(p) for p in listing(run, storage_options)} - set(subfolders(run, storage_options))
    for steps in RUNS:
        path = join(run, steps.latest)
        if steps.points == "link" and not is_url(run) and os.path.islink(path) and os.path.isdir(path):
            target = inside_run(run, path)
            if os.path.dirname(target) == os.path.realpath(local(run)):
                return os.path.basename(target), None, f"its {steps.latest} link ({os.path.basename(target)})"
        if steps.points not in ("step", "tag") or steps.latest not in there:
            continue
        text = read_small(path, storage_options, MAX_TAG, "a pointer to the newest checkpoint").strip()
        if steps.points == "tag":
            tag = text.decode("utf-8", "replace")
            if tag in candidates:
                return tag, None, f"its {steps.latest} ({tag})"
        elif text == RELEASE.encode():
            return RELEASE, None, f"its {steps.latest} ({RELEASE})"
        elif not text.isdigit():
            raise CheckpointError(f"{path}: names no step ({text[:20]!r}); pick a checkpoint with --tag or --step")
        else:
            return None, int(text), f"the step {steps.latest} names ({int(text)})"
    return None


def hf_files(folder: str, storage_options: StorageOptions | None) -> list[str]:
    """A model's Hugging Face files in `folder` (config.json, generation_config.json, the tokenizer's), if
    its config.json is there."""
    there = [p for p in listing(folder, storage_options) if hf_model_file(name_of(p))]
    return there if JSON_CONFIG in map(name_of, there) else []


def config_files(folder: str, storage_options: StorageOptions | None, *names: str) -> list[str]:
    """Those of `names` (default: the run's config.yaml) that are files in `folder`."""
    there = listing(folder, storage_options)
    return [join(folder, n) for n in (names or (CONFIG,)) if join(folder, n) in there]
