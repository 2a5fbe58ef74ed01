"""The store as other Zarr readers see it."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import zarr

import shardstore
from tests.conftest import expected


def test_zarr_walks_the_store_without_warnings_and_reads_the_same_bits(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    shardstore.ingest(tmp_path / "s", sorted(src.glob("rank*.pt")), jobs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zarr warns about any object it does not recognise
        group = zarr.open_group(tmp_path / "s", mode="r", zarr_format=3)
        members = dict(group.members(max_depth=None))
        group.tree()
    assert "model/wte.weight" in members and members["__shardstore__"].shape == (0,)
    want = expected(src)["model"]["wte.weight"].numpy()
    assert np.array_equal(members["model/wte.weight"][:], want)
