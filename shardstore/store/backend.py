"""Where store bytes live. Everything above talks to a `Backend`, never to paths.

The local backend writes every object atomically (temp file + rename, so a crash leaves either the old
object or the new one, never half of one) and copies file ranges kernel-side with copy_file_range, which
is what lets ingestion run at the speed of the disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    import zarr.abc.store

from .. import tempfiles
from ..errors import StoreError
from ..locations import StorageOptions, filesystem, is_url, local, service_errors
from ..ranges import BLOCK, FileRange, Part, blocks, copy_range


class Writer(Protocol):
    """One object written in appends: `write` (any number of times), then `close` (the object appears
    whole; a `close` that fails leaves nothing) or `abort` (nothing appears). A store format 4 pack
    (store/packs.py) is one."""

    def write(self, parts: Iterable[Part]) -> int: ...  # the bytes appended
    def close(self, durable: bool = False) -> None: ...
    def abort(self) -> None: ...


W = TypeVar("W", bound=Writer)


def _written(writer: W, parts: Iterable[Part]) -> W:
    """`writer` with `parts` appended, or aborted if appending failed (a read error in a source, a full disk)."""
    try:
        writer.write(parts)
    except BaseException:
        writer.abort()
        raise
    return writer


class Backend(Protocol):
    root: str
    storage_options: StorageOptions

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes: ...
    def read_many(self, keys: Sequence[str], length: int | None = None) -> list[bytes | None]: ...
    def write(self, key: str, parts: Iterable[Part], durable: bool = False) -> None: ...
    def open_writer(self, key: str) -> Writer: ...
    def write_many(self, items: Sequence[tuple[str, bytes]]) -> None: ...
    def publish(self, items: Sequence[tuple[str, bytes]], after: Iterable[str]) -> None: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> list[str]: ...
    def size(self, key: str) -> int: ...
    def local_path(self, key: str) -> Path | None: ...
    def sync(self, keys: Iterable[str]) -> None: ...
    def sweep_temporaries(self) -> int: ...
    def zarr_store(self, read_only: bool = True) -> zarr.abc.store.Store: ...


@functools.cache
def _libc(name: str) -> Any:
    """A function of libc on Linux (syncfs(2), sync_file_range(2)); None elsewhere. Looked up at its
    first use, from the process's own symbols: `ctypes.util.find_library` runs ldconfig, 10 ms of every
    command's start-up when it ran at import."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if name == "sync_file_range":
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


SYNC_FILE_RANGE_WRITE = 2
# A cell at least this large has its writeback started as soon as it is written, while the next is read, so
# that the rank's one sync waits for less; below it the call costs more than it saves (DeepSeek-V3's
# structure: 92k cells of a few KB, 4 s of sync_file_range in one process).
EARLY_WRITEBACK_BYTES = 1 << 20


