"""Shard files written directly are byte-identical to what zarr-python writes for the same data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from shardstore.store.backend import FileRange, LocalBackend
from shardstore.store.manifest import ArrayEntry
from shardstore.store.shardfile import shard_parts
from shardstore.store.store import cell_key


@pytest.mark.parametrize("shape, cell, chunk", [((10, 3), (4, 3), (2, 3)), ((9,), (9,), (3,)), ((7, 2, 2), (3, 2, 2), (1, 2, 2))])
def test_matches_zarr_byte_for_byte(tmp_path: Path, shape, cell, chunk) -> None:
    data = np.arange(np.prod(shape), dtype="<f4").reshape(shape) + 1
    ref = zarr.create_array(store=str(tmp_path / "ref"), shape=shape, chunks=chunk, shards=cell, dtype="<f4",
                            fill_value=0, compressors=None, filters=None, zarr_format=3,
                            chunk_key_encoding={"name": "default", "separator": "."})
    ref[...] = data
    backend = LocalBackend(tmp_path / "mine")
    entry = ArrayEntry("a", "float32", shape, cell, chunk, staged=False)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(data.tobytes())
    with open(raw, "rb") as f:
        for i in range(entry.grid[0]):
            index = (i,) + (0,) * (len(shape) - 1)
            (lo, hi), *_ = entry.cell_bounds(index)
            row = data[0].nbytes
            parts = [FileRange(f.fileno(), lo * row, (hi - lo) * row)]
            backend.write(cell_key("a", index), shard_parts(parts, (hi - lo) * row, cell, chunk, hi - lo, 4))
            assert (tmp_path / "mine" / cell_key("a", index)).read_bytes() == \
                (tmp_path / "ref" / cell_key("", index).lstrip("/")).read_bytes()


@pytest.mark.parametrize("dtype", ["<f4", "<u2", "u1", "?", "<c8", "<i8", "<f8"])
@pytest.mark.parametrize("shape, cell, chunk", [((10, 3), (4, 3), (2, 3)), ((0, 5), (1, 5), (1, 5)), ((7,), (7,), (7,))])
@pytest.mark.parametrize("separator", [".", "/"])
def test_array_metadata_is_what_zarr_writes(tmp_path: Path, dtype, shape, cell, chunk, separator) -> None:
    from shardstore.store.shardfile import array_metadata

    zarr.create_array(store=str(tmp_path), name="a", shape=shape, chunks=chunk, shards=cell, dtype=np.dtype(dtype),
                      fill_value=0, compressors=None, filters=None, attributes={"torch_dtype": "x"}, zarr_format=3,
                      chunk_key_encoding={"name": "default", "separator": separator})
    want = json.loads((tmp_path / "a" / "zarr.json").read_text())
    assert array_metadata(np.dtype(dtype), shape, cell, chunk, {"torch_dtype": "x"}, separator) == want


def test_the_array_metadata_template_is_zarrs_own_for_every_dtype() -> None:
    """shardstore writes zarr.json from its own template (no Zarr import on the way): for every raw dtype
    the store holds, and the records node's, exactly what zarr-python writes."""
    import zarr.storage

    from shardstore import dtypes
    from shardstore.store.shardfile import template

    def zarr_template(raw: str) -> dict:  # what zarr-python itself writes
        mem = zarr.storage.MemoryStore()
        zarr.create_array(store=mem, shape=(1,), chunks=(1,), shards=(1,), dtype=np.dtype(raw), fill_value=0,
                          compressors=None, filters=None, zarr_format=3)
        return json.loads(mem._store_dict["zarr.json"].to_bytes())

    raws = {info.raw.str for info in dtypes.BY_NAME.values()} | {"|u1"}
    assert len(raws) >= 10
    for raw in sorted(raws):
        assert template(raw) == zarr_template(raw), raw
