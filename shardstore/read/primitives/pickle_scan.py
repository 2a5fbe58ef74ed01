"""A bounds check of a pickle's opcode stream, run before the unpickler sees it.

The C unpickler trusts numbers written inside the pickle: a memo index of 2**26 makes it allocate a
memo of that size, a BINBYTES8 length of 2**60 makes it allocate the bytes before reading them. Neither
needs more than a few bytes of file. This scan walks the opcodes without building anything and refuses
any length that runs past the end of the data and any memo index that no pickle of this size could
reach (each PUT costs at least two bytes, so a real index is below the data's length). What passes can
make the unpickler allocate at most a small multiple of the data's own size.

`scan` is the C extension `_pickle_scan` when it was built at install time, else the Python version
below; both accept and refuse exactly the same inputs, with the same messages.
"""

from __future__ import annotations

# Opcodes by argument kind (pickle protocols 0 to 5).
_NO_ARG = frozenset(b"(.0123NRabd}elo]st)uQ" + bytes([0x81, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8F, 0x90, 0x91, 0x92,
                                                     0x93, 0x94]))
_OUT_OF_BAND = frozenset([0x97, 0x98])  # NEXT_BUFFER, READONLY_BUFFER
_FIXED = {ord("K"): 1, ord("M"): 2, ord("J"): 4, ord("G"): 8, 0x80: 1, 0x82: 1, 0x83: 2, 0x84: 4}
_MEMO_FIXED = {ord("q"): 1, ord("h"): 1, ord("r"): 4, ord("j"): 4}  # BINPUT, BINGET, LONG_BINPUT, LONG_BINGET
_COUNTED = {ord("U"): 1, ord("C"): 1, 0x8C: 1, 0x8A: 1,  # a length, then that many bytes
            ord("T"): -4, ord("B"): 4, ord("X"): 4, 0x8B: -4,  # negative: a signed length
            0x8E: 8, 0x8D: 8, 0x96: 8}
_FRAME = 0x95  # an 8-byte length; the frame's opcodes follow and are scanned like any others
_LINES = {ord("I"): 1, ord("L"): 1, ord("F"): 1, ord("S"): 1, ord("V"): 1, ord("P"): 1, ord("c"): 2, ord("i"): 2,
          ord("g"): 1, ord("p"): 1}
_MEMO_LINE = frozenset(b"gp")  # GET, PUT with a decimal index
_STOP = ord(".")


try:
    from ._pickle_scan import ScanError as ScanError  # type: ignore[import-not-found, unused-ignore]  # (absent where no compiler built it)
    from ._pickle_scan import scan as _scan_c
except ImportError:  # not built (no compiler at install time): the Python version, same results
    _scan_c = None

    class ScanError(ValueError):  # type: ignore[no-redef]
        """The pickle is malformed or hostile; the message says where."""


def scan_py(data: bytes | memoryview) -> int:
    """Check `data`; return the number of opcodes up to and including STOP. Raises ScanError."""
    raw = bytes(data)
    n = len(raw)
    pos = 0
    ops = 0
    while True:
        if pos >= n:
            raise ScanError(f"ends without a STOP opcode (at byte {pos})")
        op = raw[pos]
        at = pos
        pos += 1
        ops += 1
        if op == _STOP:
            return ops
        if op in _NO_ARG:
            continue
        if op in _OUT_OF_BAND:
            raise ScanError(f"uses out-of-band buffers (opcode at byte {at}), which no checkpoint does")
        width = _FIXED.get(op) or _MEMO_FIXED.get(op) or _COUNTED.get(op) or (8 if op == _FRAME else 0)
        if width:
            size = abs(width)
            if pos + size > n:
                raise ScanError(f"truncated argument at byte {at}")
            value = int.from_bytes(raw[pos:pos + size], "little", signed=width < 0)
            pos += size
            if op in _MEMO_FIXED and value >= n:
                raise ScanError(f"memo index {value} at byte {at} is beyond what {n} bytes of pickle can hold")
            if op in _COUNTED or op == _FRAME:
                if value < 0 or value > n - pos:
                    raise ScanError(f"length {value} at byte {at} runs past the end of the data")
                if op in _COUNTED:
                    pos += value
            continue
        lines = _LINES.get(op)
        if lines is None:
            raise ScanError(f"unknown opcode 0x{op:02x} at byte {at}")
        for _ in range(lines):
            end = raw.find(b"\n", pos)
            if end < 0:
                raise ScanError(f"unterminated text argument at byte {at}")
            if op in _MEMO_LINE and (not raw[pos:end].isdigit() or end - pos > 19 or int(raw[pos:end]) >= n):
                raise ScanError(f"memo index {raw[pos:end][:20]!r} at byte {at} is not one {n} bytes can hold")
            pos = end + 1


scan = _scan_c or scan_py
NATIVE = _scan_c is not None
