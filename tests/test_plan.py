"""Planning: cells cut at every shard boundary (one writer each), tiling checked, small tensors staged."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

import shardstore
from shardstore.errors import CheckpointError
from shardstore.plan import CHUNK_TARGET_BYTES, plan_array
from shardstore.read.contract import ShardedSpec, ShardSpec
from tests.test_cli import run


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


def test_a_small_tensor_one_unit_holds_whole_is_its_own_cell_not_staged() -> None:
    """Staging gathers the pieces several units hold; a tensor held whole (a Hugging Face file's norm, by
    one unit or by each replica) is written by its holder, never assembled by the coordinator."""
    for holders in (1, 2):
        whole = ShardedSpec("float32", (64, 4), tuple(ShardSpec((0, 0), (64, 4), r) for r in range(holders)))
        entry = plan_array("norm", whole)
        assert not entry.staged and entry.cell == (64, 4), holders
    assert plan_array("norm", fsdp_spec((64, 4), 2)).staged  # two units' pieces
    assert plan_array("step", ShardedSpec("float32", (), (ShardSpec((), (), 0),))).staged  # a scalar: in its record
    assert plan_array("none", ShardedSpec("float32", (0, 4), (ShardSpec((0, 0), (0, 4), 0),))).staged


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


def test_a_plain_dcp_save_is_layout_dcp_and_olmos_folder_olmo(tmp_path: Path) -> None:
    """A user's `dcp.save({"model": ..., "optim": ...})` was shown as `layout: olmo`: it is torch DCP's own
    nesting; the same save in OLMo's model_and_optim/ folder (OLMo's torch_new, OLMo-core) is OLMo's."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(3, 8)).sum().backward()
    optim.step()
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path / "ckpt")
    shardstore.ingest(tmp_path / "store", tmp_path / "ckpt", jobs=1)
    ls = run("ls", tmp_path / "store")
    assert ls.returncode == 0 and "layout: dcp (torch DCP's own nesting, as saved)" in ls.stdout, ls.stdout
    shutil.copytree(tmp_path / "ckpt", tmp_path / "step1" / "model_and_optim")
    shardstore.ingest(tmp_path / "olmo", tmp_path / "step1", jobs=1)
    assert shardstore.open(tmp_path / "olmo").manifest.layout == "olmo"
