"""The files the HF Trainer and Accelerate save beside a sharded model and optimizer, to resume from.

transformers' `Trainer._save_checkpoint` writes `scheduler.pt`, `rng_state_{process}.pth` (`rng_state.pth`
in a one-process run), `trainer_state.json`, `training_args.bin` and, under AMP, `scaler.pt`; Accelerate's
`save_state` writes `scheduler.bin` (`scheduler_{i}.bin`), `sampler.bin`, `scaler.pt`,
`random_states_{process}.pkl` and `custom_checkpoint_{i}.pkl`. None of them is unpickled here: they are
kept byte for byte and `--format torch` writes them back under the names a one-process resume reads
(rank 0's RNG state), beside the unsharded weights and optimizer (export/torch.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ... import jsonin
from ...errors import CheckpointError
from ...locations import StorageOptions, join, listing, name_of
from ..primitives.container import TorchZip, read_small
from ...trainers import hf_trainer
from ..source import MAX_SIDE_FILE, check_step

TRAINER_STATE = "trainer_state.json"
TRAINER_FILES = ("scheduler.pt", "scaler.pt", "training_args.bin", TRAINER_STATE)
TRAINER_RNG = ("rng_state.pth", "rng_state_0.pth")  # a one-process run's, else process 0's
# Only `_save_checkpoint` writes the RNG states, and it writes trainer_state.json after them
TRAINER_ONLY = re.compile(r"rng_state(?:_[0-9]+)?\.pth\Z")
ACCELERATE_FILES = re.compile(r"(?:(?:scheduler|sampler|dl_state_dict)(?:_[0-9]+)?\.bin|scaler\.pt|custom_checkpoint_[0-9]+\.pkl)\Z")
ACCELERATE_RNG = "random_states_0.pkl"
# Every process saves its own RNG state (a one-process Trainer run: rng_state.pth, unnumbered)
NUMBERED_RNG = {"rng_state_0.pth": re.compile(r"rng_state_[0-9]+\.pth\Z"),
                ACCELERATE_RNG: re.compile(r"random_states_[0-9]+\.pkl\Z")}
TORCH_SAVED = (".pt", ".pth", ".bin")  # torch.save's zips (Accelerate's .pkl files are plain pickles)


@dataclass(frozen=True)
class Resume:
    trainer: str  # "hf-trainer" or "accelerate": which torch files `--format torch` writes
    files: dict[str, str]  # output name -> the file of the checkpoint written under it


def resume_files(folder: str, storage_options: StorageOptions | None = None) -> Resume | None:
    """What the HF Trainer (its trainer_state.json says so) or Accelerate's save_state (its RNG states)
    left in `folder` beside the model and optimizer; None for a folder of neither."""
    there = {name_of(p): p for p in listing(folder, storage_options)}
    if TRAINER_STATE in there:
        _check_step(folder, there[TRAINER_STATE], storage_options)
        _process_zero(folder, there, "rng_state_0.pth")
        files = {name: there[name] for name in TRAINER_FILES if name in there}
        rng = next((there[name] for name in TRAINER_RNG if name in there), None)
        return _whole(Resume("hf-trainer", files | ({"rng_state.pth": rng} if rng else {})), storage_options)
    rng = next((name for name in sorted(there) if TRAINER_ONLY.match(name)), None)
    if rng is not None:
        raise CheckpointError(f"{join(folder, TRAINER_STATE)}: missing beside the HF Trainer's {rng} (the Trainer "
                              f"writes it after them: this save did not finish, and the Trainer cannot resume from it)")
    _process_zero(folder, there, ACCELERATE_RNG)
    if ACCELERATE_RNG in there:
        return _whole(Resume("accelerate", {name: path for name, path in there.items()
                                            if ACCELERATE_FILES.match(name) or name == ACCELERATE_RNG}), storage_options)
    return None


def _process_zero(folder: str, there: dict[str, str], first: str) -> None:
    """Process 0's RNG file (`first`) is there when other processes' are: it is the one a resume reads and an
    export writes. Without it the folder is a save that did not finish or a copy that lost a file, and
    would be exported in another form (or without it) as if whole."""
    others = sorted(name for name in there if NUMBERED_RNG[first].match(name))
    if others and first not in there:
        raise CheckpointError(f"{join(folder, first)}: missing beside {', '.join(others)} (every process "
                              f"saves its own: this save is not whole)")


def _whole(resume: Resume, storage_options: StorageOptions | None) -> Resume:
    """`resume`, its torch.save files (scheduler.pt, rng_state.pth, training_args.bin, Accelerate's .bin)
    checked to be whole: a zip whose every record passes its CRC-32. They are never unpickled and an export
    copies them as they are, so a truncated or torn one would otherwise be written out as if sound."""
    for path in resume.files.values():
        if path.endswith(TORCH_SAVED):
            with TorchZip(path, storage_options) as saved:
                for name in saved.entries:
                    saved.verify(name)
    return resume


def _check_step(folder: str, path: str, storage_options: StorageOptions | None) -> None:
    """The Trainer names checkpoint-N/ by the global_step its trainer_state.json records: a folder whose
    state says another step holds files of two saves (a copy into an older one), and is refused."""
    state = jsonin.loads(read_small(path, storage_options, MAX_SIDE_FILE, "the HF Trainer's trainer_state.json"),
                         path, "the HF Trainer's trainer_state.json", CheckpointError)
    step = state.get("global_step") if isinstance(state, dict) else None
    if type(step) is not int:
        raise CheckpointError(f"{path}: not the HF Trainer's trainer_state.json (no global_step)")
    check_step(path, "global_step", step, folder, hf_trainer.STEPS.exact)
