"""Planning: cells cut at every shard boundary (one writer each), tiling checked, small tensors staged."""

from __future__ import annotations

import math

import pytest

from shardstore.errors import CheckpointError
from shardstore.plan import CHUNK_TARGET_BYTES, plan_array
from shardstore.read.contract import ShardedSpec, ShardSpec


def fsdp_spec(shape: tuple[int, ...], world: int, dtype: str = "float32") -> ShardedSpec:
    """The layout torch's FSDP gives: torch.chunk along dim 0, trailing ranks possibly empty."""
    step = -(-shape[0] // world)
    shards = [ShardSpec((r * step,) + (0,) * (len(shape) - 1), (min(step, shape[0] - r * step),) + shape[1:], r)
              for r in range(world) if r * step < shape[0]]
    return ShardedSpec(dtype, shape, tuple(shards))


@pytest.mark.parametrize("shape, world", [((50304, 2048), 8), ((1000, 4096), 6), ((5, 4096, 64), 8), ((3000007,), 3)])
def test_fsdp_layouts_get_one_cell_per_rank(shape, world) -> None:
    entry = plan_array("w", fsdp_spec(shape, world))
    assert not entry.staged
    assert entry.cell == (-(-shape[0] // world),) + shape[1:]
    assert entry.ncells == len(fsdp_spec(shape, world).shards)
    assert entry.cell[0] % entry.chunk[0] == 0 and entry.chunk[1:] == entry.cell[1:]
    chunk_bytes = math.prod(entry.chunk) * 4
    assert chunk_bytes <= CHUNK_TARGET_BYTES or entry.chunk == entry.cell


def test_small_tensors_are_staged_in_one_cell() -> None:
    entry = plan_array("norm", fsdp_spec((4096,), 1024))
    assert entry.staged and entry.cell == (4096,) and entry.ncells == 1


def test_overlaps_and_gaps_are_refused() -> None:
    gap = ShardedSpec("float32", (10, 4), (ShardSpec((0, 0), (4, 4), 0), ShardSpec((6, 0), (4, 4), 1)))
    with pytest.raises(CheckpointError, match="no shard covers"):
        plan_array("w", gap)
    overlap = ShardedSpec("float32", (10, 4), (ShardSpec((0, 0), (6, 4), 0), ShardSpec((4, 0), (6, 4), 1)))
    with pytest.raises(CheckpointError, match="overlap"):
        plan_array("w", overlap)
    outside = ShardedSpec("float32", (10, 4), (ShardSpec((0, 0), (12, 4), 0),))
    with pytest.raises(CheckpointError, match="outside"):
        plan_array("w", outside)


def test_two_dimensional_blocks() -> None:
    shards = tuple(ShardSpec((i * 600, j * 700), (600, 700), 2 * i + j) for i in range(2) for j in range(2))
    entry = plan_array("w", ShardedSpec("float32", (1200, 1400), shards))
    assert entry.cell == (600, 700) and entry.ncells == 4
