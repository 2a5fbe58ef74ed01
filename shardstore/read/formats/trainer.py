"""OLMo's per-rank trainer state, `train/rank{r}.pt`, beside a checkpoint whose tensors are elsewhere.

OLMo's `torch_new`, `local` and `olmo_core` checkpointers (and OLMo-core's trainer) save the model and
optimizer in their own files and the trainer state (step, data position, RNG states, run paths) as one
plain torch.save per rank. Those values join the state dict's top level, beside `model` and `optim`, so
the torch export's train.pt comes from rank 0, as OLMo's unsharders take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import paths
from ...errors import CheckpointError
from ...locations import StorageOptions, folder_of, join, listing, name_of
from ...tree import KeyEncoder, Node
from ..contract import PlannedCheckpoint
from ..layouts import name_rank
from ..primitives.container import TorchZip
from ...trainers import olmo
from ..source import check_step
from ..unit import Place, check_leaves
from . import lightning
from .rankfile import RankFile, ShardedLeaf, read_rank_file

TRAIN = "train"


def trainer_files(checkpoint: str, storage_options: StorageOptions | None = None) -> list[str]:
    """`train/rank{r}.pt` under the checkpoint folder, in rank order (empty when there are none); a rank
    missing below the highest is refused by name (rank 0's is the one whose state is exported)."""
    found = listing(join(checkpoint, TRAIN), storage_options)
    ranked = {rank: f for f in found if f.endswith(".pt") and (rank := name_rank(f)) is not None}
    missing = next((r for r in range(max(ranked, default=-1) + 1) if r not in ranked), None)
    if missing is not None:
        raise CheckpointError(f"{join(join(checkpoint, TRAIN), f'rank{missing}.pt')}: missing, beside "
                              f"{name_of(ranked[max(ranked)])} (an unfinished or damaged save)")
    return [ranked[r] for r in sorted(ranked)]


@dataclass
class TrainerUnit:
    """One rank's trainer-state file: values only, numbered after the checkpoint's other units."""

    path: str
    rank: int
    world_size: int
    group_rank: int
    group_size: int
    digest: str
    rf: RankFile
    under: str = ""  # the key its values are kept under ("" for the top level)

    @property
    def leaves(self) -> dict[str, Any]:
        return {paths.join(self.under, k): v for k, v in self.rf.leaves.items()} if self.under else self.rf.leaves

    @property
    def size(self) -> int:
        return self.rf.size

    def value_zip(self, path: str) -> TorchZip:
        return self.rf.zip

    def identity(self) -> str:
        return self.rf.identity()

    def check(self, plan: PlannedCheckpoint) -> None:
        check_leaves(self, plan)

    def close(self) -> None:
        self.rf.close()


def open_trainer(path: str, place: Place, storage_options: StorageOptions | None, strict: bool,
                 encode_key: KeyEncoder, under: str = "", named: bool = False) -> TrainerUnit:
    """Open `path` as the unit at `place`; it must hold plain values only (kept under `under`, or at
    the top level: then it is a train/rank<N>.pt, or a file its format `named`, as Lightning's meta.pt)."""
    rf = read_rank_file(path, encode_key=encode_key, storage_options=storage_options, strict=strict)
    if (name_rank(path) is None and not under and not named) \
            or any(isinstance(leaf, ShardedLeaf) for leaf in rf.leaves.values()):
        rf.close()
        what = "a file of plain values" if under else "a trainer-state file (train/rank<N>.pt of plain values)"
        raise CheckpointError(f"{path}: not {what}")
    return TrainerUnit(path, place.index, place.count, place.index, place.count, place.digest, rf, under)


def join_trainer_state(tree: Node, objects: list[str], first: str, encode_key: KeyEncoder,
                       storage_options: StorageOptions | None, strict: bool, under: str = "") -> None:
    """Add the keys of trainer-state file `first` (rank 0's) to the top level of `tree`, as values, or
    the whole file under the key `under`."""
    rf = read_rank_file(first, encode_key=encode_key, storage_options=storage_options, strict=strict)
    try:
        _check_named_step(first, rf.leaves)
        mine = {child.path for _, child in tree.children}
        theirs = [(encode_key(under), moved(rf.skeleton, under))] if under else rf.skeleton.children
        if (rf.skeleton.kind not in ("dict", "odict") and not under) or mine & {child.path for _, child in theirs}:
            raise CheckpointError(f"{first}: its keys collide with the model and optimizer state")
        tree.children += theirs
        objects += [paths.join(under, p) for p in rf.leaves] if under else list(rf.leaves)
    finally:
        rf.close()


def _check_named_step(first: str, values: dict[str, Any]) -> None:
    """The step rank 0's trainer state records against the one its checkpoint's name says (the other ranks'
    are compared with rank 0's: store/onesave.py): Lightning's meta.pt (read/formats/lightning.py), OLMo's and
    OLMo-core's train/rank0.pt, whose global_step names their `step{N}/`."""
    if name_of(first) == lightning.META:
        lightning.check_steps(first, values)
    elif name_of(folder_of(first)) == TRAIN:
        check_step(first, "global_step", values.get("global_step"), folder_of(folder_of(first)), olmo.STEPS.exact)


def moved(node: Node, under: str) -> Node:
    """`node`, every store path below `under` (a tree the reader built: its depth is already bounded)."""
    return Node(node.kind, paths.join(under, node.path) if node.path else under,
                [(key, moved(child, under)) for key, child in node.children])
