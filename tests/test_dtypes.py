"""The dtype table: raw widths, holes, and exact widening of bfloat16 and both float8 formats, checked
against torch's own conversions for every bit pattern."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardstore import dtypes
from shardstore.errors import CheckpointError


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"])
def test_float8_tables_equal_torch_for_all_256_codes(name: str) -> None:
    codes = np.arange(256, dtype=np.uint8)
    ours = dtypes.as_numbers(codes, name)
    theirs = torch.from_numpy(codes.copy()).view(getattr(torch, name)).float().numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    assert np.array_equal(ours[~np.isnan(ours)].view(np.uint32), theirs[~np.isnan(theirs)].view(np.uint32))


def test_bfloat16_widening_equals_torch_for_all_65536_codes() -> None:
    codes = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    ours = dtypes.as_numbers(codes, "bfloat16")
    theirs = torch.from_numpy(codes.copy()).view(torch.bfloat16).float().numpy()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                  "float8_e5m2fnuz", "float8_e8m0fnu", "float64"])
def test_holes_are_nan(name: str) -> None:
    info = dtypes.info(name)
    raw = np.frombuffer(info.hole(3), dtype=info.raw)
    assert np.isnan(dtypes.as_numbers(raw, name).astype(np.float64)).all()


def test_integer_holes_are_zero_and_table_matches_torch_widths() -> None:
    assert dtypes.info("int64").hole(2) == bytes(16)
    for info in dtypes.BY_NAME.values():
        assert torch.empty((), dtype=getattr(torch, info.name)).element_size() == info.itemsize, info.name


def test_aliases_and_unknown_dtypes() -> None:
    assert dtypes.info("half").name == "float16" and dtypes.info("long").name == "int64"
    with pytest.raises(CheckpointError, match="unsupported tensor dtype torch.quint8"):
        dtypes.info("quint8")
