"""Which file a unit of work was: enough to tell the same file from another one without reading its data.

A store records the identity of every file it ingested, so a rerun skips a file only when it is the one
already in, and a rank's file replaced by another checkpoint's (the next step saved over `latest/`, a
same-size file re-downloaded from a newer run) is never mixed with what the store holds.

- A zip (every `torch.save` file: rank files, OLMo's model/optim/train files): the digest of its central
  directory, every record's name, size and CRC-32, which torch computed from the data as it wrote it. So
  it is a digest of the content: a copy is the same file, any changed tensor is another one.
- Anything else (safetensors shards, DCP's .distcp files, which hold one zip per item): the size and the
  first and last 64 KiB. A training step changes every parameter, so two steps' files differ there; a
  file whose bytes there are the same is, for this purpose, the same file.
Reading either costs one or two small reads from the file's ends (one request each on object storage).

Neither sees every byte: a file changed in its middle in place keeps its sampled ends, and a zip's
directory keeps the CRC-32s it was written with. So an identity also carries the file's stamp, what the
file system or object store says changes when a file does (`container.local_stamp`, `remote_stamp`):
`<content>@<stamp>`. A file whose stamp is the recorded one is the file ingested, with no read at all;
one whose stamp moved is never trusted by its content identity alone, but read again (ingest's
`_not_yet_done` and `source_changed`).
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, Callable

from ...errors import CheckpointError
from ...locations import StorageOptions, filesystem, is_url, name_of
from .container import DataFile, TorchZip, local_stamp, remote_stamp

SAMPLE = 1 << 16
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


def file_identity(path: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> str:
    """`zip:<digest>@<stamp>` or `sample:<digest>@<stamp>` of the file at `path` (see the module's
    docstring)."""
    data = DataFile(path, storage_options)
    try:
        return identity_of(data)
    finally:
        data.close()


def identity_of(data: DataFile) -> str:
    """The identity of a file already open."""
    entries = _whole_zip(data)
    return _stamped(_of_zip(data.size, entries) if entries is not None else _sampled(data), data)


def zip_identity(zf: TorchZip) -> str | None:
    """The identity of a file a worker already opened as a zip (a rank file), from the central directory
    it parsed; None where that zip is not the whole file (then `identity_of` its file)."""
    entries = _entries_if_whole(zf)
    return None if entries is None else _stamped(_of_zip(zf.file.size, entries), zf.file)


def container_identity(container: TorchZip | Any) -> str:
    """The identity of the file a unit's container (a torch zip, a safetensors file, a .distcp file) is
    read from: from the zip's parsed directory where it is the whole file, else from the file itself."""
    identity = zip_identity(container) if isinstance(container, TorchZip) else None
    return identity if identity is not None else identity_of(container.file)


def refuse_copies(paths: list[str], storage_options: StorageOptions | None, what: str,
                  replica: Callable[[str], Any] | None = None) -> None:
    """Refuse one rank's `what` copied over another's, where nothing inside the files says which rank wrote
    them (a ZeRO-3 optimizer file, FSDP1's flat optimizer shards) and a copy has every length right. No two
    ranks' parts of a model are the same bytes, so two files whose content identities agree (their zip
    directories: every record's name, size and CRC-32) are one file twice, unless `replica` gives both the
    same key (replicas of one shard under hybrid sharding hold the same bytes, genuinely)."""
    seen: dict[str, str] = {}
    for path in paths:
        first = seen.setdefault(content(file_identity(path, storage_options)), path)
        if first != path and (replica is None or replica(first) != replica(path)):
            raise CheckpointError(f"{path}: the same file as {name_of(first)} "
                                  f"(one rank's {what} copied over another's?); every rank saves its own part")


def file_stamp(path: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> str | None:
    """The stamp of the file at `path`, from one stat (one metadata request on object storage): no read."""
    if is_url(os.fspath(path)):
        fs, fspath = filesystem(os.fspath(path), storage_options)
        return remote_stamp(fs.info(fspath))
    return local_stamp(os.stat(path))


def content(identity: str) -> str:
    """What an identity says of the file's content, without its stamp."""
    return identity.split("@", 1)[0]


def stamp(identity: str) -> str | None:
    """The stamp an identity was recorded with (None in stores from before stamps)."""
    return identity.split("@", 1)[1] if "@" in identity else None


def _stamped(identity: str, data: DataFile) -> str:
    return identity if data.stamp is None else f"{identity}@{data.stamp}"


def _of_zip(size: int, entries: list[tuple[str, int, int]]) -> str:
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    for name, length, crc in sorted(entries):
        digest.update(f"\0{name}\0{length}\0{crc}".encode("utf-8", "surrogatepass"))
    return f"zip:{digest.hexdigest()}"


def _sampled(data: DataFile) -> str:
    digest = hashlib.blake2b(str(data.size).encode(), digest_size=16)
    digest.update(data.read(0, min(SAMPLE, data.size)))
    digest.update(data.read(max(0, data.size - SAMPLE), min(SAMPLE, data.size)))
    return f"sample:{digest.hexdigest()}"


def _whole_zip(data: DataFile) -> list[tuple[str, int, int]] | None:
    """Every record of the file as one zip, or None where it is not one (see `_entries_if_whole`)."""
    if data.size < _LOCAL_HEADER.size or data.read(0, 4) != b"PK\x03\x04":
        return None
    try:
        zf = TorchZip(data)
    except CheckpointError:
        return None
    return _entries_if_whole(zf)


def _entries_if_whole(zf: TorchZip) -> list[tuple[str, int, int]] | None:
    """The zip's records, where the zip is the whole file: its first record is the file's first local
    header. A .distcp file parses as a zip too, its last item's, which starts later in the file."""
    entries = list(zf.entries.values())
    if zf.start != 0 or zf.file.size < _LOCAL_HEADER.size or not entries:
        return None
    sig, name_len, extra_len = _LOCAL_HEADER.unpack(zf.file.read(0, _LOCAL_HEADER.size))
    if sig != b"PK\x03\x04" or min(e.offset for e in entries) != _LOCAL_HEADER.size + name_len + extra_len:
        return None
    return [(e.name, e.size, e.crc) for e in entries]
