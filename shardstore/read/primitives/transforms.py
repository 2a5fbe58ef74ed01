"""torch DCP's stream transforms: items FileSystemWriter wrote through its `_extensions` (torch >= 2.7).

Such an item is not a torch.save zip in place but that zip passed through each transform, its `.metadata`
entry listing them (`transform_descriptors`, in the order a reader undoes them). torch's own reader knows
one, ZStandard (`stream.zstd/1`, torch.distributed.checkpoint._extension), through the `zstandard` module
(or pyzstd); so does shardstore, through `zstandard`, an optional dependency as it is torch's: `pip install
'shardstore[zstd]'`. Anything else torch's reader refuses too, and so is refused here, at plan time.

An item is decompressed as a stream, a block at a time, into an anonymous temporary file (in TMPDIR) that
its zip is then read from in place like any other: memory stays a block or two, whatever the item's size.
The bytes it may grow to are bounded by what the item can hold (its tensor's bytes and a zip's records),
so a small forged item cannot fill the disk.
"""

from __future__ import annotations

import tempfile
from typing import Any

from ...errors import CheckpointError
from .container import DataFile

ZSTD = "stream.zstd"  # ZStandard.registry_name(); its descriptor is "stream.zstd/1"
ZSTD_VERSION = "1"  # the major version torch's ZStandard.from_descriptor accepts
INSTALL = "pip install 'shardstore[zstd]'"
BLOCK = 1 << 20


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def checked(descriptors: Any, where: str) -> tuple[str, ...]:
    """An item's transforms, if torch's default reader reads them: each ZStandard of major version 1 (as
    its ExtensionRegistry decides) and the zstandard module at hand. None or [] is a plain item."""
    if descriptors is None:
        return ()
    if not isinstance(descriptors, (list, tuple)) or not all(isinstance(d, str) for d in descriptors):
        raise CheckpointError(f"{where}: transform descriptors {descriptors!r:.80} are not a list of names")
    for descriptor in descriptors:
        name, _, version = descriptor.partition("/")
        if name != ZSTD or version.partition(".")[0] != ZSTD_VERSION:
            raise CheckpointError(f"{where}: stored through transforms {list(descriptors)!r:.80}, which torch's own "
                                  f"reader does not read either (it reads {ZSTD}/{ZSTD_VERSION})")
    if descriptors and _zstandard() is None:
        raise CheckpointError(f"{where}: stored through ZStandard ({ZSTD}/{ZSTD_VERSION}); reading it needs the "
                              f"zstandard module: {INSTALL}")
    return tuple(descriptors)


def decoded(data: DataFile, offset: int, length: int, transforms: tuple[str, ...], most: int,
            where: str) -> DataFile:
    """The item at [offset, offset + length) of `data` with its transforms undone (`checked` ones: each a
    ZStandard stream of one or more frames), in a temporary file deleted when the DataFile is closed.
    Refused in one line when it is not ZStandard data or would decompress to more than `most` bytes. A
    stream cut short decompresses to a zip without its end records, which its reader then refuses."""
    zstandard = _zstandard()
    stream: Any = data.window(offset, length)
    for _ in transforms:
        stream = zstandard.ZstdDecompressor().stream_reader(stream, read_size=BLOCK, read_across_frames=True)
    out = tempfile.TemporaryFile(prefix="shardstore-item-")
    try:
        size = 0
        while True:
            try:
                block = stream.read(BLOCK)
            except zstandard.ZstdError as exc:
                raise CheckpointError(f"{where}: not the ZStandard stream its metadata says ({exc}; forged or "
                                      f"damaged)") from None
            if not block:
                break
            size += len(block)
            if size > most:
                raise CheckpointError(f"{where}: decompresses to more than the {most} bytes the item can hold "
                                      f"(forged or damaged)")
            out.write(block)
        out.flush()
        return DataFile(f"{data.path}: {where} (decompressed)", opened=out)
    except BaseException:
        out.close()
        raise
