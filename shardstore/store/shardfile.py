"""Zarr v3 files written directly: array metadata (zarr.json) and shard files (`sharding_indexed`).

Array metadata is zarr-python's own: the document `zarr.create_array` writes for an uncompressed sharded
array of each dtype (`template`; tests/store/test_shardfile.py holds it to zarr-python's own for every
dtype the store uses), with shape, grid and attributes filled in, so creating hundreds of arrays is one small
file write each, with neither a trip through Zarr's async machinery each nor importing Zarr (a third of a
second on a cold start) where nothing else needs it.

With no compression and inner chunks that span the cell's trailing dimensions, inner chunk k of a cell
is simply rows [k*r, (k+1)*r) of the cell in C order. A shard file is therefore the cell's raw bytes,
zero padding up to the last inner chunk, and a small index: exactly what zarr-python writes for the same
data (tests compare the bytes), but produced by streaming the rank file's bytes into place instead of
decoding and re-encoding them chunk by chunk.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Iterable

import google_crc32c
import numpy as np

from ..ranges import Part

EMPTY = 2**64 - 1
GROUP_METADATA = json.dumps({"attributes": {}, "zarr_format": 3, "node_type": "group"}).encode()


def template(raw: str) -> dict[str, Any]:
    """zarr.json of a (1,)-shaped uncompressed sharded array of numpy dtype `raw`, as zarr-python 3 writes
    it: single-byte types carry no endianness, complex fill values are [re, im], bool's is false. A new
    document each call (cheaper than copying one: a store is hundreds of them)."""
    dt = np.dtype(raw)
    data_bytes: dict[str, Any] = {"name": "bytes"} if dt.itemsize == 1 else \
        {"name": "bytes", "configuration": {"endian": "little"}}
    fill: Any = False if dt.kind == "b" else [0.0, 0.0] if dt.kind == "c" else 0.0 if dt.kind == "f" else 0
    return {"shape": [1], "data_type": dt.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill,
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [1], "codecs": [data_bytes],
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "index_location": "end"}}],
            "attributes": {}, "zarr_format": 3, "node_type": "array", "storage_transformers": []}


def array_metadata(raw: np.dtype, shape: tuple[int, ...], cell: tuple[int, ...], chunk: tuple[int, ...],
                   attributes: dict[str, Any], separator: str = "/") -> dict[str, Any]:
    """zarr.json of an uncompressed sharded array, exactly as zarr-python would write it (with the chunk
    key `separator`)."""
    meta = template(raw.str)
    meta["chunk_key_encoding"]["configuration"]["separator"] = separator
    meta["shape"] = list(shape)
    meta["chunk_grid"]["configuration"]["chunk_shape"] = list(cell)
    meta["codecs"][0]["configuration"]["chunk_shape"] = list(chunk)
    meta["attributes"] = attributes
    return meta


def records_node_metadata() -> dict[str, Any]:
    """zarr.json for `__shardstore__`: an empty uint8 array. Zarr does not list inside an array node, so
    shardstore's own records there no longer make every walk of the group warn about unknown objects."""
    meta = array_metadata(np.dtype("u1"), (0,), (1,), (1,), {
        "shardstore": "shardstore's own records (manifest, commit records, staging); not array data"})
    return meta


def index_bytes(cell_rows: int, chunk_rows: int, valid_rows: int, chunk_bytes: int) -> bytes:
    """The shard index: (offset, nbytes) per inner chunk, fill-only chunks marked empty, then CRC32C."""
    entries = []
    for k in range(cell_rows // chunk_rows):
        if k * chunk_rows < valid_rows:
            entries += [k * chunk_bytes, chunk_bytes]
        else:
            entries += [EMPTY, EMPTY]
    raw = struct.pack(f"<{len(entries)}Q", *entries)
    return raw + struct.pack("<I", google_crc32c.value(raw))


def shard_size(cell: tuple[int, ...], chunk: tuple[int, ...], valid_rows: int, itemsize: int) -> int:
    """The size of the shard file `shard_parts` makes."""
    chunk_bytes = chunk[0] * math.prod(cell[1:]) * itemsize
    return -(-valid_rows // chunk[0]) * chunk_bytes + 16 * (cell[0] // chunk[0]) + 4


def shard_parts(data: Iterable[Part], data_bytes: int, cell: tuple[int, ...], chunk: tuple[int, ...],
                valid_rows: int, itemsize: int) -> list[Part]:
    """The parts of one shard file whose cell holds `valid_rows` rows of real data (`data_bytes` bytes).

    Requires the cell to be full along every dimension but the first, which is how plan.py cuts cells
    whenever the data can be streamed; anything else is padded into a full buffer by the caller first.
    """
    row_bytes = math.prod(cell[1:]) * itemsize
    chunk_bytes = chunk[0] * row_bytes
    assert data_bytes == valid_rows * row_bytes, (data_bytes, valid_rows, row_bytes)
    padded = -(-valid_rows // chunk[0]) * chunk_bytes
    parts = list(data)
    if padded > data_bytes:
        parts.append(bytes(padded - data_bytes))
    parts.append(index_bytes(cell[0], chunk[0], valid_rows, chunk_bytes))
    return parts
