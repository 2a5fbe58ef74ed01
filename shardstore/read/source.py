"""A checkpoint found on disk (or object storage): its `Source`, whichever format it is in.

`open_source` and `source_of_files` ask each format of the registry in turn (read/registry.py); the
formats themselves are behind the typed contract (read/contract.py). What is here is what every format
shares: the Source record, picking one checkpoint of several by `--tag` or `--step`, and the small side
files (a run's config) a checkpoint keeps beside its units.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from ..locations import StorageOptions, filesystem, is_url, local
from .contract import CheckpointSpec, Format, Unit

MAX_SIDE_FILE = 64 << 20  # a tokenizer.json of a large vocabulary is several MB
CONFIG = "config.yaml"  # OLMo's run config, copied beside every export as OLMo's unsharder does
JSON_CONFIG = "config.json"  # OLMo-core's experiment config in each checkpoint; the HF Trainer's model config
LATEST = "latest_checkpointed_iteration.txt"  # veRL's (and Megatron's) pointer to the newest step
RELEASE = "release"  # what that pointer says of Megatron-LM's release/ folder
# A model's Hugging Face files besides its weights (config, generation config, tokenizer), which trainers
# keep beside their checkpoints: what `--format hf` takes with no flag...
HF_MODEL_FILES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
# ...but for those describing other weights or the run: an index of weights (an export writes its own), a
# PEFT adapter's config (no adapter is exported), the HF Trainer's own state and the metrics its
# train()/evaluate() leave in output_dir.
NOT_HF_MODEL_FILES = ("adapter_config.json", "trainer_state.json", "all_results.json", "train_results.json",
                      "eval_results.json", "test_results.json")


def hf_model_file(name: str) -> bool:
    """Whether a file of this name beside a checkpoint is one of its model's Hugging Face files."""
    return name.endswith(HF_MODEL_FILES) and not name.endswith(".index.json") and name not in NOT_HF_MODEL_FILES


@dataclass
class Source:
    """One checkpoint: its format (a registry name) and its units of work, in order."""

    format: str
    units: list[str]
    storage_options: StorageOptions | None = None
    side_files: list[str] = field(default_factory=list)  # the run's config: copied beside the export
    trainer: str | None = None  # the trainer whose resume files it has (read/resume.py)
    resume_files: dict[str, str] = field(default_factory=dict)  # their output names -> their paths

    @property
    def folder(self) -> str:
        """The folder every file of the checkpoint is in: where it was found."""
        return "/".join(os.path.commonprefix([u.split("/")[:-1] for u in self.units]))

    def spec(self, encode_key: Any, strict: bool = False) -> CheckpointSpec:
        spec, unit = self.plan(encode_key, strict)
        if unit is not None:
            unit.close()
        return spec

    def plan(self, encode_key: Any, strict: bool = False) -> tuple[CheckpointSpec, Unit | None]:
        """The spec, and the unit planning had to open whole to make it (rank 0 of per-rank files), left
        open for the caller, who owns it: ingesting it from there reads that file once, not twice."""
        from .registry import get

        spec, unit = get(self.format).plan(self, encode_key, strict)
        if self.side_files:
            spec.extra["side_files"] = {name_of(f): _side_file(f, self.storage_options) for f in self.side_files}
        if self.trainer is not None:
            spec.extra["trainer"] = self.trainer
            spec.extra["resume_files"] = {name: _side_file(f, self.storage_options)
                                          for name, f in self.resume_files.items()}
        return spec, unit


def open_source(src: str | os.PathLike[str], tag: str | None = None, step: int | None = None,
                storage_options: StorageOptions | None = None) -> Source:
    """The checkpoint in folder `src`, whichever format it is in: `src` itself, the newest one its own
    pointer names, or one of its sub-folders (a run folder of step folders: `--tag` or `--step` picks
    one, and two are never mixed, whatever their formats); else rank files (read/rankfile.py)."""
    from .registry import fallback, folder_formats

    src = os.fspath(src)
    for fmt in folder_formats():
        if fmt.detect(src, storage_options):
            _one_checkpoint(src, fmt.title, storage_options)
            return fmt.source(src, storage_options)
    for fmt in folder_formats():
        up = getattr(fmt, "unit_folder_of", lambda folder: None)(src)
        if up is not None and fmt.detect(up, storage_options):
            return fmt.source(up, storage_options)  # given the sub-folder its files are in (veRL's actor/)
    if tag in (None, "latest") and step is None:
        for fmt in folder_formats():
            newest = fmt.latest(src, storage_options)
            if newest is not None:
                return fmt.source(newest, storage_options)
    below: dict[str, Format] = {}
    for name in subfolders(src, storage_options):
        sub = join(src, name)
        found = next((f for f in folder_formats() if f.detect(sub, storage_options)), None)
        if found is not None:
            below[name] = found
    if below:
        name = pick(src, list(below), tag, step)
        return below[name].source(join(src, name), storage_options)
    return fallback().find(src, tag, step, storage_options)  # type: ignore[attr-defined]


