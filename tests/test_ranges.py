"""Parts: memory, local file ranges and remote ranges read the same, in bounded blocks, and short sources
are an error, never silent truncation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardstore.errors import StoreError
from shardstore.ranges import FileRange, RemoteRange, blocks, copy_range, part_length


def test_blocks_are_bounded_and_in_order(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        parts = [b"head", FileRange(fd, 100, 5000), RemoteRange(lambda off, n: data[off:off + n], 7000, 3000),
                 memoryview(bytearray(b"tail"))]
        out = list(blocks(parts, size=1024))
        assert all(len(b) <= 1024 for b in out)
        assert b"".join(bytes(b) for b in out) == b"head" + data[100:5100] + data[7000:] + b"tail"
        assert [part_length(p) for p in parts] == [4, 5000, 3000, 4]
    finally:
        os.close(fd)


def test_a_short_source_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(StoreError, match="rank7.pt ended 50 bytes early"):
            list(blocks([FileRange(fd, 50, 100, "rank7.pt")]))
        out = os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(StoreError, match="ended"):
                copy_range(FileRange(fd, 0, 150), out)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def test_copy_range_copies_exactly(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(dst, b"prefix")
        copy_range(FileRange(src, 12345, 2 << 20), dst)
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes() == b"prefix" + data[12345:12345 + (2 << 20)]


@pytest.mark.parametrize("mappable", [True, False])
def test_copy_summed_copies_and_sums_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mappable: bool) -> None:
    """Blocks that start off the map's granularity, several of them, and a file system that cannot map
    (summed through memory instead): the same bytes and the same CRC-32 as zlib's over the range."""
    import mmap
    import zlib

    from shardstore import ranges

    monkeypatch.setattr(ranges, "BLOCK", 100_000)  # the range spans many blocks, none of them aligned
    if not mappable:
        def refuse(*args: object, **kwargs: object) -> mmap.mmap:
            raise OSError(19, "No such device")
        monkeypatch.setattr(ranges.mmap, "mmap", refuse)
    data = os.urandom(1 << 20)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        os.pwrite(dst, b"head", 0)
        crc = ranges.copy_summed(FileRange(src, 4099, 700_001), dst, 4)
    finally:
        os.close(src)
        os.close(dst)
    assert crc == zlib.crc32(data[4099:4099 + 700_001])
    assert (tmp_path / "dst").read_bytes() == b"head" + data[4099:4099 + 700_001]


def test_copy_summed_refuses_a_short_source(tmp_path: Path) -> None:
    from shardstore.ranges import copy_summed

    (tmp_path / "f").write_bytes(b"x" * 100)
    fd, out = os.open(tmp_path / "f", os.O_RDONLY), os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(StoreError, match="rank3.pt ended 50 bytes early"):
            copy_summed(FileRange(fd, 50, 100, "rank3.pt"), out, 0)
    finally:
        os.close(fd)
        os.close(out)
    assert (tmp_path / "g").read_bytes() == b""  # nothing copied before the refusal
