"""What formats of one-file units share: one unit type for a file of pieces and values, the unit names
the store lists at plan time and the checks that place a file among them, and flat (FSDP1-style) specs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from .contract import ArrayLeaf, PlannedCheckpoint, ShardedSpec, ShardSpec
from .primitives.identity import container_identity


def relative(path: str) -> str:
    """"model/rank3.pt" from a unit's full path: how the store names units (extra["units"])."""
    return "/".join(path.rstrip("/").replace("\\", "/").split("/")[-2:])


def flat_spec(dtype: str, shape: tuple[int, ...], pieces: list[tuple[int, int, int]]) -> ShardedSpec:
    """A tensor whose pieces are (holder, first element, count) ranges of its flattened elements."""
    return ShardedSpec(dtype, shape, tuple(ShardSpec((lo,), (n,), r) for r, lo, n in pieces if n), flat=True)


def planned_place(name: str, path: str, facts: dict[str, Any], key: str, what: str) -> tuple[int, int]:
    """A unit file's number among the units the store was planned from (by `name`, as the plan lists
    them), and their count. A file the plan does not list, or a store another format planned (its facts
    have no `key`), is refused by name."""
    listed = facts.get("units", [])
    if name not in listed or key not in facts:
        raise CheckpointError(f"{path}: not a file of the {what} checkpoint the store holds")
    return listed.index(name), len(listed)


@dataclass(frozen=True)
class HeldPaths:
    """A unit's share that is only the store paths it can hold (`UnitShare`): its task is sent their part of
    the manifest, not the whole, which each worker otherwise read (DeepSeek-V3's structure: 92k arrays,
    38 MB of JSON, 250 MB in every worker)."""

    paths: tuple[str, ...]

    def store_paths(self) -> tuple[str, ...]:
        return self.paths

    def subtrees(self) -> tuple[str, ...]:
        return ()


@dataclass(frozen=True)
class Place:
    """Where a unit belongs: its number among the `count` units of its checkpoint, and the metadata digest
    of the save it is a unit of (what it is checked against)."""

    index: int
    count: int
    digest: str


@dataclass
class FileUnit:
    """One file of a checkpoint, opened and checked: its pieces (ArrayLeafs) and values, still on disk.
    `container` is the torch zip or safetensors file the tensors view."""

    path: str
    rank: int  # the unit's number in the checkpoint
    world_size: int
    group_rank: int
    group_size: int
    digest: str
    leaves: dict[str, Any]
    container: Any

    @property
    def size(self) -> int:
        size: int = self.container.size
        return size

    def value_zip(self, path: str) -> Any:
        return self.container

    def identity(self) -> str:
        return container_identity(self.container)

    def check(self, plan: PlannedCheckpoint) -> None:
        check_leaves(self, plan)

    def close(self) -> None:
        self.container.close()


def check_leaves(unit: Any, plan: PlannedCheckpoint) -> None:
    """A unit of a checkpoint whose files list their own pieces: of the same save as the plan's (its
    metadata digest), and every leaf one the plan has, an array of the plan's dtype and shape."""
    if unit.digest != plan.metadata:
        raise CheckpointError(f"{unit.path}: belongs to another {plan.title} checkpoint than the store's (its "
                              f"metadata differs from the one the store was planned from)")
    for path, leaf in unit.leaves.items():
        entry = plan.arrays.get(path)
        if entry is None and path not in plan.objects:
            raise CheckpointError(f"{unit.path}: holds {path}, which the checkpoint's plan does not have "
                                  f"(its state differs from the files the plan was read from)")
        if entry is not None and (not isinstance(leaf, ArrayLeaf) or (leaf.dtype, leaf.shape) != (entry.dtype, entry.shape)):
            got = f"{leaf.dtype}{list(leaf.shape)}" if isinstance(leaf, ArrayLeaf) else type(leaf).__name__
            raise CheckpointError(f"{unit.path}: {path} is {got} here but {entry.dtype}{list(entry.shape)} in the plan")