def _one_checkpoint(src: str, title: str, storage_options: StorageOptions | None) -> None:
    """Refuse a folder that holds a checkpoint in a folder format beside rank files of another: an export
    written into the checkpoint's own folder (a model.safetensors, a DCP .metadata) would otherwise be
    taken for the checkpoint the next time, in place of the rank files."""
    from .layouts import name_rank

    ranked = sorted(name_of(p) for p in listing(src, storage_options) if name_rank(name_of(p)) is not None)
    if ranked:
        raise CheckpointError(f"{src}: holds two checkpoints, {title} files and rank files ({ranked[0]}"
                              f"{' ...' if len(ranked) > 1 else ''}); move one of them out (an export written "
                              f"into the checkpoint's own folder?)")


def source_of_files(files: list[str | os.PathLike[str]], storage_options: StorageOptions | None = None) -> Source:
    """The checkpoint some of whose unit files are given (`shardstore ingest STORE FILE...`), or the one in
    the folder given alone."""
    from .registry import formats

    names = [os.fspath(f) for f in files]
    if len(names) == 1 and not names[0].endswith((".pt", ".distcp", ".safetensors")) \
            and (is_url(names[0]) or os.path.isdir(names[0])):
        return open_source(names[0], storage_options=storage_options)
    for fmt in formats():
        found = fmt.of_files(names, storage_options)
        if found is not None:
            return found
    raise CheckpointError(f"{names[0] if names else 'no files'}: not the unit files of a checkpoint shardstore reads")


def open_unit(format: str, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: Any,
              facts: dict[str, Any] | None = None) -> Unit:
    """Open one unit of work of a checkpoint of `format` (in a worker). `facts` are what the store kept
    of the checkpoint when it was planned (the manifest's extra)."""
    from .registry import get

    return get(format).open_unit(path, storage_options, strict, encode_key, facts or {})


# ---------------------------------------------------------------------------------------------- shared
def name_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path.rstrip("/\\"))


def folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if is_url(path) else os.path.dirname(path)


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


def join(folder: str, name: str) -> str:
    """`name` inside `folder`, a URL or a local path (file:// URLs become plain paths)."""
    return f"{folder.rstrip('/')}/{name}" if is_url(folder) else os.path.join(local(folder), name)


def listing(folder: str, storage_options: StorageOptions | None) -> list[str]:
    """The paths of the files in `folder` (empty if it does not exist)."""
    if is_url(folder):
        fs, base = filesystem(folder, storage_options)
        return [join(folder, p.rstrip("/").rsplit("/", 1)[-1])
                for p in (fs.ls(base, detail=False) if fs.isdir(base) else [])]
    folder = local(folder)
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder))] if os.path.isdir(folder) else []


def subfolders(src: str, storage_options: StorageOptions | None) -> list[str]:
    """The names of `src`'s sub-folders, sorted (none if `src` is not a folder)."""
    if is_url(src):
        fs, base = filesystem(src, storage_options)
        if not fs.isdir(base):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False) if fs.isdir(p))
    root = local(src)
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))


def config_files(folder: str, storage_options: StorageOptions | None, *names: str) -> list[str]:
    """Those of `names` (default: the run's config.yaml) that are files in `folder`."""
    there = listing(folder, storage_options)
    return [join(folder, n) for n in (names or (CONFIG,)) if join(folder, n) in there]


def _side_file(path: str, storage_options: StorageOptions | None) -> str:
    """A small file of the run (config.yaml), base64, for the manifest: exports write it back unchanged."""
    from .container import read_small

    return base64.b64encode(read_small(path, storage_options, MAX_SIDE_FILE, "a run's config")).decode()
