"""crc32_combine gives what zlib gives for the concatenation, for any lengths (empty and large too)."""

from __future__ import annotations

import os
import random
import zlib

from shardstore.crc import crc32_combine


def test_combine_matches_zlib_over_the_concatenation() -> None:
    rng = random.Random(3)
    for _ in range(300):
        a, b = os.urandom(rng.randrange(0, 5000)), os.urandom(rng.choice([0, 1, 7, rng.randrange(0, 70000)]))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_a_chain_of_many_runs() -> None:
    runs = [os.urandom(n) for n in (4096, 1, 0, 65537, 300, 1 << 20)]
    crc = zlib.crc32(runs[0])
    for run in runs[1:]:
        crc = crc32_combine(crc, zlib.crc32(run), len(run))
    assert crc == zlib.crc32(b"".join(runs))
