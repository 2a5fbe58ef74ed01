"""The torch zip container, read without torch.

`torch.save` writes a zip whose entries are all STORED (uncompressed) and 64-byte aligned, so every
storage's bytes can be memory-mapped straight out of the file: nothing is copied until it is written.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class Entry:
    name: str
    offset: int  # absolute offset of the entry's first data byte
    size: int
    crc: int


class TorchZip:
    """An open rank file: its entries by record name and one read-only mmap over the whole file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise CheckpointError(f"{self.path}: is a directory, not a rank file") from None
        try:
            self._size = os.fstat(self._file.fileno()).st_size
            self.prefix, self.entries = self._index()
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self._size else None
        except BaseException:
            self._file.close()
            raise

    def _index(self) -> tuple[str, dict[str, Entry]]:
        try:
            infos = zipfile.ZipFile(self._file).infolist()
        except zipfile.BadZipFile as exc:
            if self._size and self._looks_legacy():
                raise CheckpointError(
                    f"{self.path}: a pre-1.6 (non-zip) torch.save file; re-save it with a newer torch"
                ) from None
            raise CheckpointError(f"{self.path}: not a torch checkpoint or truncated ({exc})") from None
        pkl = [i.filename for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") == 1]
        if len(pkl) != 1:
            raise CheckpointError(f"{self.path}: not a torch checkpoint (no single <name>/data.pkl record)")
        prefix = pkl[0][: -len("data.pkl")]
        entries: dict[str, Entry] = {}
        for zi in infos:
            if not zi.filename.startswith(prefix):
                continue
            if zi.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{self.path}: record {zi.filename} is compressed; torch never writes that")
            self._file.seek(zi.header_offset)
            raw = self._file.read(_LOCAL_HEADER.size)
            if len(raw) < _LOCAL_HEADER.size or raw[:4] != _LOCAL_MAGIC:
                raise CheckpointError(f"{self.path}: corrupt zip (bad local header for {zi.filename})")
            fields = _LOCAL_HEADER.unpack(raw)
            start = zi.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
            if start + zi.file_size > self._size:
                raise CheckpointError(f"{self.path}: truncated (record {zi.filename} runs past the end)")
            entries[zi.filename[len(prefix):]] = Entry(zi.filename, start, zi.file_size, zi.CRC)
        return prefix, entries

    def _looks_legacy(self) -> bool:
        self._file.seek(0)
        return self._file.read(2) == b"\x80\x02"

    def record(self, name: str) -> memoryview:
        """A zero-copy view of one record's bytes (e.g. "data.pkl", "data/3")."""
        try:
            entry = self.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing record {self.prefix}{name}") from None
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)[entry.offset: entry.offset + entry.size]

    def verify(self, name: str) -> None:
        """Check one record against the CRC-32 the zip stores for it (catches bit rot and torn copies)."""
        if zlib.crc32(self.record(name)) != self.entries[name].crc:
            raise CheckpointError(f"{self.path}: record {self.prefix}{name} fails its CRC check (corrupt file)")

    def storage_offset(self, key: str) -> int:
        """Absolute file offset of storage `key`: lets a writer copy it kernel-side (copy_file_range)."""
        return self.entries[f"data/{key}"].offset

    def fileno(self) -> int:
        return self._file.fileno()

    @property
    def size(self) -> int:
        return self._size

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # A caller still holds a view; the map is freed with the last view instead.
                pass
        self._file.close()

    def __enter__(self) -> "TorchZip":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
