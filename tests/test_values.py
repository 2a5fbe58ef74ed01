"""Typed JSON: every value a rank file holds comes back exactly, with its Python type."""

from __future__ import annotations

import collections
import datetime
import io
import json
import math
import pathlib

import numpy as np
import pytest

from shardstore import values
from shardstore.errors import StoreError
from shardstore.records import GlobalRef, Opaque, TorchDevice, TorchDType, TorchVersion

CASES = [
    None, True, 0, -(2**70), 1.5, "text", [], (), (1, (2, [3])), {"a": 1}, {1: "int key", (2, 3): "tuple key"},
    collections.OrderedDict([("b", 1), ("a", 2)]), {1, 2}, frozenset({"x"}), b"\x00\xff", bytearray(b"ab"),
    complex(1, -2), np.arange(6, dtype=np.int16).reshape(2, 3), np.array(["a", None], dtype=object),
    np.float32(2.5), np.dtype("<u4"), datetime.timedelta(days=1, seconds=2, microseconds=3),
    datetime.datetime(2024, 5, 6, 7, 8, 9), datetime.date(2023, 10, 1), slice(1, None, 2),
    TorchDType("bfloat16"), TorchDevice("cuda:3"), TorchVersion("2.1.0+cu121"),
    pathlib.PurePosixPath("/scratch/run/step50"), pathlib.PureWindowsPath(r"C:\runs\step1"),
    GlobalRef("olmo.config", "TrainConfig"),
    Opaque("olmo_data", "MixtureCheckpoint", (), {"world_size": 4, "paths": [pathlib.PurePosixPath("/d")]}, newobj=True),
    Opaque("olmo_data", "Schedule", ("cosine", 7), None, kwargs={"warm": 1}, items=[1], dictitems=[("k", (2,))]),
]


def _same(a: object, b: object) -> bool:
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("value", CASES, ids=[type(v).__name__ + str(i) for i, v in enumerate(CASES)])
def test_every_value_round_trips_with_its_type(value: object) -> None:
    encoded = json.loads(json.dumps(values.encode(value)))  # through real JSON, as the store keeps it
    decoded = values.decode(encoded, tensor=lambda rec: pytest.fail("no tensor here"))
    assert _same(decoded, value), (decoded, value)


def test_floats_that_json_cannot_hold() -> None:
    encoded = json.loads(json.dumps(values.encode([math.inf, -math.inf, math.nan])))
    a, b, c = values.decode(encoded, tensor=lambda rec: None)
    assert a == math.inf and b == -math.inf and math.isnan(c)


def test_paths_come_back_as_concrete_paths_where_the_system_can_make_them() -> None:
    encoded = values.encode(pathlib.PosixPath("/scratch/x"))
    assert encoded == {"$path": ["PosixPath", "/scratch/x"]}
    assert type(values.decode(encoded, tensor=lambda rec: None)) is pathlib.PosixPath


def test_unknown_types_and_tags_are_refused_in_one_line() -> None:
    with pytest.raises(StoreError, match="cannot store a value of type object"):
        values.encode(object())
    with pytest.raises(StoreError, match="newer shardstore"):
        values.decode({"$hologram": 1}, tensor=lambda rec: None)
    with pytest.raises(StoreError, match="unknown path class"):
        values.decode({"$path": ["Path; import os", "/"]}, tensor=lambda rec: None)


def test_preview_is_short_and_names_tensors_without_reading_them() -> None:
    encoded = {"$dict": [["cuda", {"$tensor": {"dtype": "uint8", "shape": [816], "blob": "0" * 40}}],
                         ["paths", values.encode([pathlib.PosixPath(f"/r/step{i}") for i in range(20)])]]}
    text = values.preview(encoded)
    assert "tensor(uint8[816])" in text and "PosixPath('/r/step0')" in text and "..." in text and len(text) < 400


def test_an_in_memory_buffer_keeps_its_bytes_and_position() -> None:
    """torchtitan's train state holds io.BytesIO values: they come back as buffers, content and position."""
    buf = io.BytesIO(b"\x80\x02loss history")
    buf.seek(5)
    decoded = values.decode(json.loads(json.dumps(values.encode(buf))), tensor=lambda rec: pytest.fail("no tensor"))
    assert type(decoded) is io.BytesIO and decoded.getvalue() == buf.getvalue() and decoded.tell() == 5
    assert values.preview(values.encode(buf)) == "BytesIO(14 bytes)"
