"""A safetensors file read in place, presented like a torch zip so the same tensor checks and copies apply.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes
of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data,
offsets relative to its start. Nothing in the header is trusted until checked: the length against the
file, each tensor's byte count against its dtype and shape, every range inside the data and no two ranges
overlapping. Each tensor then becomes a storage record ("data/<name>") and a contiguous `TensorRef`.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

from ... import dtypes, jsonin
from ...errors import CheckpointError
from ...locations import StorageOptions
from ...ranges import FileRange, RemoteRange
from ...records import StorageRef, TensorRef
from .container import DataFile, Entry

MAX_HEADER = 256 << 20  # a header this large would describe millions of tensors
_BY_CODE = {info.safetensors: info.name for info in dtypes.BY_NAME.values() if info.safetensors}


def _header(file: DataFile) -> tuple[int, dict[str, Any]]:
    """(its length, its JSON object) of a safetensors file's header: the length checked against the file
    and `MAX_HEADER` before a byte of it is read, nothing in it checked yet."""
    if file.size < 8:
        raise CheckpointError(f"{file.path}: not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", file.read(0, 8))
    if n > min(MAX_HEADER, file.size - 8):
        raise CheckpointError(f"{file.path}: safetensors header of {n} bytes in a file of {file.size} "
                              f"(truncated, or not a safetensors file)")
    header = jsonin.loads(file.read(8, n), str(file.path), "safetensors header", CheckpointError)
    if not isinstance(header, dict):
        raise CheckpointError(f"{file.path}: safetensors header is not a JSON object")
    return n, header


def tensor_names(path: str, storage_options: StorageOptions | None = None) -> list[str]:
    """The names a safetensors file's header lists, its entries unchecked (half the cost of opening it):
    for what only routes the file (a task's part of the manifest), never for reading a tensor."""
    file = DataFile(path, storage_options)
    try:
        return [name for name in _header(file)[1] if name != "__metadata__"]
    finally:
        file.close()


class SafetensorsFile:
    def __init__(self, path: str | os.PathLike[str], storage_options: StorageOptions | None = None):
        self.file = DataFile(path, storage_options)
        self.path = str(self.file.path)
        try:
            self.entries, self.tensors, self.metadata = self._index()
        except BaseException:
            self.file.close()
            raise

    def _index(self) -> tuple[dict[str, Entry], dict[str, TensorRef], dict[str, Any]]:
        n, header = _header(self.file)
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            # the format's __metadata__ maps strings to strings (safetensors parses nothing else); a reader
            # that json-decodes one of its values must not be handed an object
            raise CheckpointError(f"{self.path}: safetensors __metadata__ is not an object of strings (forged or "
                                  f"damaged)")
        base, data_size = 8 + n, self.file.size - 8 - n
        entries, tensors, spans = {}, {}, []
        for name, d in header.items():
            where = f"{self.path}: {name}"
            try:
                code, shape, (begin, end) = d["dtype"], d["shape"], d["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{where}: malformed safetensors entry") from None
            if not isinstance(code, str) or code not in _BY_CODE:
                raise CheckpointError(f"{where}: unknown safetensors dtype {code!r:.20}")
            if not isinstance(shape, list) or not all(type(v) is int and v >= 0 for v in (*shape, begin, end)):
                raise CheckpointError(f"{where}: shape or offsets that are not whole non-negative numbers")
            dtype = _BY_CODE[code]
            itemsize = dtypes.info(dtype).itemsize
            if end < begin or end > data_size or end - begin != math.prod(shape) * itemsize:
                raise CheckpointError(f"{where}: bytes [{begin}, {end}) do not hold {dtype}{shape} inside the "
                                      f"file's {data_size} data bytes (corrupt or truncated)")
            spans.append((begin, end, name))
            entries[f"data/{name}"] = Entry(name, base + begin, end - begin, 0)
            count = math.prod(shape)
            tensors[name] = TensorRef(StorageRef(name, dtype, count), 0, tuple(shape),
                                      tuple(math.prod(shape[i + 1:]) for i in range(len(shape))), dtype)
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(f"{self.path}: tensors {a!r:.60} and {b!r:.60} overlap (forged or damaged)")
        return entries, tensors, metadata

    def record(self, name: str) -> memoryview:
        entry = self.entries[name]
        return self.file.view(entry.offset, entry.size)

    def range(self, offset: int, length: int) -> FileRange | RemoteRange:
        return self.file.range(offset, length)

    def stored_crc(self, key: str) -> None:
        """safetensors stores no checksums."""
        return None

    def storage_offset(self, key: str) -> int:
        return self.entries[f"data/{key}"].offset

    @property
    def size(self) -> int:
        return self.file.size

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
