"""The direct writer finds the targets a piece meets without visiting every target of its array."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from shardstore.sink.files import _Bands, _runs
from shardstore.sink.layout import Target
from shardstore.store.manifest import ArrayEntry


@dataclass(frozen=True)
class _Piece:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _grid_targets(shape: tuple[int, ...], cell: tuple[int, ...]) -> list[Target]:
    """One target per cell of a grid (a DCP export's items), in a shuffled order."""
    targets = []
    for index in itertools.product(*(range(0, n, c) for n, c in zip(shape, cell))):
        sizes = tuple(min(c, n - i) for i, c, n in zip(index, cell, shape))
        targets.append(Target(0, len(targets), (tuple(index), sizes), "float32"))
    random.Random(len(targets)).shuffle(targets)
    return targets


def _met(entry: ArrayEntry, piece: _Piece, targets: list[Target]) -> set[Target]:
    return {t for t in targets if _runs(entry, piece, t)}


@pytest.mark.parametrize("seed", range(40))
def test_a_box_meets_the_same_targets(seed: int) -> None:
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
    cell = tuple(rng.randint(1, n) for n in shape)
    entry = ArrayEntry("w", "float32", shape, cell, cell, staged=False)
    targets = _grid_targets(shape, cell)
    bands = _Bands(entry, tuple(targets))
    for _ in range(20):
        offsets = tuple(rng.randrange(n) for n in shape)
        piece = _Piece(offsets, tuple(rng.randint(1, n - o) for n, o in zip(shape, offsets)))
        near = bands.near(entry, piece)
        assert _met(entry, piece, near) == _met(entry, piece, targets)
        if len(shape) == 1 and len(targets) > 8 and piece.sizes[0] <= cell[0]:
            assert len(near) <= 3  # the point of it: a small piece is not compared with every cell


@pytest.mark.parametrize("seed", range(40))
def test_an_element_range_of_a_flat_array_meets_the_same_targets(seed: int) -> None:
    rng = random.Random(seed)
    shape = (rng.randint(1, 50), rng.randint(1, 7))
    rows = rng.randint(1, shape[0])
    entry = ArrayEntry("w", "float32", shape, (rows, shape[1]), (rows, shape[1]), staged=False, flat=True)
    targets = _grid_targets(shape, (rows, shape[1]))
    bands = _Bands(entry, tuple(targets))
    total = shape[0] * shape[1]
    for _ in range(20):
        start = rng.randrange(total)
        piece = _Piece((start,), (rng.randint(1, total - start),))
        assert _met(entry, piece, bands.near(entry, piece)) == _met(entry, piece, targets)


def test_whole_array_targets_and_scalars_are_always_near() -> None:
    whole = Target(0, 0, None, "float32")
    entry = ArrayEntry("w", "float32", (10, 4), (5, 4), (5, 4), staged=False)
    assert _Bands(entry, (whole,)).near(entry, _Piece((7, 0), (3, 4))) == [whole]
    scalar = ArrayEntry("s", "float32", (), (), (), staged=False)
    assert _Bands(scalar, (whole,)).near(scalar, _Piece((), ())) == [whole]