class LocalBackend:
    """A directory on a local (or network-mounted POSIX) file system."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.fspath(Path(root).absolute())
        self.storage_options: StorageOptions = {}
        self._made: set[Path] = set()  # folders this process made or found: a rank's ~400 cells share a few

    def _path(self, key: str) -> Path:
        return Path(self.root, key)

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise KeyError(key) from None

    def read_many(self, keys: Sequence[str], length: int | None = None) -> list[bytes | None]:
        """Several small objects (the first `length` bytes of each), None for each one that is missing."""
        return [_or_none(self.read, key, 0, length) for key in keys]

    def write_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Several small objects, each written as `write` would (not durable)."""
        for key, data in items:
            self.write(key, [data])

    def write(self, key: str, parts: Iterable[Part], durable: bool = False) -> None:
        _written(self.open_writer(key), parts).close(durable)

    def open_writer(self, key: str) -> "_LocalWriter":
        with self._user_errors(key):
            return _LocalWriter(self, key)

    def publish(self, items: Sequence[tuple[str, bytes]], after: Iterable[str]) -> None:
        """Write small objects (commit records) that may appear only once they and every object `after`
        names are durable. Each is written under a temporary name, one sync makes all of it durable,
        then each is renamed into place and their folders synced: a batch of units pays two flushes of
        the disk, not two or three per unit. A crash before a rename leaves a temporary (swept); after
        it, the object is whole."""
        staged: list[tuple[Path, Path]] = []
        try:
            with self._user_errors(items[0][0] if items else self.root):
                for key, data in items:
                    staged.append(self._stage(key, [data], durable=False))
                self.sync([*after, *(os.path.relpath(tmp, self.root) for tmp, _ in staged)])
                for tmp, path in staged:
                    self._rename(tmp, path)
                for folder in {path.parent for _, path in staged}:
                    self._sync_dir(folder)
        except BaseException:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
            raise

    @contextlib.contextmanager
    def _user_errors(self, key: str) -> Iterator[None]:
        """What a full or read-only disk does to a write: one line naming the store, not a traceback."""
        try:
            yield
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreError(f"{self.root}: no space left on device while writing {key}; the rank is not "
                                 f"marked done: free some space and run the same command again") from None
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise StoreError(f"{self.root}: cannot write {key}: {exc.strerror}") from None
            raise

    def _stage(self, key: str, parts: Iterable[Part], durable: bool) -> tuple[Path, Path]:
        """`key`'s bytes under a temporary name beside it (made durable with `durable`): (temporary, final)."""
        return _written(_LocalWriter(self, key), parts).finish(durable)

    def _folder(self, path: Path) -> None:
        if path.parent not in self._made:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made.add(path.parent)

    @staticmethod
    def _rename(tmp: Path, path: Path) -> None:
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @staticmethod
    def _sync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync(self, keys: Iterable[str]) -> None:
        """Make earlier non-durable writes durable: one syncfs(2) of the store's file system where there is
        one (Linux), else one fsync per file, then per directory. At world size 1024 a rank writes ~400
        small cells, and one syncfs took a fifth of the time of their fsyncs (0.05 s against 0.23 s); with
        few large cells the two cost the same, since the data's own writeback dominates."""
        if _libc("syncfs") is not None:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if _libc("syncfs")(fd) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, os.strerror(code), self.root)
            finally:
                os.close(fd)
            return
        dirs = set()
        for key in keys:
            path = self._path(key)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(path.parent)
        for d in dirs:
            self._sync_dir(d)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def sweep_temporaries(self) -> int:
        """Remove temporaries whose writing process no longer exists."""
        return tempfiles.sweep(self.root)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise KeyError(key) from None

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(f"{prefix.rstrip('/')}/{p.name}" for p in base.iterdir() if not tempfiles.is_temp(p.name))

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def zarr_store(self, read_only: bool = True) -> zarr.abc.store.Store:
        import zarr.storage

        return zarr.storage.LocalStore(self.root, read_only=read_only)


class _LocalWriter:
    """A local object being written: under a temporary name beside it until `close` renames it into place."""

    def __init__(self, backend: LocalBackend, key: str):
        self.backend, self.key = backend, key
        self.path = backend._path(key)
        backend._folder(self.path)
        self.tmp = tempfiles.temp_path(self.path)
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # its folder was removed since (a store deleted and made again)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.written = 0

    def write(self, parts: Iterable[Part]) -> int:
        before = self.written
        with self.backend._user_errors(self.key):
            for part in parts:
                if isinstance(part, FileRange):
                    copy_range(part, self.fd)
                    self.written += part.length
                    continue
                for block in blocks([part]):
                    view = memoryview(block).cast("B")
                    self.written += len(view)
                    while view:
                        view = view[os.write(self.fd, view):]
        return self.written - before

    def finish(self, durable: bool) -> tuple[Path, Path]:
        """Written whole, still under its temporary name: (temporary, final)."""
        try:
            with self.backend._user_errors(self.key):
                if durable:
                    os.fsync(self.fd)
                elif self.written >= EARLY_WRITEBACK_BYTES and _libc("sync_file_range") is not None:
                    _libc("sync_file_range")(self.fd, 0, 0, SYNC_FILE_RANGE_WRITE)
        except BaseException:
            self.abort()
            raise
        os.close(self.fd)
        self.fd = -1
        return self.tmp, self.path

    def close(self, durable: bool = False) -> None:
        tmp, path = self.finish(durable)
        with self.backend._user_errors(self.key):
            self.backend._rename(tmp, path)
            if durable:
                self.backend._sync_dir(path.parent)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


TOGETHER = 16  # requests in flight at once (FsspecBackend.read_many, write_many)


