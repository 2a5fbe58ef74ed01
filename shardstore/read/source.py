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
from ..locations import StorageOptions, is_url, join, listing, local, name_of

MAX_SIDE_FILE = 64 << 20  # a tokenizer.json of a large vocabulary is several MB
CONFIG = "config.yaml"  # OLMo's run config, copied beside every export as OLMo's unsharder does
JSON_CONFIG = "config.json"  # OLMo-core's experiment config in each checkpoint; the HF Trainer's model config
LATEST = "latest_checkpointed_iteration.txt"  # veRL's (and Megatron's) pointer to the newest step
RELEASE = "release"  # what that pointer says of Megatron-LM's release/ folder
LATEST_LINK = "latest"  # OLMo's link to the newest step folder of its save folder
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
    Without either (or with the tag "latest"), the one `src`'s latest_checkpointed_iteration.txt names, or
    its `latest` link (OLMo's), else the newest when every one names its step (the HF Trainer's
    get_last_checkpoint, torchtitan's, DeepSpeed's rule), or the only one (`--step`: `names_step`)."""
    there, named = candidates, f"--tag {tag}" if tag else f"--step {step}"
    if tag in (None, "latest") and step is None and len(candidates) > 1:
        latest, linked = _latest_step(src), _linked_latest(src)
        if latest == RELEASE:
            tag, step = RELEASE, None
        elif isinstance(latest, int):
            step, named = latest, f"the step {LATEST} names ({latest})"
        elif linked is not None:
            tag, named = linked, f"its {LATEST_LINK} link ({linked})"
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


STEP_NAME = re.compile(r"(?:^|[-_/])(?:step[-_=]?|ba|checkpoint-|iter_)([0-9]+)(?:\.ckpt)?$")
OLMO_STEP = re.compile(r"\Astep([0-9]+)\Z")  # OLMo's and OLMo-core's f"step{global_step}" folder
# Composer's f"ep{epoch}-ba{batch}" folder and f"ep{epoch}-ba{batch}-rank{rank}.pt" files, from its timestamp
COMPOSER_EPOCH = re.compile(r"\Aep([0-9]+)-ba[0-9]+(?:-rank[0-9]+\.pt)?\Z")
COMPOSER_BATCH = re.compile(r"\Aep[0-9]+-ba([0-9]+)(?:-rank[0-9]+\.pt)?\Z")


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


def _linked_latest(run: str) -> str | None:
    """The name of the folder a run folder's `latest` link (OLMo's save_folder/latest -> stepN) leads to,
    if it has one: a folder of the run itself (one elsewhere is refused: `inside_run`)."""
    if is_url(run):
        return None
    link = os.path.join(local(run), LATEST_LINK)
    if not (os.path.islink(link) and os.path.isdir(link)):
        return None
    target = inside_run(run, link)
    return os.path.basename(target) if os.path.dirname(target) == os.path.realpath(local(run)) else None


def hf_files(folder: str, storage_options: StorageOptions | None) -> list[str]:
    """A model's Hugging Face files in `folder` (config.json, generation_config.json, the tokenizer's), if
    its config.json is there."""
    there = [p for p in listing(folder, storage_options) if hf_model_file(name_of(p))]
    return there if JSON_CONFIG in map(name_of, there) else []


def config_files(folder: str, storage_options: StorageOptions | None, *names: str) -> list[str]:
    """Those of `names` (default: the run's config.yaml) that are files in `folder`."""
    there = listing(folder, storage_options)
    return [join(folder, n) for n in (names or (CONFIG,)) if join(folder, n) in there]
