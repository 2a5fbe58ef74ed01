"""FP8 block dequantization (export/fp8.py): the C extension gives numpy's bytes, whatever the bytes, the
scales, the blocks and where the rows start."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardstore import dtypes
from shardstore.export import fp8

CASES = [((128, 128), 300, 260, 0), ((128, 128), 128, 128, 256), ((3, 5), 17, 23, 4), ((1, 1), 5, 7, 0),
         ((128, 128), 1, 1000, 127), ((7, 128), 0, 40, 3)]


def _scales(gen: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Scales of every size: ordinary, huge (products overflow bfloat16 to infinity), tiny (bfloat16
    subnormals and zeros), negative, zero and NaN."""
    scale = gen.standard_normal(shape).astype(np.float32) * np.float32(1e-3)
    kinds = gen.integers(0, 6, size=shape)
    scale[kinds == 1] = np.float32(3e38)
    scale[kinds == 2] = np.float32(1e-40)
    scale[kinds == 3] = np.float32(0.0)
    scale[kinds == 4] = np.float32(np.nan)
    return scale


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("block, rows, columns, first_row", CASES)
def test_the_c_extension_gives_numpys_bytes(dtype: str, block: tuple[int, int], rows: int, columns: int,
                                            first_row: int) -> None:
    if not fp8.NATIVE:
        assert os.environ.get("SHARDSTORE_REQUIRE_NATIVE") != "1", "CI builds the C extension"
        pytest.skip("the C extension was not built (no compiler at install time)")
    gen = np.random.default_rng(rows * 7919 + columns)
    raw = gen.integers(0, 256, size=(rows, columns), dtype=np.uint8)
    raw.reshape(-1)[:256] = np.arange(min(256, raw.size), dtype=np.uint8)  # every byte, NaNs and subnormals among them
    scale = _scales(gen, (-(-(first_row + rows) // block[0]), -(-columns // block[1])))
    table = dtypes.widening("float8_e4m3fn")
    want = fp8.dequantized(table[raw].astype(np.float32), scale, block, first_row, dtype)
    got = fp8._fp8_block_c(raw.tobytes(), table, scale, rows, columns, scale.shape[1], *block, first_row,
                          dtype == "bfloat16")
    assert bytes(got) == bytes(want)


def test_the_c_extension_refuses_buffers_shorter_than_their_sizes() -> None:
    if not fp8.NATIVE:
        pytest.skip("the C extension was not built (no compiler at install time)")
    table, scale = dtypes.widening("float8_e4m3fn"), np.ones((1, 1), np.float32)
    with pytest.raises(ValueError, match="weight: 3 bytes, 4 needed"):
        fp8._fp8_block_c(b"abc", table, scale, 2, 2, 1, 128, 128, 0, True)
    with pytest.raises(ValueError, match="scales: 4 bytes, 2 rows of 1 needed"):
        fp8._fp8_block_c(bytes(4), table, scale, 2, 2, 1, 1, 128, 0, True)
    with pytest.raises(ValueError, match="scales: 4 bytes, 4611686018427387905 rows of 1 needed"):
        fp8._fp8_block_c(bytes(4), table, scale, 2, 2, 1, 1, 128, 2 ** 62 - 1, True)  # (no wrap-around)
    with pytest.raises(ValueError, match="sizes out of range"):
        fp8._fp8_block_c(bytes(4), table, scale, 2, 2, 1, 128, 1, 0, True)  # column 1's scale: none
