"""A streaming writer for torch's zip container (what `torch.save` writes and `torch.load` reads).

torch.save needs the whole state dict in memory; this writes the pickle first (tensors as persistent
storage ids) and then streams each storage's bytes from the store, patching CRC and sizes in each local
header afterwards. Entries are STORED and 64-byte aligned like torch's own, with ZIP64 records where
sizes or offsets need them.

An entry can also be a hole (`hole`): its header is written and its bytes are left for others to fill
(the one-pass export's workers, sink/, each format's `plan_direct`); its CRC is patched in once they have (`crc_at`).
"""

from __future__ import annotations

import struct
from typing import Iterable, Protocol

from ..ranges import Part

ALIGN = 64
_LIMIT = 0xFFFFFFFF


class Sink(Protocol):
    """Where a zip is written: an output file (OutputFile), or a sketch of one (sink/, each format's `plan_direct`)."""

    pos: int

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def write_parts(self, parts: Iterable[Part], crc: int | None = None) -> int | None: ...

    def pwrite(self, data: bytes, offset: int) -> None: ...

    def skip(self, n: int) -> None: ...


class TorchZipWriter:
    """Writes one zip at the output's current position; its offsets count from there (a zip embedded in a
    larger file, as a DCP .distcp item is, reads as if it stood alone)."""

    def __init__(self, out: Sink, archive: str, force_zip64: bool = False):
        self.out = out
        self.archive = archive
        self.force_zip64 = force_zip64
        self.base = out.pos
        self.central: list[tuple[bytes, int, int, int]] = []  # name, crc, size, header offset (from base)
        self.holes: dict[str, tuple[int, int]] = {}  # a hole's name -> (its data's position, size) in the sink
        self._index: dict[bytes, int] = {}  # an entry's place in `central`
        self._central_at: dict[bytes, int] = {}  # an entry's central record's position in the sink
        self.data_at: dict[str, int] = {}  # an entry's bytes' position in the sink

    def _header(self, name: str, size: int) -> tuple[bytes, int]:
        """An entry's local header (CRC 0, patched later), written; and its offset from `base`."""
        full = f"{self.archive}/{name}".encode()
        zip64 = self.force_zip64 or size >= _LIMIT
        header_at = self.out.pos - self.base
        z64 = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        base = header_at + 30 + len(full) + len(z64) + 4
        pad = (-base) % ALIGN
        extra = z64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding field, as torch writes
        shown = _LIMIT if zip64 else size
        self.out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, 0x21, 0, shown, shown,
                                   len(full), len(extra)) + full + extra)
        return full, header_at

    def add(self, name: str, parts: Iterable[Part], size: int, crc: int | None = None) -> None:
        """One STORED entry of `size` bytes. With `crc` (the bytes' CRC-32, known beforehand) the parts are
        copied kernel-side; without, they are read once to compute it."""
        full, header_at = self._header(name, size)
        start = self.data_at[name] = self.out.pos
        if crc is None:
            crc = self.out.write_parts(parts, crc=0)
            if crc is None:
                raise ValueError(f"{name}: its sink computed no CRC-32")
        else:
            self.out.write_parts(parts)
        if self.out.pos - start != size:
            raise ValueError(f"{name}: wrote {self.out.pos - start} of {size} bytes")
        self.out.pwrite(struct.pack("<I", crc), self.base + header_at + 14)
        self._index[full] = len(self.central)
        self.central.append((full, crc, size, header_at))

    def hole(self, name: str, size: int) -> int:
        """An entry whose `size` bytes others write, at the position returned; CRC 0 until `crc_at` says
        where to patch it."""
        full, header_at = self._header(name, size)
        at = self.out.pos
        self.out.skip(size)
        self.holes[name] = (at, size)
        self._index[full] = len(self.central)
        self.central.append((full, 0, size, header_at))
        return at

    def set_crc(self, name: str, crc: int) -> None:
        """A hole's CRC, for the central directory `close` writes."""
        i = self._index[f"{self.archive}/{name}".encode()]
        full, _, size, header_at = self.central[i]
        self.central[i] = (full, crc, size, header_at)

    def crc_at(self, name: str) -> list[int]:
        """Where an entry's CRC-32 is in the sink: its local header, and its central record once closed."""
        full = f"{self.archive}/{name}".encode()
        header_at = self.central[self._index[full]][3]
        return [self.base + header_at + 14] + ([self._central_at[full] + 16] if full in self._central_at else [])

    def add_bytes(self, name: str, data: bytes) -> None:
        self.add(name, [data], len(data))

    def close(self) -> None:
        start = self.out.pos - self.base
        for name, crc, size, offset in self.central:
            self._central_at[name] = self.out.pos
            big = self.force_zip64 or size >= _LIMIT or offset >= _LIMIT
            extra = struct.pack("<HHQQQ", 1, 24, size, size, offset) if big else b""
            self.out.write(struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, 45 if big else 20, 45 if big else 20, 0, 0, 0, 0x21, crc,
                _LIMIT if big else size, _LIMIT if big else size, len(name), len(extra), 0, 0, 0, 0,
                _LIMIT if big else offset) + name + extra)
        end = self.out.pos - self.base
        count, cd_size = len(self.central), end - start
        if self.force_zip64 or count >= 0xFFFF or start >= _LIMIT or cd_size >= _LIMIT:
            self.out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, start))
            self.out.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
            self.out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _LIMIT, _LIMIT, 0))
        else:
            self.out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, start, 0))
