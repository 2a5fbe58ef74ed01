"""A trainer's conventions: the third axis, beside the input formats (read/) and the output formats (export/).

A checkpoint's format says how its bytes are laid out; its trainer (OLMo, Composer, the HF Trainer,
Accelerate, Lightning, torch DCP's own nesting) says what its tree means: where the model sits, which
torch files `--format torch` must write for the trainer to resume without FSDP, what the model's names
carry. The store records which trainer's nesting a checkpoint has (`Manifest.layout`, decided at
planning by `registry.detect`); every later question about it is asked of that `Trainer`.

A trainer knows names and files, not bytes: its `resume_files` name subtrees of the store's tree, and
its `form`s reshape a state dict's keys (an optimizer's, keyed by parameter number), never a tensor.

A trainer also names a run's checkpoints by step and points at the newest (`Steps`). Trainers whose
checkpoints are read through a format of their own (Megatron-LM, DeepSpeed, veRL, torchtitan) have only
that here: a module defining `STEPS`.

A new trainer is one module defining its `TRAINER` (or only its `STEPS`), one line in registry.py, and a
conformance subclass (tests/trainers/conformance.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from ..tree import Node

Form = Callable[[Any], Any]  # what a torch file holds, shaped as its trainer saves it


class Reader(Protocol):
    """What a trainer may ask of the checkpoint's input format (read/contract.py `Format` has these)."""

    any_script: bool  # any script's own save: its nesting is the script's
    shares_folder: bool  # several saves may share one folder (per-rank files), rather than a folder each


@dataclass(frozen=True)
class ResumeFile:
    """One torch file a trainer resumes from, and what of the tree it holds."""

    name: str
    node: Node
    dropped: tuple[str, ...] = ()  # top-level keys left out
    plain_dicts: bool = False  # OrderedDicts written as dicts (what OLMo's unsharder returns)
    form: Form | None = None  # the trainer's own shape of it


@dataclass(frozen=True)
class Steps:
    """How a trainer names a run's checkpoints by step, and what in the run folder points at the newest.

    `name` is a regex of one checkpoint's name (its folder, or the file-name prefix of rank files sharing a
    folder) whose one group is the step, in ASCII digits. `latest` is the name of the pointer in the run
    folder, and `points` says how it points: "link" (a link to the newest checkpoint), "step" (a file whose
    text is the newest step, or "release"), "tag" (a file whose text is the newest checkpoint's name).
    `marker` is a file the trainer writes into a checkpoint after every other (`follow` waits for it).
    """

    name: str
    latest: str = ""
    points: Literal["", "link", "step", "tag"] = ""
    marker: str = ""
    exact: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        exact = re.compile(rf"\A(?:{self.name})\Z")
        if exact.groups != 1 or bool(self.latest) != bool(self.points):
            raise ValueError(f"{self.name!r}: a step name has one group; a pointer says how it points")
        object.__setattr__(self, "exact", exact)

    def step(self, name: str) -> int | None:
        """The step `name` says, when it is exactly this trainer's name of a checkpoint."""
        m = self.exact.match(name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Trainer:
    """One trainer's conventions, as frozen data (the registry lists them)."""

    name: str  # as the store's manifest records it (`Manifest.layout`)
    title: str  # what `status` says of its nesting
    # where its model may sit in the tree (store paths, the first there wins; none there: the root)
    model: tuple[str, ...]
    # whether a tree of a checkpoint of no known trainer's folder is this trainer's, read by `Reader`
    recognises: Callable[[Node, Reader | None], bool]
    # the torch files `--format torch` writes for it to resume from: (tree, one file per rank); None: one
    # checkpoint.pt of the whole state in the input's nesting
    resume_files: Callable[[Node, bool], list[ResumeFile] | None]
    writes: str = ""  # a regex of every name its `resume_files` may give (an earlier export's files in OUT)
    rng_per_rank: bool = False  # its `rng` list holds this rank file's state: the ranks' lists joined, in order
    module_prefix: bool = False  # its model's names start with the attribute of the module holding the model
    steps: Steps | None = None  # how its runs name their checkpoints (None: by the script, freely)


def never(tree: Node, reader: Reader | None) -> bool:
    """For a trainer known only from the files beside its checkpoint (read/formats/resume.py)."""
    return False


def one_file(tree: Node, ranked: bool) -> list[ResumeFile] | None:
    """For a trainer with no files of its own: one checkpoint.pt of the whole state."""
    return None


def top_keys(tree: Node) -> set[str]:
    return {child.path for _, child in tree.children}
