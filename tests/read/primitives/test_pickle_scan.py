"""The opcode bounds check: the C extension and the Python fallback accept and refuse exactly the same
inputs with the same messages, and what they refuse is what would make the unpickler allocate more than
the data's own size."""

from __future__ import annotations

import os
import pickle
import pickletools
import random
import shutil
import struct

import numpy as np
import pytest
import torch

from shardstore.read.primitives import pickle_scan

IMPLS = [pickle_scan.scan_py] + ([pickle_scan._scan_c] if pickle_scan.NATIVE else [])


def _outcome(scan, data: bytes) -> tuple[str, object]:
    try:
        return "ok", scan(data)
    except pickle_scan.ScanError as exc:
        return "refused", str(exc)


def _samples() -> list[bytes]:
    obj = {"a": [1, 2.5, "x" * 300, b"y" * 70000, (None, True), {3, 4}, frozenset(), bytearray(b"z"), 10**40, -5,
                 2**31, "é"], "np": np.arange(5), "t": (1,), ("k", 2): [[[]]]}
    out = [pickle.dumps(obj, protocol=p) for p in range(6)]
    buf = __import__("io").BytesIO()
    torch.save({"w": torch.ones(3), "rng": torch.get_rng_state()}, buf)
    import zipfile

    with zipfile.ZipFile(buf) as z:
        out.append(z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))))
    return out


def test_real_pickles_pass_with_their_opcode_count() -> None:
    for data in _samples():
        for scan in IMPLS:
            assert scan(data) == sum(1 for _ in pickletools.genops(data))


@pytest.mark.parametrize("data, message", [
    (b"\x80\x02K\x01r\x00\x00\x00\x04.", "memo index 67108864 at byte 4 is beyond what 10 bytes"),
    (b"\x80\x04\x8e" + struct.pack("<Q", 2**60) + b"xx.", f"length {2**60} at byte 2 runs past the end"),
    (b"\x80\x04\x8e" + struct.pack("<Q", 2**64 - 1) + b".", f"length {2**64 - 1} at byte 2 runs past the end"),
    (b"\x80\x04\x95" + struct.pack("<Q", 2**40) + b"N.", "length 1099511627776 at byte 2 runs past the end"),
    (b"\x80\x02T\xff\xff\xff\xff.", "length -1 at byte 2 runs past the end"),
    (b"\x80\x02p99999\nN.", "memo index b'99999' at byte 2 is not one 11 bytes can hold"),
    (b"\x80\x02pabc\nN.", "memo index b'abc' at byte 2"),
    (b"\x80\x02cos\nsystem", "unterminated text argument at byte 2"),
    (b"\x80\x02N", "ends without a STOP opcode (at byte 3)"),
    (b"\x80\x02\xffN.", "unknown opcode 0xff at byte 2"),
    (b"\x80\x05\x97.", "out-of-band buffers"),
    (b"\x80\x02J\x01\x00", "truncated argument at byte 2"),
])
def test_hostile_numbers_are_refused_alike(data: bytes, message: str) -> None:
    outcomes = {_outcome(scan, data) for scan in IMPLS}
    assert len(outcomes) == 1
    ((kind, text),) = outcomes
    assert kind == "refused" and message in text, text


def test_random_damage_gets_the_same_verdict_from_both() -> None:
    rng = random.Random(20261130)
    for base in _samples():
        for _ in range(400):
            data = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            if rng.random() < 0.3:
                data = data[: rng.randrange(len(data))]
            outcomes = {_outcome(scan, bytes(data)) for scan in IMPLS}
            assert len(outcomes) == 1, (bytes(data[:40]), outcomes)


@pytest.mark.skipif(os.environ.get("SHARDSTORE_REQUIRE_NATIVE") != "1", reason="CI sets it: the C scanner must build")
def test_the_c_scanner_was_built() -> None:
    assert pickle_scan.NATIVE and pickle_scan.scan is pickle_scan._scan_c


@pytest.mark.skipif(shutil.which("gcc") is None and os.environ.get("SHARDSTORE_REQUIRE_NATIVE") != "1",
                    reason="no gcc to build the fuzz harness (CI has one)")
def test_the_fuzz_harness_finds_nothing_in_the_scanner_and_the_skimmer(tmp_path) -> None:
    """tests/fuzz: the C source under AddressSanitizer and UBSan, every seed (the corpus's real pickles)
    then 5 s of mutations of them (from a fixed seed: the start of a longer run's sequence); any over-read,
    undefined behaviour or leaked buffer aborts it. Run it longer, or coverage-guided with libFuzzer, by
    hand (`python -m tests.fuzz.run --help`)."""
    from tests.fuzz.run import run

    proc = run(5, tmp_path)
    assert proc.returncode == 0 and "no finding" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    assert int(proc.stdout.split()[0]) > len(list((tmp_path / "seeds").iterdir()))  # mutations ran, not only seeds
