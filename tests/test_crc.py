"""crc32_combine gives what zlib gives for the concatenation, for any lengths (empty and large too): the
system zlib's function where it loads, and this module's Python (the fallback) alike."""

from __future__ import annotations

import os
import random
import zlib

import pytest

from shardstore import crc

COMBINES = [pytest.param(crc.py_crc32_combine, id="python"),
            pytest.param(crc._zlib_combine(), id="zlib",
                         marks=pytest.mark.skipif(crc._zlib_combine() is crc.py_crc32_combine, reason="no system zlib to load"))]


@pytest.mark.parametrize("combine", COMBINES)
def test_combine_matches_zlib_over_the_concatenation(combine) -> None:
    rng = random.Random(3)
    for _ in range(300):
        a, b = os.urandom(rng.randrange(0, 5000)), os.urandom(rng.choice([0, 1, 7, rng.randrange(0, 70000)]))
        assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("combine", COMBINES)
def test_a_chain_of_many_runs(combine) -> None:
    runs = [os.urandom(n) for n in (4096, 1, 0, 65537, 300, 1 << 20)]
    total = zlib.crc32(runs[0])
    for run in runs[1:]:
        total = combine(total, zlib.crc32(run), len(run))
    assert total == zlib.crc32(b"".join(runs))


def test_lengths_past_four_gigabytes_agree() -> None:
    """A tensor entry over 4 GiB: the length is a 64-bit count in both."""
    if crc._zlib_combine() is crc.py_crc32_combine:
        pytest.skip("no system zlib to load")
    for length in (1 << 32, (1 << 33) + 12345, 70 << 30):
        assert crc._zlib_combine()(0x12345678, 0x9ABCDEF0, length) == crc.py_crc32_combine(0x12345678, 0x9ABCDEF0, length)
