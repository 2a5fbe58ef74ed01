"""FSDP1 flat parameters split back into the parameters they hold, from sizes alone.

With `use_orig_params=False` (veRL's default) an optimizer's state is per *flat* parameter: FSDP1
concatenates the parameters of each wrapped unit (no alignment padding without `use_orig_params`),
pads the whole to a multiple of the sharding group, and gives each rank one equal slice. The optimizer
file keeps no names, so which parameters a flat parameter holds has to be derived. veRL wraps a
transformers model by its decoder layers: the root unit holds every parameter outside them, in model
order, and each decoder layer (`….layers.{i}.…`) is a unit of its own, in order; the optimizer lists the
root's flat parameter first. That grouping is used only when it reproduces every flat parameter's slice
length exactly (`ceil(total / group)` per rank); anything else is not guessed at (the caller keeps the
flat vectors whole).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# A decoder layer's parameters, as transformers names them (model.layers.3., transformer.h.3., blocks.3.)
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.([0-9]+)\.")


@dataclass(frozen=True)
class Member:
    """One parameter inside a flat parameter."""

    name: str  # the model's key, as the store names it
    shape: tuple[int, ...]
    start: int  # its first element in the unsharded flat parameter
    key: Any  # the model's key, as the state dict has it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def split(params: list[tuple[str, tuple[int, ...]]], slice_numels: list[int], group: int,
          keys: dict[str, Any]) -> list[list[Member]] | None:
    """Each flat parameter's members, given the model's parameters in order (store names, with their
    state-dict `keys`) and each flat parameter's per-rank slice length; None unless the decoder-layer
    grouping matches every length."""
    root: list[tuple[str, tuple[int, ...]]] = []
    layers: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in params:
        m = LAYER.search(name)
        if m is None:
            root.append((name, shape))
        else:
            layers.setdefault(name[: m.end()], []).append((name, shape))
    units = ([root] if root else []) + list(layers.values())
    if len(units) != len(slice_numels):
        return None
    out = []
    for unit, numel in zip(units, slice_numels):
        total = sum(math.prod(shape) for _, shape in unit)
        if total == 0 or -(-total // group) != numel:
            return None
        members, start = [], 0
        for name, shape in unit:
            members.append(Member(name, shape, start, keys.get(name, name)))
            start += math.prod(shape)
        out.append(members)
    return out


def overlaps(members: list[Member], first: int, count: int) -> list[tuple[Member, int, int]]:
    """(member, its first element, count) for each member overlapping flat elements [first, first+count)."""
    out = []
    for m in members:
        lo, hi = max(first, m.start), min(first + count, m.start + m.numel)
        if lo < hi:
            out.append((m, lo - m.start, hi - lo))
    return out


def ragged(numels: list[int], lengths: dict[int, dict[int, int]], groups: list[list[int]]) -> \
        dict[int, list[tuple[int, int, int]]] | None:
    """With `use_orig_params=True` the optimizer keeps state per original parameter (keyed by its index in
    the model's parameter order), but each rank only the 1-D part of that parameter's elements its flat
    shard covers, and none where it covers none. Shards are consecutive, so within a replica group (ranks
    in shard order) a parameter's parts follow each other: (rank, first element, count) of each part, for
    every group, given each rank's `{index: count}`. A parameter no rank holds state for (frozen) has no
    parts. None unless every group's parts add up to every other parameter's size exactly and the groups
    hold the same parts."""
    out: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(numels))}
    first: list[list[int]] | None = None
    for group in groups:
        seen = [[lengths.get(r, {}).get(i, 0) for r in group] for i in range(len(numels))]
        if any(i not in range(len(numels)) for r in group for i in lengths.get(r, {})):
            return None
        if first is None:
            first = seen
        if seen != first or any(sum(parts) not in (0, n) for parts, n in zip(seen, numels)):
            return None
        for i, parts in enumerate(seen):
            start = 0
            for r, n in zip(group, parts):
                if n:
                    out[i].append((r, start, n))
                start += n
    return out
