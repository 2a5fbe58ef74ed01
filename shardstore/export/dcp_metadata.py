"""`.metadata`, the pickle that makes a DCP folder a checkpoint, written without torch and as it is made.

torch's classes (Metadata, TensorStorageMetadata, ...) are named in a pickle of pickle's protocol 4, each
written as pickle writes that class's instances (a dataclass: NEWOBJ of its class, BUILD of its fields;
torch.Size, a layout and an enum: a call), so that torch's `pickle.load` builds torch's own objects.

Why not pickle's own writer: it needs the whole object graph first and remembers every object it wrote
until the end (its memo), which for 92,000 tensors was ~200 MB and 8 s in pure Python, for a file of
a few MB. Here each entry is emitted as it is made and forgotten; only what recurs on every entry is
remembered and named again by reference: the strings (a key, a file name) and the globals (a class, a
dtype, the layout). Every string is one object however it was made (records read back after a kill, or
this run's own), so a resumed export's `.metadata` is a clean one's, byte for byte.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from itertools import islice
from typing import Any, Iterable, Iterator, Protocol, Sequence

from ..records import GlobalRef

_META = "torch.distributed.checkpoint.metadata"
_BATCH = 1000  # pickle's own batch of SETITEMS/APPENDS


class Entry(Protocol):
    """What `.metadata` says of an item of a .distcp file (export/dcp.py's `Item`)."""

    @property
    def fqn(self) -> str: ...

    @property
    def chunk(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None: ...  # offsets and sizes; None: bytes


Written = tuple[str, Sequence[tuple[Entry, int, int]]]  # a file's name, and each entry's offset and length in it


@dataclass(frozen=True)
class _New:
    """An instance of one of torch's classes, as pickle writes it: NEWOBJ of its class, then (unless the
    state is None) BUILD of its state."""

    cls: GlobalRef
    state: Any


@dataclass(frozen=True)
class _Call:
    """An object pickle writes as a call (REDUCE): torch.Size, a layout, an enum member. A `shared` one is
    one object in the file (the layout and the memory format every tensor's properties name)."""

    func: GlobalRef
    args: tuple[Any, ...]
    shared: bool = False


def _size(dims: tuple[int, ...]) -> _Call:
    """torch.Size(dims)."""
    return _Call(GlobalRef("torch", "Size"), (tuple(int(d) for d in dims),))


def _meta(name: str) -> GlobalRef:
    return GlobalRef(_META, name)


_STORAGE_INFO = GlobalRef("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_STRIDED = _Call(GlobalRef("torch.serialization", "_get_layout"), ("torch.strided",), True)  # as torch writes it
_CONTIGUOUS = _Call(_meta("_MEM_FORMAT_ENCODING"), (0,), True)  # TORCH_CONTIGUOUS_FORMAT


class _Lazy:
    """A dict (or a list) whose entries are made as they are written."""

    def __init__(self, entries: Iterable[Any], is_dict: bool = True):
        self.entries, self.is_dict = entries, is_dict


class _Writer:
    """pickle's protocol-4 opcodes for the values `.metadata` holds, as pickle's writer emits them, with
    only strings, globals and `shared` calls memoized (pickle's reader needs no other memo entry: nothing
    else is written twice)."""

    def __init__(self) -> None:
        self.out = bytearray(pickle.PROTO + b"\x04")
        self.memo: dict[Any, int] = {}

    def _recall(self, key: Any) -> bool:
        at = self.memo.get(key)
        if at is None:
            return False
        self.out += pickle.BINGET + bytes((at,)) if at < 256 else pickle.LONG_BINGET + struct.pack("<I", at)
        return True

    def _remember(self, key: Any) -> None:
        self.memo[key] = len(self.memo)
        self.out += pickle.MEMOIZE

    def value(self, obj: Any) -> None:
        kind = type(obj)
        if kind is str:
            self._str(obj)
        elif kind is bool:
            self.out += pickle.NEWTRUE if obj else pickle.NEWFALSE
        elif kind is int:
            self._int(obj)
        elif obj is None:
            self.out += pickle.NONE
        elif kind is float:
            self.out += pickle.BINFLOAT + struct.pack(">d", obj)
        elif kind is tuple:
            self._tuple(obj)
        elif kind is list:
            self._container(_Lazy(obj, is_dict=False))
        elif kind is dict:
            self._container(_Lazy(obj.items()))
        elif kind is _Lazy:
            self._container(obj)
        elif kind is GlobalRef:
            self._global(obj)
        elif kind is _New:
            self._global(obj.cls)
            self.out += pickle.EMPTY_TUPLE + pickle.NEWOBJ
            if obj.state is not None:
                self.value(obj.state)
                self.out += pickle.BUILD
        elif kind is _Call:
            key = ("call", obj.func, obj.args)
            if obj.shared and self._recall(key):
                return
            self._global(obj.func)
            self._tuple(obj.args)
            self.out += pickle.REDUCE
            if obj.shared:
                self._remember(key)
        else:
            raise TypeError(f"a {kind.__name__} has no place in a .metadata")

    def _str(self, s: str) -> None:
        if self._recall(s):
            return
        data = s.encode("utf-8", "surrogatepass")
        n = len(data)
        if n <= 0xFF:
            self.out += pickle.SHORT_BINUNICODE + bytes((n,))
        elif n > 0xFFFFFFFF:
            self.out += pickle.BINUNICODE8 + struct.pack("<Q", n)
        else:
            self.out += pickle.BINUNICODE + struct.pack("<I", n)
        self.out += data
        self._remember(s)

    def _int(self, i: int) -> None:
        if 0 <= i <= 0xFF:
            self.out += pickle.BININT1 + bytes((i,))
        elif 0 <= i <= 0xFFFF:
            self.out += pickle.BININT2 + struct.pack("<H", i)
        elif -0x80000000 <= i <= 0x7FFFFFFF:
            self.out += pickle.BININT + struct.pack("<i", i)
        else:
            data = pickle.encode_long(i)
            self.out += (pickle.LONG1 + bytes((len(data),)) if len(data) < 256
                         else pickle.LONG4 + struct.pack("<i", len(data))) + data

    def _tuple(self, items: tuple[Any, ...]) -> None:
        if not items:
            self.out += pickle.EMPTY_TUPLE
            return
        if len(items) > 3:
            self.out += pickle.MARK
        for item in items:
            self.value(item)
        self.out += (pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)[len(items) - 1] if len(items) <= 3 else pickle.TUPLE

    def _container(self, lazy: _Lazy) -> None:
        self.out += pickle.EMPTY_DICT if lazy.is_dict else pickle.EMPTY_LIST
        entries = iter(lazy.entries)
        while batch := list(islice(entries, _BATCH)):
            if len(batch) > 1:
                self.out += pickle.MARK
            for entry in batch:
                if lazy.is_dict:
                    self.value(entry[0])
                    self.value(entry[1])
                else:
                    self.value(entry)
            if lazy.is_dict:
                self.out += pickle.SETITEMS if len(batch) > 1 else pickle.SETITEM
            else:
                self.out += pickle.APPENDS if len(batch) > 1 else pickle.APPEND

    def _global(self, ref: GlobalRef) -> None:
        key = ("global", ref)
        if self._recall(key):
            return
        self._str(ref.module)
        self._str(ref.name)
        self.out += pickle.STACK_GLOBAL
        self._remember(key)


def metadata(described: dict[str, Any], mappings: dict[str, tuple[Any, ...]], results: Sequence[Written]) -> bytes:
    """`.metadata` of a folder whose files hold `results` (each file's name and its items, at their offsets
    and lengths), `described` saying what each key is, `mappings` torch's `planner_data`."""
    ordered = sorted(results, key=lambda r: r[0])
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for _, written in ordered:
        for item, _, _ in written:
            if item.chunk is not None:
                chunks.setdefault(item.fqn, []).append(item.chunk)

    def tensors() -> Iterator[tuple[str, _New]]:
        for fqn, what in described.items():
            if what[0] == "bytes":
                yield fqn, _New(_meta("BytesStorageMetadata"), None)
                continue
            _, dtype, shape = what
            properties = _New(_meta("TensorProperties"), (GlobalRef("torch", dtype), _STRIDED, False, _CONTIGUOUS,
                                                          False))
            yield fqn, _New(_meta("TensorStorageMetadata"), {
                "properties": properties, "size": _size(shape),
                "chunks": _Lazy((_New(_meta("ChunkStorageMetadata"), {"offsets": _size(offsets), "sizes": _size(sizes)})
                                 for offsets, sizes in chunks.get(fqn, ())), is_dict=False)})

    def storage() -> Iterator[tuple[_New, _New]]:
        index: dict[str, int] = {}
        for name, written in ordered:
            for item, offset, length in written:
                where = _New(_STORAGE_INFO, {"relative_path": name, "offset": offset, "length": length})
                if item.chunk is None:
                    yield _New(_meta("MetadataIndex"), {"fqn": item.fqn, "offset": None, "index": None}), where
                    continue
                at = index[item.fqn] = index.get(item.fqn, -1) + 1
                yield _New(_meta("MetadataIndex"), {"fqn": item.fqn, "offset": _size(item.chunk[0]),
                                                     "index": at}), where

    writer = _Writer()
    writer.value(_New(_meta("Metadata"), {
        "state_dict_metadata": _Lazy(tensors()), "planner_data": mappings, "storage_data": _Lazy(storage()),
        "storage_meta": None, "version": "1.0.0"}))
    writer.out += pickle.STOP
    return bytes(writer.out)
