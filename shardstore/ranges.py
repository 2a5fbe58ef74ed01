"""Byte ranges and the parts writers take: in memory, a range of a local file, or a range of a remote one.

Shared by every stage, so a writer never needs to know where its bytes come from: a local range is copied
kernel-side (copy_file_range), a remote one is fetched in bounded blocks, memory is copied only once.
"""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Union

from .errors import StoreError


@dataclass(frozen=True)
class FileRange:
    """`length` bytes of an open local file at `offset`: copied kernel-side, never through Python."""

    fd: int
    offset: int
    length: int
    source: str = "source file"  # named in errors


@dataclass(frozen=True)
class RemoteRange:
    """`length` bytes at `offset` of a remote object, fetched by ranged reads in bounded blocks."""

    read: Callable[[int, int], bytes]  # (offset, length) -> bytes
    offset: int
    length: int


Part = Union[bytes, bytearray, memoryview, FileRange, RemoteRange]
BLOCK = 16 << 20
# copy_file_range cannot copy between these files (other file systems, an old kernel): copy through memory
NOT_HERE = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def part_length(part: Part) -> int:
    return part.length if isinstance(part, (FileRange, RemoteRange)) else memoryview(part).nbytes


def blocks(parts: Iterable[Part], size: int = BLOCK) -> Iterator[bytes | memoryview]:
    """Parts as in-memory blocks of at most `size` bytes: memory stays bounded whatever a part's size."""
    for part in parts:
        if isinstance(part, (FileRange, RemoteRange)):
            for off in range(part.offset, part.offset + part.length, size):
                n = min(size, part.offset + part.length - off)
                data = os.pread(part.fd, n, off) if isinstance(part, FileRange) else part.read(off, n)
                if len(data) != n:
                    source = part.source if isinstance(part, FileRange) else "remote source"
                    raise StoreError(f"{source} ended {part.offset + part.length - off - len(data)} bytes early "
                                     f"(changed while being read?)")
                yield data
        else:
            view = memoryview(part).cast("B")
            for off in range(0, len(view), size):
                yield view[off:off + size]


def joined(parts: Iterable[Part]) -> bytes:
    """Parts as one bytes object: for the few small ones that are kept or compared whole (a unit's staged
    bytes, an assembled cell)."""
    return b"".join(blocks(parts))


def copy_summed(src: FileRange, dst_fd: int, dst_offset: int, crc: int = 0) -> int:
    """Copy `src` to `dst_offset` of `dst_fd` and return the CRC-32 of its bytes (continuing `crc`). Each block is summed
    through a read-only map of the source (the page cache itself, faulted in from the disk once) and then
    copied kernel-side from those cached pages: the bytes never pass through a Python buffer. Reading each
    block into memory, summing it and writing it back took 1.2-1.7x as long (a zip entry of a Megatron or
    DCP export: every tensor's bytes are summed). The map is one block at a time, so what the process
    holds resident stays bounded; a source that cannot be mapped is copied through memory."""
    at, end = src.offset, src.offset + src.length
    if os.fstat(src.fd).st_size < end:
        raise StoreError(f"{src.source} ended {end - os.fstat(src.fd).st_size} bytes early (changed while being read?)")
    while at < end:
        n = min(BLOCK, end - at)
        base = at - at % mmap.ALLOCATIONGRANULARITY
        try:
            window = mmap.mmap(src.fd, at + n - base, prot=mmap.PROT_READ, offset=base)
        except (OSError, ValueError):  # a file system without mmap: through memory
            for data in blocks([FileRange(src.fd, at, end - at, src.source)]):
                crc = zlib.crc32(data, crc)
                pwrite_all(dst_fd, data, dst_offset + at - src.offset)
                at += part_length(data)
            return crc
        with window, memoryview(window) as view:
            crc = zlib.crc32(view[at - base:], crc)
        copy_range(FileRange(src.fd, at, n, src.source), dst_fd, dst_offset + at - src.offset)
        at += n
    return crc


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """All of `data` at `offset` (os.pwrite may write less than it is given)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def copy_range(src: FileRange, dst_fd: int, dst_offset: int | None = None) -> None:
    """Copy `src` into `dst_fd`, kernel-side where the two files allow it: at the file's position, or at
    `dst_offset` (the position left as it is, so several writers can fill one file)."""
    offset, left = src.offset, src.length
    while left:
        try:
            n = os.copy_file_range(src.fd, dst_fd, min(left, 1 << 30), offset, dst_offset)
        except OSError as exc:
            if exc.errno not in NOT_HERE:
                raise
            n = 0
        if n == 0:  # not supported here (or a short source): fall back to plain reads
            data = os.pread(src.fd, min(left, 16 << 20), offset)
            if not data:
                raise StoreError(f"{src.source} ended {left} bytes early (changed while being read?)")
            n = os.write(dst_fd, data) if dst_offset is None else os.pwrite(dst_fd, data, dst_offset)
        offset += n
        left -= n
        if dst_offset is not None:
            dst_offset += n
