"""The read contract's conformance suite (in the spirit of zarr's `StoreTests`): every checkpoint format's
tests subclass `FormatTests` and provide two fixtures,

    checkpoint  a folder holding one checkpoint of the format, as its trainer wrote it;
    foreign     a unit file of another checkpoint of the same format;

and so show, on real files, what the rest of shardstore relies on (read/contract.py): the spec tiles
every array exactly once; each unit's pieces are the boxes the spec says it holds; any order or subset of
units gives the same store; a unit of another checkpoint is refused by the worker that opens it; `watch`
takes every unit of the folder as it stands, or the format refuses it by name.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import numpy as np
import pytest

import shardstore
from shardstore import values
from shardstore.errors import CheckpointError
from shardstore.ingest import IngestOptions, ingest_file
from shardstore.read.arrival import Looks
from shardstore.read.contract import ArrayLeaf, ShardedSpec
from shardstore.read.discover import arriving, open_source, open_unit, spec_of
from shardstore.read.registry import get


def _digests(folder: Path) -> dict[str, str]:
    """Every data and metadata file of a store (commit records aside: they name their source file)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "/ranks/" not in str(p) and "manifest" not in p.name}


def _coverage(array: ShardedSpec) -> np.ndarray:
    """How many distinct boxes (replicas counted once) cover each element."""
    count = np.zeros(math.prod(array.shape) if array.flat else array.shape, dtype=np.int32)
    for offsets, sizes in {(s.offsets, s.sizes) for s in array.shards}:
        count[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
    return count


class FormatTests:
    @pytest.fixture
    def checkpoint(self) -> Path:
        raise NotImplementedError

    @pytest.fixture
    def foreign(self) -> Path:
        raise NotImplementedError

    def test_the_spec_tiles_every_array_exactly_once(self, checkpoint: Path) -> None:
        spec = spec_of(open_source(checkpoint), values.encode)
        assert spec.arrays, "a checkpoint with no arrays tests nothing"
        for path, array in spec.arrays.items():
            coverage = _coverage(array)
            assert coverage.min() == 1 and coverage.max() == 1, f"{path}: boxes cover elements {coverage.min()}" \
                                                                f"..{coverage.max()} times"

    def test_each_units_pieces_are_the_boxes_the_spec_gives_one_holder(self, checkpoint: Path) -> None:
        """A unit holds exactly the boxes the spec lists for one holder (how formats number holders
        differs: a rank, a rank within its replica group, a unit), and every box is held by some unit."""
        source = open_source(checkpoint)
        spec = spec_of(source, values.encode)
        unheld = {(p, s.offsets, s.sizes) for p, a in spec.arrays.items() for s in a.shards}
        for path in source.units:
            unit = open_unit(source.format, path, None, False, values.encode, spec.facts.reader_view())
            try:
                for leaf_path, leaf in unit.leaves.items():
                    if not isinstance(leaf, ArrayLeaf) or leaf_path in spec.replicated:
                        continue
                    held = sorted((p.offsets, p.sizes) for p in leaf.pieces if all(p.sizes))
                    if not held:
                        continue
                    holders: dict[int, list] = {}
                    for s in spec.arrays[leaf_path].shards:
                        holders.setdefault(s.rank, []).append((s.offsets, s.sizes))
                    assert held in [sorted(b) for b in holders.values()], \
                        f"{path}: {leaf_path}: holds {held}, which is no holder's share in the spec"
                    unheld -= {(leaf_path, o, n) for o, n in held}
            finally:
                unit.close()
        assert not unheld, f"boxes no unit holds: {sorted(unheld)[:3]}"

    def test_any_order_or_subset_of_units_gives_the_same_store(self, checkpoint: Path, tmp_path: Path) -> None:
        source = open_source(checkpoint)
        shardstore.ingest(tmp_path / "forward", source, jobs=1)
        units = source.units[::-1]
        half = max(1, len(units) // 2)
        shardstore.ingest(tmp_path / "backward", units[:half], jobs=1)
        assert len(shardstore.open(tmp_path / "backward").status().ranks_done) == half
        shardstore.ingest(tmp_path / "backward", units[half:] + units[:1], jobs=2)  # one again: same bytes
        assert shardstore.open(tmp_path / "backward").status().ok
        assert _digests(tmp_path / "forward") == _digests(tmp_path / "backward")

    def test_a_unit_of_another_checkpoint_is_refused(self, checkpoint: Path, foreign: Path, tmp_path: Path) -> None:
        source = open_source(checkpoint)
        store = shardstore.ingest(tmp_path / "s", source.units[:1], jobs=1)
        before = _digests(tmp_path / "s")
        with pytest.raises(CheckpointError, match=foreign.name):
            ingest_file(store, foreign, IngestOptions(format=source.format))
        assert _digests(tmp_path / "s") == before

    def test_arrivals_take_the_checkpoint_or_refuse_it_by_name(self, checkpoint: Path, tmp_path: Path) -> None:
        """What `watch` sees of the folder as it stands, complete: after two looks (a file must hold still
        between them) every unit file is ready and none twice, under the format the folder is read as; or
        the format refuses on the first look, naming the folder and itself, and `watch` leaves no store."""
        source = open_source(checkpoint)
        fmt = get(source.format)
        looks = Looks()
        try:
            arriving(str(checkpoint), None, looks)
        except CheckpointError as e:
            assert str(e).startswith(f"{checkpoint}: a checkpoint in the {fmt.title} format; watch takes")
            with pytest.raises(CheckpointError, match=re.escape(f"in the {fmt.title} format")):
                shardstore.watch(tmp_path / "s", checkpoint, timeout=5, jobs=1)
            assert not (tmp_path / "s").exists()
            return
        arrived = arriving(str(checkpoint), None, looks)
        assert arrived.source.format == source.format
        paths = [p for p, _ in arrived.ready]
        assert sorted(paths) == sorted(u for u in source.units if not u.endswith(".pt") or fmt.ranked)
        assert len({n for _, n in arrived.ready}) == len(paths)
