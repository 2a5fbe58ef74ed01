"""The torch zip container, read without torch.

`torch.save` writes a zip whose entries are all STORED (uncompressed) and 64-byte aligned, so every
storage's bytes can be memory-mapped straight out of a local file: nothing is copied until it is written.
A rank file in object storage is read with ranged requests instead: the central directory, each entry's
local header, `data.pkl`, then only the storage byte ranges, block by block; never the whole file at once.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

from ...errors import CheckpointError
from ...locations import StorageOptions, filesystem, is_url, local, service_errors
from ...ranges import FileRange, RemoteRange

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class Entry:
    name: str
    offset: int  # absolute offset of the entry's first data byte
    size: int
    crc: int


class Container(Protocol):
    """What a unit's tensor bytes are read from, in place: a torch zip (`TorchZip`, also inside a .distcp
    file) or a safetensors file (safetensors_file.SafetensorsFile): what every format's pieces view."""

    path: str
    entries: dict[str, Any]  # "data/<key>" -> where each storage record lies

    @property
    def size(self) -> int: ...

    def range(self, offset: int, length: int) -> FileRange | RemoteRange: ...

    def storage_offset(self, key: str) -> int: ...

    def stored_crc(self, key: str) -> int | None: ...

    def record(self, name: str) -> memoryview: ...

    def close(self) -> None: ...


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
    except OSError as exc:  # a symbolic-link loop, a name too long, an I/O error
        raise CheckpointError(f"{path}: cannot open ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(f"{path}: is {kind}, not a rank file")
    return os.fdopen(fd, "rb")


GAP = 1 << 20  # remote ranges closer than this are read as one request (read_ranges) ...
KEPT_BYTES = 64 << 20  # ... while what that adds between them, kept in memory, stays below this
TAIL = 64 << 10  # a remote zip's end records and central directory (~80 bytes a record) come in one read
WHOLE = 8 << 20  # a remote zip up to this size (a rank file at a large world size) comes whole in one read


def local_stamp(st: os.stat_result) -> str:
    """What the file system says changes when a file does: its size, modification time and inode (a file
    replaced by a rename is another inode; one changed in place has a new modification time)."""
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def remote_stamp(info: dict[str, Any]) -> str | None:
    """An object store's word for an object's version: its version id, else its ETag, else its time."""
    for key in ("VersionId", "version_id", "ETag", "etag", "LastModified", "mtime", "last_modified"):
        if info.get(key):
            return f"{info['size']}:{info[key]}"
    return None


class DataFile:
    """One file, opened once: memory-mapped when local, read by ranged requests when a URL. Zips are read
    from windows of it (a rank file is one window; a DCP .distcp file holds one zip per item)."""

    def __init__(self, path: str | os.PathLike[str], storage_options: StorageOptions | None = None,
                 ahead: int = 0, opened: Any = None):
        """`ahead`: remote, the bytes at the file's end that its reader will want first, fetched with
        opening it where the service can say in the same answer how large the file is (`_open_tail`).
        `opened`: a local file already open that `path` only names (an anonymous temporary file holding a
        DCP item's decompressed bytes: read/primitives/transforms.py); closed with this."""
        self.path: str | Path = os.fspath(path) if is_url(path) else Path(local(path))
        self.named = opened is None  # the bytes are the file `path` names (else a temporary file it describes)
        self.stamp: str | None  # what says the file changed (local_stamp, remote_stamp)
        self._map: mmap.mmap | None = None
        self._remote: tuple[Any, str] | None = None
        self._spans: list[tuple[int, bytes]] = []  # remote bytes fetched already (read_ranges)
        if isinstance(self.path, Path) or opened is not None:
            self._file: Any = _open_regular(Path(self.path)) if opened is None else opened
            st = os.fstat(self._file.fileno())
            self.size, self.stamp = st.st_size, local_stamp(st)
            try:
                self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
            except BaseException:
                self._file.close()
                raise
        else:
            try:
                fs, fspath = self._remote = filesystem(str(self.path), storage_options)
                opened = _open_tail(fs, fspath, ahead)
                info = opened[0] if opened is not None else fs.info(fspath)
                self.size, self.stamp = int(info["size"]), remote_stamp(info)
                if opened is not None:
                    self._spans.append((self.size - len(opened[1]), opened[1]))
            except FileNotFoundError:
                raise CheckpointError(f"{self.path}: no such file") from None
            except service_errors() as exc:  # a URL whose service cannot be reached
                raise CheckpointError(f"{self.path}: cannot open ({type(exc).__name__}: {str(exc)[:200]}); "
                                      f"rerun to continue") from None
            self._file = None

    def failed(self, exc: BaseException) -> CheckpointError:
        """A read that failed (the service, the network or the disk), as the one line a user sees."""
        return CheckpointError(f"{self.path}: read failed ({type(exc).__name__}: {str(exc)[:200]}); rerun to continue")

    def read(self, offset: int, length: int) -> bytes:
        try:
            if self._remote is None:
                return os.pread(self._file.fileno(), length, offset)
            held = self._held(offset, length)
            if held is not None:
                return held
            fs, fspath = self._remote
            data: bytes = fs.cat_file(fspath, start=offset, end=offset + length)
            return data
        except (OverflowError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: corrupt (an offset no file can have: {exc})") from None
        except service_errors() as exc:
            raise self.failed(exc) from None

    def _held(self, offset: int, length: int) -> bytes | None:
        """Remote bytes fetched already (with the local headers around them), or None."""
        for start, data in self._spans:
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start:offset + length - start]
        return None

    def prefetch(self, offset: int, length: int) -> None:
        """Remote: fetch a range in one request and keep it, for the small reads that will follow (zipfile
        reads a zip's end records and central directory in four)."""
        if self._remote is not None and length > 0 and self._held(offset, length) is None:
            self._spans.append((offset, self.read(offset, length)))

    def read_ranges(self, starts: list[int], ends: list[int]) -> list[bytes]:
        """Several small ranges (a zip's local headers). Remote, ranges less than `GAP` apart are fetched as
        one request, concurrently, and what was fetched is kept: the records lying between the headers (an
        optimizer's step, an RNG state, a shard of up to a megabyte) are then read without a request each,
        and every byte is still fetched once."""
        if self._remote is None or all(self._held(s, e - s) is not None for s, e in zip(starts, ends)):
            return [self.read(s, e - s) for s, e in zip(starts, ends)]  # (a small zip fetched whole)
        spans: list[list[int]] = []
        budget = KEPT_BYTES
        for start, end in sorted(zip(starts, ends)):
            gap = start - spans[-1][1] if spans else GAP + 1
            if gap <= min(GAP, budget):
                spans[-1][1], budget = max(spans[-1][1], end), budget - max(gap, 0)
            else:
                spans.append([start, end])
        fs, fspath = self._remote
        try:
            fetched = fs.cat_ranges([fspath] * len(spans), [a for a, _ in spans], [b for _, b in spans],
                                    on_error="raise")
        except service_errors() as exc:
            raise self.failed(exc) from None
        self._spans += [(a, data) for (a, _), data in zip(spans, fetched)]
        return [self.read(s, e - s) for s, e in zip(starts, ends)]

    def window(self, start: int, length: int) -> io.RawIOBase:
        """Bytes [start, start + length) as a seekable file of their own."""
        return _Window(self, start, length)

    def view(self, offset: int, length: int) -> memoryview:
        """Bytes of the file: a zero-copy view of the mmap when local."""
        if self._map is not None:
            return memoryview(self._map)[offset: offset + length]
        return memoryview(self.read(offset, length) if length else b"")

    def range(self, offset: int, length: int) -> FileRange | RemoteRange:
        """A byte range for a writer to copy: kernel-side when local, ranged reads when not."""
        if self._remote is not None:
            return RemoteRange(self.read, offset, length)
        return FileRange(self._file.fileno(), offset, length, str(self.path))

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # A caller still holds a view; the map is freed with the last view instead.
                pass
        if self._file is not None:
            self._file.close()


def _open_tail(fs: Any, fspath: str, ahead: int) -> tuple[dict[str, Any], bytes] | None:
    """On S3 (s3fs), the last `ahead` bytes of an object (all of it, if smaller) with what a HEAD would have
    said (its size, ETag, version): one request where a HEAD and a read took two, for every rank file of an
    ingest. None elsewhere, or if the service refuses a suffix range (an empty object, an S3 look-alike
    without them): the caller then asks as before, and reports what fails from there."""
    call = getattr(fs, "_call_s3", None)
    if ahead <= 0 or call is None or not hasattr(fs, "split_path"):
        return None
    from fsspec.asyn import sync

    async def get() -> tuple[dict[str, Any], bytes]:
        bucket, key, version = fs.split_path(fspath)
        resp = await call("get_object", Bucket=bucket, Key=key, Range=f"bytes=-{ahead}",
                          **({"VersionId": version} if version else {}))
        try:
            return resp, await resp["Body"].read()
        finally:
            resp["Body"].close()

    try:
        resp, body = sync(fs.loop, get)
        total = str(resp.get("ContentRange") or "").rsplit("/", 1)[-1]
        size = int(total) if total.isascii() and total.isdigit() else len(body)
    except Exception:  # noqa: BLE001 - whatever it was, the plain way (a HEAD) says it properly
        return None
    if len(body) != min(ahead, size):
        return None
    return {"size": size, **{k: resp.get(k) for k in ("VersionId", "ETag", "LastModified")}}, body


def read_small(path: str | os.PathLike[str], storage_options: StorageOptions | None, limit: int, what: str) -> bytes:
    """A whole metadata-sized file (DCP's .metadata, metadata.json, config.yaml): refused, naming `what` it
    should be, when larger than `limit`, so memory stays bounded by what such a file can be."""
    data = DataFile(path, storage_options)
    try:
        if data.size > limit:
            raise CheckpointError(f"{data.path}: {data.size} bytes; not {what}")
        return bytes(data.view(0, data.size))
    finally:
        data.close()


_PARSED: dict[tuple[str, str, str], Any] = {}
# Parses kept by a process, the least recently used dropped first: a worker reads one checkpoint (a few
# of its folders at most), but a process that plans one after another (`follow`, a notebook) would
# otherwise keep every one it ever read (a W=4096 .metadata parsed: 16 MB).
PARSED_KEPT = 4


Parsed = TypeVar("Parsed")


def parsed_once(kind: str, folder: str, storage_options: StorageOptions | None,
                parse: Callable[[str, StorageOptions | None], Parsed]) -> Parsed:
    """`parse(folder, storage_options)`, once per process until `forget_parsed`: a checkpoint's metadata,
    which finding the checkpoint, planning it and every unit a worker opens need, and which grows with the
    world size."""
    key = (kind, folder, repr(sorted((storage_options or {}).items())))
    parsed: Parsed = _PARSED.pop(key) if key in _PARSED else parse(folder, storage_options)
    _PARSED[key] = parsed
    while len(_PARSED) > PARSED_KEPT:
        del _PARSED[next(iter(_PARSED))]
    return parsed


def forget_parsed() -> None:
    """Drop every parse: a checkpoint is about to be found anew, and its folders may have been saved again
    in place since this process last read them."""
    _PARSED.clear()


class _Window(io.RawIOBase):
    """A window of a DataFile as a seekable file, for zipfile to parse."""

    def __init__(self, data: DataFile, start: int, length: int):
        self.data, self.start, self.length, self.pos = data, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        if self.pos < 0:
            raise ValueError("negative seek position")
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        data = self.data.read(self.start + self.pos, n) if n else b""
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


class TorchZip:
    """A torch.save zip: its entries by record name. The whole of a file (a rank file), or a window of one
    (`start`, `length`: an item of a DCP .distcp file), read through a DataFile that may be shared."""

    def __init__(self, path: str | os.PathLike[str] | DataFile, storage_options: StorageOptions | None = None,
                 start: int = 0, length: int | None = None, owns: bool = False):
        """`owns`: a DataFile given is closed with the zip (one made for it alone: transforms.py)."""
        self._owns = owns or not isinstance(path, DataFile)
        self.file: DataFile = path if isinstance(path, DataFile) else DataFile(path, storage_options, WHOLE)
        self.path = str(self.file.path)
        self.start = start
        self._size = self.file.size - start if length is None else length
        try:
            if not self.file.size and self.file.named:  # (a value that decompressed to nothing: not a zip, below)
                raise CheckpointError(f"{self.path}: an empty file (0 bytes): truncated, or still being written")
            if start < 0 or self._size < 0 or start + self._size > self.file.size:
                raise CheckpointError(f"{self.path}: item at {start} (+{self._size}) lies outside the file")
            # The central directory; a small zip file whole (an ingest reads all of it: one request, not
            # ten). Not a zip inside a shared file (a .distcp's items): what is fetched lives as long as the file.
            whole = self._owns and self._size <= WHOLE
            ahead = self._size if whole else min(self._size, TAIL)
            self.file.prefetch(start + self._size - ahead, ahead)
            self.prefix, self.entries = self._index()
        except BaseException:
            self.close()
            raise

    def _read(self, offset: int, length: int) -> bytes:
        """Bytes at `offset` within this zip's window."""
        return self.file.read(self.start + offset, length)

    def _index(self) -> tuple[str, dict[str, Entry]]:
        try:
            infos = zipfile.ZipFile(self.file.window(self.start, self._size)).infolist()
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
            entries[zi.filename[len(prefix):]] = Entry(zi.filename, self.start + start, zi.file_size, zi.CRC)
        return prefix, entries

    def _local_headers(self, offsets: list[int], name_lengths: list[int]) -> list[bytes]:
        """Every entry's local header with its name (offsets within the window)."""
        return self.file.read_ranges([self.start + o for o in offsets],
                                     [self.start + o + _LOCAL_HEADER.size + n for o, n in zip(offsets, name_lengths)])

    def _looks_legacy(self) -> bool:
        return self._read(0, 2) == b"\x80\x02"

    def record(self, name: str) -> memoryview:
        """One record's bytes (e.g. "data.pkl", "data/3"): a zero-copy view of the mmap when local."""
        try:
            entry = self.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing record {self.prefix}{name}") from None
        return self.file.view(entry.offset, entry.size)

    def range(self, offset: int, length: int) -> FileRange | RemoteRange:
        """A byte range of the file (absolute offsets), for a writer to copy."""
        return self.file.range(offset, length)

    def verify(self, name: str) -> None:
        """Check one record against the CRC-32 the zip stores for it (catches bit rot and torn copies)."""
        if zlib.crc32(self.record(name)) != self.entries[name].crc:
            raise CheckpointError(f"{self.path}: record {self.prefix}{name} fails its CRC check (corrupt file)")

    def storage_offset(self, key: str) -> int:
        """Absolute file offset of storage `key`: lets a writer copy it kernel-side (copy_file_range)."""
        return self.entries[f"data/{key}"].offset

    def stored_crc(self, key: str) -> int:
        """The CRC-32 the zip stores for storage `key` (the torch export combines these: crc.py)."""
        return self.entries[f"data/{key}"].crc

    @property
    def size(self) -> int:
        return self._size

    def close(self) -> None:
        if self._owns:
            self.file.close()

    def __enter__(self) -> "TorchZip":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
