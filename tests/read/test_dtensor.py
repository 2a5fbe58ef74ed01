"""The DTensor reader's layout arithmetic, against torch's own, and the files it must refuse."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from shardstore.errors import CheckpointError, UnsafePickleError
from shardstore.read.container import TorchZip
from shardstore.read.dtensor import Mesh, local_box, mesh_of, placements_of
from shardstore.read.unpickle import load

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("shape", [(7, 5), (3, 8), (1, 4), (10,), (0, 3), (9, 6, 4)])
@pytest.mark.parametrize("mesh_shape", [(4,), (3,), (2, 2), (2, 3)])
def test_local_boxes_are_torchs(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> None:
    """Every placement combination over every coordinate: the box torch's DTensor computes, uneven and
    empty shards included."""
    choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
    for placements in itertools.product(choices, repeat=len(mesh_shape)):
        ours = tuple(("replicate", -1) if isinstance(p, Replicate) else ("shard", p.dim) for p in placements)
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
            got_offsets, got_sizes = local_box(shape, mesh_shape, ours, coord)
            assert got_sizes == tuple(sizes), (placements, coord)
            if all(sizes):
                assert got_offsets == tuple(offsets), (placements, coord)


def test_mesh_coordinates() -> None:
    mesh = Mesh((2, 3), (0, 1, 2, 3, 4, 5))
    assert mesh.coordinate(4) == (1, 1) and mesh.coordinate(0) == (0, 0) and mesh.coordinate(6) is None
    assert Mesh((2,), (4, 6)).coordinate(6) == (1,)  # a sub-mesh names its own global ranks


@pytest.mark.parametrize("version", ["2.6", "2.13"])
def test_both_mesh_pickles_read_the_same(version: str, verl_checkpoints, tmp_path: Path) -> None:
    """torch <= 2.9 pickles a mesh as a rank tensor, >= 2.10 as a rank map with a layout: a 2x2 HSDP mesh
    (rank 3's file) reads as the same mesh from both (2.6's file is kept in tests/read/data)."""
    path = (DATA / "dtensor-hsdp-t2.6-rank3.pt" if version == "2.6" else
            verl_checkpoints("fsdp2-hsdp", 4) / "global_step_7/actor/model_world_size_4_rank_3.pt")
    with TorchZip(path) as zf:
        state = load(zf.record("data.pkl"), str(path))
    leaf = next(iter(state.values()))
    mesh = mesh_of(leaf._spec.mesh, "x")
    assert mesh == Mesh((2, 2), (0, 1, 2, 3)) and mesh.coordinate(3) == (1, 1)
    assert placements_of(leaf._spec, 2, mesh, "x")[0] == ("replicate", -1)


def test_partial_and_strided_placements_are_refused_by_name() -> None:
    class P:
        def __init__(self, kind: str) -> None:
            from shardstore.read.unpickle import Placement

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

    from shardstore.read.opaque import Opaque

    data = pickle.dumps(None, protocol=2)[:2] + b"ctorch.distributed.distributed_c10d\nnew_group\n)R."
    record = load(data, "forged.pt")
    assert isinstance(record, Opaque) and (record.module, record.name) == ("torch.distributed.distributed_c10d",
                                                                           "new_group")
    with pytest.raises(UnsafePickleError, match="new_group"):
        load(data, "forged.pt", strict=True)
