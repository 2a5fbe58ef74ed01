"""The DTensor reader's layout arithmetic, against torch's own, and the files it must refuse."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from shardstore.errors import CheckpointError, UnsafePickleError
from shardstore.read.formats.dtensor import Mesh, layouts_of, local_box, mesh_of, placements_of, read_file
from shardstore.read.primitives.container import TorchZip
from shardstore.read.primitives.unpickle import load

DATA = Path(__file__).parent / "data"


def _torch_local(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, coord: tuple) -> Any:
    """The global element indices a coordinate holds, by DTensor's own splitting, left to right."""
    local = torch.arange(math.prod(shape)).reshape(shape)
    for p, n, c in zip(placements, mesh_shape, coord):
        if not isinstance(p, Replicate):
            local = p._split_tensor(local, n, with_padding=False)[0][c]
    return local


@pytest.mark.parametrize("shape", [(7, 5), (3, 8), (1, 4), (10,), (0, 3), (9, 6, 4), (97, 2)])
@pytest.mark.parametrize("mesh_shape", [(4,), (3,), (2, 2), (2, 3)])
def test_local_boxes_are_torchs(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> None:
    """Every placement combination over every coordinate, `_StridedShard` (FSDP2 over tensor parallelism)
    included: the box torch's DTensor computes and the elements its own splitting puts there, uneven and
    empty shards included; where those elements are not one box, refused."""
    choices = [Replicate()] + [Shard(d) for d in range(len(shape))] + \
        [_StridedShard(d, split_factor=f) for d in range(len(shape)) for f in (2, 3)]
    for placements in itertools.product(choices, repeat=len(mesh_shape)):
        ours = tuple(("replicate", -1, 1) if isinstance(p, Replicate) else
                     ("shard", p.dim, getattr(p, "split_factor", 1)) for p in placements)
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            held = _torch_local(shape, mesh_shape, placements, coord)
            try:
                got_offsets, got_sizes = local_box(shape, mesh_shape, ours, coord)
            except CheckpointError:
                box = None
            else:
                box = tuple(slice(o, o + n) for o, n in zip(got_offsets, got_sizes))
            if box is None or not all(got_sizes):
                whole = torch.arange(math.prod(shape)).reshape(shape)
                is_box = any(torch.equal(held, whole[tuple(slice(o, o + n) for o, n in zip(off, held.shape))])
                             for off in itertools.product(*(range(s - h + 1) for s, h in zip(shape, held.shape))))
                assert (box is None) != (is_box and held.numel() > 0) or held.numel() == 0, (placements, coord)
                continue
            assert torch.equal(held, torch.arange(math.prod(shape)).reshape(shape)[box]), (placements, coord)
            sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
            assert got_sizes == tuple(sizes) and got_offsets == tuple(offsets), (placements, coord)


def test_a_shard_order_reads_as_the_split_factors_torch_derives_from_it() -> None:
    """torch >= 2.13 may pickle plain `Shard`s with a `shard_order` applying them right to left: read as
    torch's own conversion to `_StridedShard` says."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry as TorchEntry

    from shardstore.read.primitives.unpickle import ShardOrderEntry, _placement

    mesh_shape = (4, 3, 2)
    torch_mesh = type("M", (), {"size": lambda self, i: mesh_shape[i]})()
    order = (TorchEntry(0, (2, 0, 1)),)
    want = DTensorSpec._convert_shard_order_to_StridedShard(order, (Shard(0),) * 3, torch_mesh)
    spec = type("S", (), {})()
    shard = _placement("Shard")
    spec.placements = tuple(shard() for _ in range(3))
    for p in spec.placements:
        p.__dict__["dim"] = 0
    spec.shard_order, spec.use_strided_shard_as_shard_order = (ShardOrderEntry(0, (2, 0, 1)),), False
    got = placements_of(spec, 1, Mesh(mesh_shape, tuple(range(24))), "x")
    assert got == tuple(("shard", 0, getattr(p, "split_factor", 1)) for p in want)
    assert [s for _, _, s in got] == [2, 2, 1]


def test_mesh_coordinates() -> None:
    mesh = Mesh((2, 3), (0, 1, 2, 3, 4, 5))
    assert mesh.coordinate(4) == (1, 1) and mesh.coordinate(0) == (0, 0) and mesh.coordinate(6) is None
    assert Mesh((2,), (4, 6)).coordinate(6) == (1,)  # a sub-mesh names its own global ranks


@pytest.mark.parametrize("version", ["2.6", "2.13"])
def test_both_mesh_pickles_read_the_same(version: str, verl_checkpoints, tmp_path: Path) -> None:
    """torch <= 2.9 pickles a mesh as a rank tensor, >= 2.10 as a rank map with a layout: a 2x2 HSDP mesh
    (rank 3's file) reads as the same mesh from both (2.6's file is kept in tests/read/formats/data)."""
    path = (DATA / "dtensor-hsdp-t2.6-rank3.pt" if version == "2.6" else
            verl_checkpoints("fsdp2-hsdp", 4) / "global_step_7/actor/model_world_size_4_rank_3.pt")
    with TorchZip(path) as zf:
        state = load(zf.record("data.pkl"), str(path))
    leaf = next(iter(state.values()))
    mesh = mesh_of(leaf._spec.mesh, "x")
    assert mesh == Mesh((2, 2), (0, 1, 2, 3), 1, ("ddp", "fsdp")) and mesh.coordinate(3) == (1, 1)
    assert placements_of(leaf._spec, 2, mesh, "x")[0] == ("replicate", -1, 1)


@pytest.mark.parametrize("version", ["2.6", "2.13"])
def test_a_sliced_mesh_reads_as_all_its_copies(version: str, fsdp2_files) -> None:
    """FSDP2 over tensor parallelism shards the norms over the dp sub-mesh: rank 1's file names its own dp
    group, (1, 3). torch 2.13 pickles the root's rank map with the slice's layout; 2.6 only the group, which
    the file's (dp, tp) mesh completes: both read as every dp group, so every rank's file describes the same
    layout, and ranks 1 and 3 hold replicas of ranks 0 and 2."""
    folder = Path(__file__).parents[2] / "fixtures" / "data" / "fsdp2-tp" / "t2.6" if version == "2.6" else \
        fsdp2_files("tp", 4)
    f = read_file(str(folder / "model_rank1.pt"), "", 4, 1, None, True, str)
    try:
        layouts = layouts_of(f)
    finally:
        f.zip.close()
    norm = layouts["model.norm.weight"][0].mesh
    assert norm == Mesh((2,), (0, 2, 1, 3), 2, ("dp",)) and norm.coordinate(1) == norm.coordinate(0) == (0,)
    assert layouts["lm_head.weight"][0].placements == (("shard", 0, 2), ("shard", 0, 1))


def test_partial_and_strided_placements_are_refused_by_name() -> None:
    class P:
        def __init__(self, kind: str) -> None:
            from shardstore.read.primitives.unpickle import Placement

            self.record = type(kind, (Placement,), {"kind": kind})()

    spec = type("S", (), {})()
    for kind, words in (("Partial", "a reduction still pending"), ("_StridedShard", "_StridedShard")):
        spec.placements = (P(kind).record,)
        with pytest.raises(CheckpointError, match=words):
            placements_of(spec, 2, Mesh((2,), (0, 1)), "f.pt: w")


def test_a_process_group_call_in_a_pickle_stays_a_record() -> None:
    """A mesh names its process groups; a pickle that calls torch's group constructor gets an inert record
    of the call (nothing imported, nothing run), and --strict refuses it."""
    import pickle

    from shardstore.records import Opaque

    data = pickle.dumps(None, protocol=2)[:2] + b"ctorch.distributed.distributed_c10d\nnew_group\n)R."
    record = load(data, "forged.pt")
    assert isinstance(record, Opaque) and (record.module, record.name) == ("torch.distributed.distributed_c10d",
                                                                           "new_group")
    with pytest.raises(UnsafePickleError, match="new_group"):
        load(data, "forged.pt", strict=True)


def test_a_mesh_with_an_axis_of_size_zero_is_refused_by_name(verl_checkpoints) -> None:
    """torch >= 2.10's layout (sizes and strides per mesh dimension) and torch <= 2.9's rank tensor alike."""
    import copy

    path = verl_checkpoints("fsdp2-hsdp", 4) / "global_step_7/actor/model_world_size_4_rank_3.pt"
    with TorchZip(path) as zf:
        state = load(zf.record("data.pkl"), str(path))
    mesh = copy.deepcopy(next(iter(state.values()))._spec.mesh)
    axis = mesh.__dict__["_layout"].__dict__["axes"][0]
    axis.__dict__["shape"] = (0,) + tuple(axis.__dict__["shape"][1:])
    with pytest.raises(CheckpointError, match="x: a device mesh with an axis of size 0"):
        mesh_of(mesh, "x")
    with TorchZip(DATA / "dtensor-hsdp-t2.6-rank3.pt") as zf:
        old = copy.deepcopy(next(iter(load(zf.record("data.pkl"), "y").values()))._spec.mesh)
    ranks = old.__dict__["mesh"]
    old.__dict__["mesh"] = type(ranks)(ranks.storage, ranks.offset, (2, 0), ranks.stride, ranks.dtype)
    with pytest.raises(CheckpointError, match="y: a device mesh with an axis of size 0"):
        mesh_of(old, "y")
