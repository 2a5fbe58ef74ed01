"""The torch zip container, read without torch.

`torch.save` writes a zip whose entries are all STORED (uncompressed) and 64-byte aligned, so every
storage's bytes can be memory-mapped straight out of a local file: nothing is copied until it is written.
A rank file in object storage is read with ranged requests instead: the central directory, each entry's
local header, `data.pkl`, then only the storage byte ranges, block by block; never the whole file at once.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..locations import StorageOptions, filesystem, is_url, local, service_errors
from ..ranges import FileRange, RemoteRange

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class Entry:
    name: str
    offset: int  # absolute offset of the entry's first data byte
    size: int
    crc: int


def _open_regular(path: Path) -> Any:
    """Open a local file for reading only if it is a regular file: a directory, a FIFO (which would block)
    or a device (/dev/zero never ends) is refused with one line. O_NONBLOCK keeps a FIFO from hanging."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a rank file") from None
    except PermissionError:
        raise CheckpointError(f"{path}: permission denied") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(f"{path}: is {kind}, not a rank file")
    return os.fdopen(fd, "rb")


class TorchZip:
    """An open rank file: its entries by record name, over a read-only mmap (local) or ranged reads (URL)."""

    def __init__(self, path: str | os.PathLike[str], storage_options: StorageOptions | None = None):
        self.path = path if is_url(path) else Path(local(path))
        self._map: mmap.mmap | None = None
        self._remote: tuple[Any, str] | None = None
        if isinstance(self.path, Path):
            self._file: Any = _open_regular(self.path)
            self._size = os.fstat(self._file.fileno()).st_size
        else:
            try:
                fs, fspath = self._remote = filesystem(self.path, storage_options)
                self._size = int(fs.size(fspath))
                self._file = fs.open(fspath, "rb", block_size=1 << 16, cache_type="readahead")
            except FileNotFoundError:
                raise CheckpointError(f"{self.path}: no such file") from None
            except service_errors() as exc:  # a URL whose service cannot be reached
                raise CheckpointError(f"{self.path}: cannot open ({type(exc).__name__}: {str(exc)[:200]})") from None
        try:
            self.prefix, self.entries = self._index()
            if isinstance(self.path, Path) and self._size:
                self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except CheckpointError:
            self._file.close()
            raise
        except service_errors() as exc:
            self._file.close()
            if isinstance(self.path, Path):
                raise CheckpointError(f"{self.path}: cannot read ({exc.__class__.__name__}: {exc})") from None
            raise self._failed(exc) from None
        except BaseException:
            self._file.close()
            raise

    def _failed(self, exc: Exception) -> CheckpointError:
        """A remote read that failed (the service or the network), as the one line a user sees."""
        return CheckpointError(f"{self.path}: read failed ({type(exc).__name__}: {str(exc)[:200]}); rerun to continue")

    def _read(self, offset: int, length: int) -> bytes:
        if self._remote is None:
            return os.pread(self._file.fileno(), length, offset)
        fs, fspath = self._remote
        try:
            return fs.cat_file(fspath, start=offset, end=offset + length)
        except service_errors() as exc:  # the service or the network failed mid-read
            raise self._failed(exc) from None

    def _index(self) -> tuple[str, dict[str, Entry]]:
        try:
            infos = zipfile.ZipFile(self._file).infolist()
        except (zipfile.BadZipFile, ValueError, NotImplementedError, OSError, EOFError, struct.error,
                OverflowError, UnicodeDecodeError) as exc:
            # ValueError: a remote file too small to seek back in; the rest: a damaged central directory or
            # zip64 record (zipfile says so in many ways)
            if self._size and self._looks_legacy():
                raise CheckpointError(
                    f"{self.path}: a pre-1.6 (non-zip) torch.save file; re-save it with a newer torch"
                ) from None
            raise CheckpointError(f"{self.path}: not a torch checkpoint or truncated ({exc})") from None
        names = [zi.filename for zi in infos]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise CheckpointError(f"{self.path}: record {twice} appears twice (a zip readers disagree on; "
                                  f"forged or damaged)")
        pkl = [i.filename for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") == 1]
        if len(pkl) != 1:
            raise CheckpointError(f"{self.path}: not a torch checkpoint (no single <name>/data.pkl record)")
        prefix = pkl[0][: -len("data.pkl")]
        infos = [zi for zi in infos if zi.filename.startswith(prefix)]
        entries: dict[str, Entry] = {}
        encoded = [zi.orig_filename.encode("utf-8" if zi.flag_bits & 0x800 else "cp437", "replace") for zi in infos]
        try:
            headers = self._local_headers([zi.header_offset for zi in infos], [len(e) for e in encoded])
        except (OverflowError, ValueError, OSError) as exc:  # offsets no file of this size can have
            raise CheckpointError(f"{self.path}: corrupt zip (record offsets: {exc})") from None
        for zi, raw, local_name_wanted in zip(infos, headers, encoded):
            if zi.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{self.path}: record {zi.filename} is compressed; torch never writes that")
            if len(raw) < _LOCAL_HEADER.size or raw[:4] != _LOCAL_MAGIC:
                raise CheckpointError(f"{self.path}: corrupt zip (bad local header for {zi.filename})")
            fields = _LOCAL_HEADER.unpack(raw[:_LOCAL_HEADER.size])
            start = zi.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
            local_name = raw[_LOCAL_HEADER.size:_LOCAL_HEADER.size + fields[9]]
            sized = not fields[2] & 0x08  # bit 3: sizes follow the data instead of standing in the header
            if (local_name != local_name_wanted or fields[3] != zi.compress_type
                    or (sized and fields[7] not in (zi.compress_size, 0xFFFFFFFF))
                    or (sized and fields[8] not in (zi.file_size, 0xFFFFFFFF))):
                raise CheckpointError(f"{self.path}: record {zi.filename}: its local header disagrees with the "
                                      f"central directory (forged or damaged)")
            if start + zi.file_size > self._size:
                raise CheckpointError(f"{self.path}: truncated (record {zi.filename} runs past the end)")
            entries[zi.filename[len(prefix):]] = Entry(zi.filename, start, zi.file_size, zi.CRC)
        return prefix, entries

    def _local_headers(self, offsets: list[int], name_lengths: list[int]) -> list[bytes]:
        """Every entry's local header with its name: all at once, concurrently, when remote."""
        ends = [o + _LOCAL_HEADER.size + n for o, n in zip(offsets, name_lengths)]
        if self._remote is None:
            return [self._read(o, e - o) for o, e in zip(offsets, ends)]
        fs, fspath = self._remote
        try:
            return fs.cat_ranges([fspath] * len(offsets), offsets, ends, on_error="raise")
        except service_errors() as exc:
            raise self._failed(exc) from None

    def _looks_legacy(self) -> bool:
        return self._read(0, 2) == b"\x80\x02"

    def record(self, name: str) -> memoryview:
        """One record's bytes (e.g. "data.pkl", "data/3"): a zero-copy view of the mmap when local."""
        try:
            entry = self.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing record {self.prefix}{name}") from None
        if self._map is not None:
            return memoryview(self._map)[entry.offset: entry.offset + entry.size]
        return memoryview(self._read(entry.offset, entry.size) if entry.size else b"")

    def range(self, offset: int, length: int) -> FileRange | RemoteRange:
        """A byte range of the file, for a writer to copy: kernel-side when local, ranged reads when not."""
        if self._remote is not None:
            return RemoteRange(self._read, offset, length)
        return FileRange(self._file.fileno(), offset, length, str(self.path))

    def verify(self, name: str) -> None:
        """Check one record against the CRC-32 the zip stores for it (catches bit rot and torn copies)."""
        if zlib.crc32(self.record(name)) != self.entries[name].crc:
            raise CheckpointError(f"{self.path}: record {self.prefix}{name} fails its CRC check (corrupt file)")

    def storage_offset(self, key: str) -> int:
        """Absolute file offset of storage `key`: lets a writer copy it kernel-side (copy_file_range)."""
        return self.entries[f"data/{key}"].offset

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
