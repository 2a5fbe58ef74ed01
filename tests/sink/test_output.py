"""OutputFile: parts appended in order, a local range's bytes summed in place and copied kernel-side, the
running CRC-32 the one zlib gives for everything written, the file named only at commit."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from shardstore.ranges import FileRange
from shardstore.sink.output import OutputFile


@pytest.mark.parametrize("summed", [True, False])
def test_write_parts_appends_in_order_and_sums_what_it_wrote(tmp_path: Path, summed: bool) -> None:
    data = os.urandom(3 << 20)
    (tmp_path / "src").write_bytes(data)
    fd = os.open(tmp_path / "src", os.O_RDONLY)
    seen: list[int] = []
    try:
        with OutputFile(tmp_path / "out", progress=seen.append) as out:
            out.write(b"head")
            crc = out.write_parts([b"one", FileRange(fd, 4097, 2 << 20), memoryview(b"two"), FileRange(fd, 0, 5)],
                                  zlib.crc32(b"head") if summed else None)
            out.write(b"tail")
            assert out.pos == 4 + 3 + (2 << 20) + 3 + 5 + 4
            assert not (tmp_path / "out").exists()  # named at commit only
    finally:
        os.close(fd)
    expected = b"head" + b"one" + data[4097:4097 + (2 << 20)] + b"two" + data[:5] + b"tail"
    assert (tmp_path / "out").read_bytes() == expected
    assert crc == (zlib.crc32(expected[:-4]) if summed else None)
    assert sum(seen) == len(expected)