class FsspecBackend:
    """Object storage (S3 and anything else fsspec reaches). A PUT is atomic (an object appears whole or
    not at all), so writes need no rename, and a commit record written last is a commit record. Network
    and service failures become one StoreError line; rerunning the command continues where it stopped."""

    def __init__(self, url: str, storage_options: StorageOptions | None = None):
        self.root = url.rstrip("/")
        self.storage_options = storage_options or {}
        self.fs, self._base = filesystem(self.root, self.storage_options)
        self._base = self._base.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self._base}/{key}" if key else self._base

    def _call(self, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise KeyError(key) from None
        except service_errors() as exc:  # the service or the network failed
            raise self._failed(key, exc) from None

    def _failed(self, key: str, exc: BaseException) -> StoreError:
        """The one line a failed request becomes."""
        return StoreError(f"{self.root}: {key or 'store'}: object storage failed ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); nothing half-written was kept, rerun to continue")

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        data: bytes = self._call(key, self.fs.cat_file, self._path(key), start=start or None,  # (no range: an empty
                          end=None if length is None else start + length)  # object has no byte 0 to ask for)
        return data

    def read_many(self, keys: Sequence[str], length: int | None = None) -> list[bytes | None]:
        """Several small objects (the first `length` bytes of each), None for each one that is missing: the
        requests go out together (fsspec's concurrent `cat_ranges`), so a coordinator's checks of a few
        hundred arrays wait for the service once, not once each."""
        if not keys:
            return []
        got = self._call(keys[0], self.fs.cat_ranges, [self._path(k) for k in keys],
                         [None if length is None else 0] * len(keys), [length] * len(keys), on_error="return",
                         **self._together())
        out: list[bytes | None] = []
        for key, data in zip(keys, got):
            if isinstance(data, FileNotFoundError):
                out.append(None)
            elif isinstance(data, service_errors()):
                raise self._failed(key, data) from None
            elif isinstance(data, BaseException):
                raise data
            else:
                out.append(data)
        return out

    def write_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Several small objects, their PUTs sent together (fsspec's concurrent `pipe`). Each appears whole
        or not at all; if one fails, the others may have appeared (nothing committed names them yet)."""
        if items:
            self._call(items[0][0], self.fs.pipe, {self._path(key): bytes(data) for key, data in items},
                       **self._together())

    def _together(self) -> dict[str, int]:
        """How many requests an async filesystem (s3fs) has in flight at once. fsspec's default (1280) made
        a W=256 ingest from and into S3 peak at 305 MB in one process against 254 MB with 4 at a time, at the
        same speed; 16 was 259 MB."""
        return {"batch_size": TOGETHER} if getattr(self.fs, "async_impl", False) else {}

    def write(self, key: str, parts: Iterable[Part], durable: bool = False) -> None:
        _written(self.open_writer(key), parts).close()

    def open_writer(self, key: str) -> "_FsspecWriter":
        return _FsspecWriter(self, key)

    def exists(self, key: str) -> bool:
        return bool(self._call(key, self.fs.exists, self._path(key)))

    def size(self, key: str) -> int:
        return int(self._call(key, self.fs.size, self._path(key)))

    def list(self, prefix: str) -> list[str]:
        try:
            names = self._call(prefix, self.fs.ls, self._path(prefix), detail=False, refresh=True)
        except KeyError:
            return []
        return sorted(f"{prefix.rstrip('/')}/{n.rstrip('/').rsplit('/', 1)[-1]}" for n in names)

    def local_path(self, key: str) -> Path | None:
        return None

    def sync(self, keys: Iterable[str]) -> None:
        """Nothing to do: an object is durable once its PUT returns."""

    def publish(self, items: Sequence[tuple[str, bytes]], after: Iterable[str]) -> None:
        """Their PUTs, together: what `after` names is durable already, and each object is whole or absent."""
        self.write_many(items)

    def sweep_temporaries(self) -> int:
        return 0  # writes are never visible half-done, so nothing is left behind

    def zarr_store(self, read_only: bool = True) -> zarr.abc.store.Store:
        import zarr.storage

        return zarr.storage.FsspecStore.from_url(self.root, storage_options=self.storage_options,
                                                 read_only=read_only)


class _FsspecWriter:
    """An object being uploaded: one block in memory, a multipart upload beyond it; it appears at `close`."""

    def __init__(self, backend: FsspecBackend, key: str):
        self.backend, self.key = backend, key
        self.f = backend._call(key, backend.fs.open, backend._path(key), "wb", block_size=BLOCK)

    def write(self, parts: Iterable[Part]) -> int:
        written = 0
        for block in blocks(parts):
            self.backend._call(self.key, self.f.write, block)
            written += memoryview(block).nbytes
        return written

    def close(self, durable: bool = False) -> None:
        """(Durable once the PUT returns.)"""
        try:
            self.backend._call(self.key, self.f.close)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        discard = getattr(self.f, "discard", None)
        if discard is not None:  # abort the multipart upload: nothing half-written ever appears
            with contextlib.suppress(Exception):
                discard()
        self.f.closed = True  # and never let the file's finalizer try to finish it later


def _or_none(read: Callable[[str, int, int | None], bytes], key: str, start: int, length: int | None) -> bytes | None:
    try:
        return read(key, start, length)
    except KeyError:
        return None


def open_backend(location: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> Backend:
    if is_url(os.fspath(location)):
        return FsspecBackend(os.fspath(location), storage_options)
    return LocalBackend(local(location))
