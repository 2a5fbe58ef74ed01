"""One save, provably: the units of a store agree on every value that names the moment they were saved.

A folder can mix two saves of one run with the same shapes (a job that crashed while saving over
`latest/`, an interrupted copy); every file then passes its own checks, and only the values that every
rank of one save shares give the mix away: the optimizer's step and param_groups (its learning rate
moves every step), the trainer's step and epoch counters, DeepSpeed's global_steps and version, Composer's
timestamp. Those are compared across every unit's commit record, in a value's own path or inside a value
(a trainer state held as one dict). Values that genuinely differ per rank — RNG states, data-loader and
sampler positions — are never compared, wherever they sit.

Formats whose units share no such value (a DCP checkpoint's .distcp files hold each item once) are held
together by their own metadata instead: each unit is checked against the digest the store was planned
from.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterator

from ..errors import CheckpointError
from ..values import preview
from .manifest import CommitRecord

# The names trainers give the counters and settings that all ranks of one save share.
SAVE_NAMES = frozenset({
    "step", "global_step", "global_steps", "global_samples", "skipped_steps", "iteration", "epoch",
    "timestamp", "param_groups", "ds_version", "ds_config", "checkpoint_version", "global_train_tokens_seen",
    "global_train_examples_seen", "global_train_examples_seen_this_epoch", "consumed_train_samples",
    "num_floating_point_operations_so_far", "last_epoch", "_step_count",
})
# Parts of a state that differ per rank in a genuine save: never compared.
PER_RANK = re.compile(r"rng|random|data_?loader|sampler|dataset", re.IGNORECASE)
# A value is a few levels deep; a forged one gets no further than this.
MAX_DEPTH = 32


def stamps(path: str, encoded: Any) -> Iterator[tuple[str, Any]]:
    """(where, value) of every save-identifying part of the value at `path` (typed JSON, values.py)."""
    kind = _kind(path)
    if kind == "stamp":
        yield path, encoded
    elif kind == "look inside":
        yield from _inside(path, encoded, 0)


@functools.lru_cache(maxsize=1 << 16)
def _kind(path: str) -> str:
    """What a value's path says of it (the same paths recur in every unit of a save): a "stamp", a value
    to "look inside", or one that differs "per rank"."""
    parts = path.split("/")
    if any(PER_RANK.search(p) for p in parts):
        return "per rank"
    return "stamp" if any(p in SAVE_NAMES for p in parts) else "look inside"


def _inside(where: str, node: Any, depth: int) -> Iterator[tuple[str, Any]]:
    # a list's items are not named: nothing in them identifies a save by its name
    if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
        return
    ((tag, body),) = node.items()
    if tag not in ("$dict", "$odict") or not isinstance(body, list):
        return
    for pair in body:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            continue
        key, value = pair
        if PER_RANK.search(key):
            continue
        if key in SAVE_NAMES:
            yield f"{where}/{key}", value
        else:
            yield from _inside(f"{where}/{key}", value, depth + 1)


class OneSave:
    """The save-identifying values of the units seen so far (the first unit's of each), against which each
    further unit is checked. Kept across the units a worker ingests, each committed unit is added once:
    a unit's check costs its own values, whatever the world size."""

    def __init__(self) -> None:
        self.first: dict[str, tuple[str, Any]] = {}
        self.ranks: set[int] = set()

    def add(self, name: str, objects: dict[str, Any], rank: int | None = None) -> None:
        """Check a unit's values (typed JSON by store path) against those seen, and keep the new ones."""
        self._compare(name, objects, keep=True)
        if rank is not None:
            self.ranks.add(rank)

    def check(self, name: str, objects: dict[str, Any]) -> None:
        """Refuse a unit of another save than the units seen, naming two files and a value they disagree on."""
        self._compare(name, objects, keep=False)

    def add_records(self, records: dict[int, CommitRecord]) -> "OneSave":
        """Every committed unit not added yet, by rank."""
        for rank in sorted(records):
            if rank not in self.ranks:
                self.add(records[rank].file, records[rank].objects, rank)
        return self

    def _compare(self, name: str, objects: dict[str, Any], keep: bool) -> None:
        for path, encoded in objects.items():
            for where, value in stamps(path, encoded):
                seen = self.first.get(where)
                if seen is None:
                    if keep:
                        self.first[where] = (name, value)
                elif seen[1] != value:  # typed JSON: equal values, equal saves
                    raise CheckpointError(
                        f"{name} and {seen[0]} are from two different saves: {where} is {_short(value)} in "
                        f"{name} but {_short(seen[1])} in {seen[0]}; take every file from the same save")


def check_one_save(records: dict[int, CommitRecord]) -> None:
    """Refuse committed units of two saves (two that raced each other to commit), before an export."""
    OneSave().add_records(records)


def _short(value: Any) -> str:
    text = preview(value)
    return text if len(text) <= 60 else text[:57] + "..."
