"""Output files: written under a temporary name and renamed into place only when complete.

A crash or an error mid-export therefore never leaves a file that looks finished. Parts are the store's
(bytes, or file ranges that are copied kernel-side); `checksum` lets the torch writer see every byte it
copies, which the zip format needs.
"""

from __future__ import annotations

import base64
import errno
import os
import zlib
from pathlib import Path
from typing import Callable, Iterable

from .. import tempfiles
from ..errors import ExportError
from ..ranges import FileRange, Part, blocks, copy_range, copy_summed

# What a user's output folder can do to an export: one line, not a traceback.
_USER_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "not permitted",
                errno.ENOTDIR: "a part of the path is a file", errno.EEXIST: "exists and is not a directory",
                errno.EISDIR: "is a directory", errno.ENAMETOOLONG: "name too long",
                errno.EFBIG: "a file larger than its file system allows"}


def output_error(out: Path, exc: OSError) -> ExportError | None:
    """The one-line error for an OSError the output folder caused, or None for anything else (a bug)."""
    why = _USER_ERRNOS.get(exc.errno or 0)
    if why is None:
        return None
    where = exc.filename if isinstance(exc.filename, str) else str(out)
    return ExportError(f"{where}: cannot write the export: {why}; nothing half-written was left")


class OutputFile:
    reopened = False

    def __init__(self, path: Path, progress: Callable[[int], None] | None = None):
        self.path = path
        self.tmp = tempfiles.temp_path(path)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.pos = 0
        self.progress = progress

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        while view:
            view = view[os.write(self.fd, view):]
        self.pos += n
        if self.progress:
            self.progress(n)

    def write_parts(self, parts: Iterable[Part], crc: int | None = None) -> int | None:
        """Append parts; with `crc` given, also return the running CRC-32 over everything written."""
        if crc is not None:
            for part in parts:
                if isinstance(part, FileRange):  # summed in place, copied kernel-side (ranges.copy_summed)
                    crc = copy_summed(part, self.fd, self.pos, crc)
                    self.pos = os.lseek(self.fd, part.length, os.SEEK_CUR)
                    if self.progress:
                        self.progress(part.length)
                    continue
                for block in blocks([part]):
                    crc = zlib.crc32(block, crc)
                    self.write(block)
            return crc
        for part in parts:
            if isinstance(part, FileRange):
                copy_range(part, self.fd)
                self.pos += part.length
                if self.progress:
                    self.progress(part.length)
            else:  # bytes, or a remote source's range: in bounded blocks
                for block in blocks([part]):
                    self.write(block)
        return None

    def pwrite(self, data: bytes, offset: int) -> None:
        os.pwrite(self.fd, data, offset)

    def skip(self, n: int) -> None:
        """Leave `n` bytes for a later `pwrite` (a hole the file system keeps sparse)."""
        os.lseek(self.fd, n, os.SEEK_CUR)
        self.pos += n

    def commit(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        if not self.reopened:
            os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.reopened:
            self.tmp.unlink(missing_ok=True)

    @classmethod
    def reopen(cls, path: Path, pos: int) -> "OutputFile":
        """A file laid out earlier (sink/, each format's `plan_direct`), written on from `pos`, whatever followed it cut off:
        committing makes it durable where it is; aborting leaves it for a rerun to write on again."""
        out = cls.__new__(cls)
        out.path = out.tmp = path
        out.fd = os.open(path, os.O_RDWR)
        os.ftruncate(out.fd, pos)
        os.lseek(out.fd, pos, os.SEEK_SET)
        out.pos, out.progress, out.reopened = pos, None, True
        return out

    def __enter__(self) -> "OutputFile":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_side_files(side_files: dict[str, str], out: Path) -> list[Path]:
    """The run's files the store kept (config.yaml: OLMo's unsharder copies it beside model.pt, and the
    Hugging Face converters read it from there), written back byte for byte."""
    written = []
    for name, data in side_files.items():
        with OutputFile(out / name) as f:
            f.write(base64.b64decode(data))
        written.append(out / name)
    return written
