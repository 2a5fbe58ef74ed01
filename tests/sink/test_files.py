"""The direct writer finds the targets a piece meets without visiting every target of its array."""

from __future__ import annotations

import errno
import fcntl
import itertools
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from shardstore.sink.files import DirectWriter, _Bands, _runs
from shardstore.sink.layout import Layout, Sketch, Target
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


@pytest.mark.parametrize("seed", range(60))
def test_a_boxs_runs_are_its_elements_in_the_target_element_by_element(seed: int) -> None:
    """Each run `_runs` gives, spelt out element by element, is where numpy puts the piece's elements in
    the target's box: every element of the overlap once, in C order, at its place in both."""
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 4)))
    entry = ArrayEntry("w", "float32", shape, shape, shape, staged=False)
    whole = np.arange(math.prod(shape)).reshape(shape)
    for _ in range(10):
        boxes = []
        for _ in range(2):
            offsets = tuple(rng.randrange(n) for n in shape)
            boxes.append((offsets, tuple(rng.randint(1, n - o) for n, o in zip(shape, offsets))))
        (p_off, p_size), (t_off, t_size) = boxes
        piece, target = _Piece(p_off, p_size), Target(0, 0, (t_off, t_size), "float32")
        held = whole[tuple(slice(o, o + n) for o, n in zip(p_off, p_size))].reshape(-1)
        got = {}
        for first, count, out_at in _runs(entry, piece, target):
            for i in range(count):
                got[out_at + i] = held[first + i]
        lo = [max(a, b) for a, b in zip(p_off, t_off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(p_off, p_size, t_off, t_size)]
        want = {}
        if all(a < b for a, b in zip(lo, hi)):
            for index in np.ndindex(*(b - a for a, b in zip(lo, hi))):
                at = tuple(a + i for a, i in zip(lo, index))
                want[int(np.ravel_multi_index(tuple(a - o for a, o in zip(at, t_off)), t_size))] = whole[at]
        assert got == want


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


def test_a_part_of_a_layout_places_its_paths_alone_under_the_whole_ones_digest() -> None:
    """A task is sent the places of what its units hold (`Layout.part`); the journal records it writes
    name the whole layout, as a task sent all of it would."""
    targets = {p: (Target(i % 2, 64 * i, None, "float32"),) for i, p in enumerate("abcdef")}
    layout = Layout("/out", ("x", "y"), (512, 512), targets)
    part = layout.part(["e", "b", "z"])
    assert part.targets == {"e": targets["e"], "b": targets["b"]}
    nested = Layout("/out", ("x",), (64,), {"m/a": targets["a"], "m/b/c": targets["b"], "mm": targets["c"]})
    assert set(nested.part([], frozenset(["m"])).targets) == {"m/a", "m/b/c"}
    assert (part.names, part.sizes, part.folder) == (layout.names, layout.sizes, layout.folder)
    assert part.digest == layout.digest != Layout("/out", ("x", "y"), (512, 512), part.targets).digest


# ------------------------------------------------------------------ one output file at a time

@dataclass(frozen=True)
class _Rows:
    """A piece whose bytes are in memory: rows `offsets[0]`.. of a float32 array."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: bytes

    def rows(self, first: int, count: int) -> bytes:
        row = len(self.data) // self.sizes[0]
        return self.data[first * row:(first + count) * row]

    def crc(self) -> None:
        return None


def _two_files(tmp_path: Path) -> DirectWriter:
    """A writer laying two arrays into two files: `big` (8 rows) into file 0, `small` (2 rows) into file 1."""
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"\0" * 64)
    big = ArrayEntry("big", "float32", (8, 1), (8, 1), (8, 1), staged=False)
    small = ArrayEntry("small", "float32", (2, 1), (2, 1), (2, 1), staged=False)
    lay = Layout(str(tmp_path), ("a", "b"), (64, 64), {"big": (Target(0, 0, None, "float32"),),
                                                       "small": (Target(1, 8, None, "float32"),)})
    writer = DirectWriter(lay)
    writer.piece(big, _Rows((0, 0), (8, 1), bytes(range(1, 33))))
    writer.piece(small, _Rows((0, 0), (2, 1), bytes(range(101, 109))))
    return writer


def _held_elsewhere(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_the_file_with_most_to_write_comes_first_unless_another_writer_holds_it(tmp_path: Path) -> None:
    writer = _two_files(tmp_path)
    assert writer._next_file(writer._bytes_to_go()) == (0, True)  # the 32 bytes of `big` before the 8 of `small`
    writer.close()
    writer = _two_files(tmp_path)
    other = _held_elsewhere(tmp_path / "a")  # another worker is writing file 0
    try:
        assert writer._next_file(writer._bytes_to_go()) == (1, True)
        writer.close()
        writer = _two_files(tmp_path)
        also = _held_elsewhere(tmp_path / "b")
        try:  # every file held: the largest, written anyway (waiting would idle this worker)
            assert writer._next_file(writer._bytes_to_go()) == (0, False)
        finally:
            os.close(also)
    finally:
        os.close(other)
        writer.close()


def test_a_flush_writes_every_file_and_lets_go_of_its_locks(tmp_path: Path) -> None:
    writer = _two_files(tmp_path)
    other = _held_elsewhere(tmp_path / "b")
    try:
        writer.flush()
    finally:
        os.close(other)
    assert (tmp_path / "a").read_bytes()[:32] == bytes(range(1, 33))
    assert (tmp_path / "b").read_bytes()[8:16] == bytes(range(101, 109))
    for name in ("a", "b"):  # another worker can take either file now
        os.close(_held_elsewhere(tmp_path / name))
    assert not writer._pending
    writer.close()


def test_without_locks_the_pieces_are_still_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A network file system mounted without flock: the order is only a hint, so nothing depends on it."""
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    writer = _two_files(tmp_path)
    writer.flush()
    assert (tmp_path / "a").read_bytes()[:32] == bytes(range(1, 33))
    assert (tmp_path / "b").read_bytes()[8:16] == bytes(range(101, 109))
    writer.close()


def test_pieces_of_a_unit_that_failed_before_its_flush_are_never_written(tmp_path: Path) -> None:
    writer = _two_files(tmp_path)
    writer.close()
    writer.flush()
    assert (tmp_path / "a").read_bytes() == b"\0" * 64


def test_a_sketch_placed_again_holds_its_runs_with_the_patches_over_them() -> None:
    """`Sketch.runs` applies later writes over earlier ones and joins adjacent ones; `place` puts those runs
    at the sketch's position with patches written over them, leaving the runs they miss shared."""
    alone = Sketch()
    alone.write(b"header--")
    alone.skip(4)  # a hole
    alone.write(b"tail")
    alone.write(b"-more")
    alone.pwrite(b"HE", 0)  # a CRC patched into the header
    runs = alone.runs()
    assert runs == [(0, b"HEader--"), (12, b"tail-more")]

    def image(sketch: Sketch) -> bytes:
        out = bytearray(sketch.pos)
        for at, data in sketch.writes:
            out[at:at + len(data)] = data
        return bytes(out)

    twice = Sketch()
    twice.write(b"xy")
    twice.place(runs, alone.pos)
    twice.place(runs, alone.pos, [(13, b"A"), (2, b"!")])
    assert image(twice) == b"xy" + b"HEader--\0\0\0\0tail-more" + b"HE!der--\0\0\0\0tAil-more"
    assert twice.writes[1][1] is runs[0][1]  # not patched: the same bytes object
