"""Typed JSON for everything in a state dict that is not a sharded tensor.

JSON keeps the store inspectable with any tool, but loses Python's distinctions (tuple vs list,
OrderedDict vs dict, int keys, NaN, bytes, numpy arrays, torch dtypes). Each of those is written as a
one-key object whose key starts with "$", so decoding gives back exactly what the rank file held.
Plain tensors are written as {"$tensor": ...} with their bytes inline when small or in a
content-addressed blob when not (identical tensors on every rank are then stored once).
"""

from __future__ import annotations

import base64
import collections
import datetime
import io
import math
import os
import pathlib
from typing import Any, Callable

import numpy as np

from .errors import StoreError
from .records import SHORT_REPR, Building, GlobalRef, Opaque, TensorRef, TorchDevice, TorchDType, TorchVersion
from .tree import MAX_DEPTH, MAX_REVISITS

Json = Any
INLINE_TENSOR_BYTES = 1024


def _b64(data: bytes | memoryview) -> str:
    return base64.b64encode(data).decode("ascii")


def encode(obj: Any, tensor: Callable[[TensorRef], Json] | None = None) -> Json:
    """Encode `obj`; `tensor` encodes plain tensors (it decides inline vs blob)."""
    return _Encoder(tensor).enc(obj)


# A value nests a few levels (a trainer's config, an RNG state); a forged one is refused past MAX_DEPTH. A
# pickle's memo can make a few objects reachable by 2^40 paths: past MAX_REVISITS more visits than distinct
# containers, the work is no longer bounded by the file, and the value is refused (the state-dict walk's
# bounds, read/primitives/flatten.py).
_CONTAINERS = (list, tuple, dict, collections.OrderedDict, set, frozenset)


class _Encoder:
    # A class, not a recursive closure: the closure's self-reference would be a cycle holding `tensor`,
    # and through it the whole rank file, until the cyclic GC ran.
    def __init__(self, tensor: Callable[[TensorRef], Json] | None):
        self.tensor = tensor
        self.depth = self.visits = 0
        self.seen: set[int] = set()

    def enc(self, o: Any) -> Json:
        if type(o) not in _CONTAINERS and not isinstance(o, (Opaque, np.ndarray)):
            return self._enc(o)
        self.depth += 1
        self.visits += 1
        self.seen.add(id(o))
        if self.depth > MAX_DEPTH or self.visits > len(self.seen) + MAX_REVISITS:
            raise StoreError("a value nested too deeply, or containing itself, or reached by too many paths")
        try:
            return self._enc(o)
        finally:
            self.depth -= 1

    def _enc(self, o: Any) -> Json:
        enc, tensor = self.enc, self.tensor
        if o is None or type(o) in (bool, str):
            return o
        if type(o) is int:
            return o
        if type(o) is float:
            return o if math.isfinite(o) else {"$float": repr(o)}
        if isinstance(o, TorchDType):
            return {"$torch_dtype": str(o)}
        if isinstance(o, TorchDevice):
            return {"$torch_device": str(o)}
        if isinstance(o, TensorRef):
            if tensor is None:
                raise StoreError("a tensor appeared where none was expected")
            return {"$tensor": tensor(o)}
        if type(o) is list:
            return [enc(v) for v in o]
        if type(o) is tuple:
            return {"$tuple": [enc(v) for v in o]}
        if type(o) in (dict, collections.OrderedDict):
            tag = "$odict" if isinstance(o, collections.OrderedDict) else "$dict"
            return {tag: [[enc(k), enc(v)] for k, v in o.items()]}
        if type(o) in (set, frozenset):
            return {"$" + type(o).__name__: [enc(v) for v in o]}
        if type(o) is bytes:
            return {"$bytes": _b64(o)}
        if type(o) is bytearray:
            return {"$bytearray": _b64(bytes(o))}
        if type(o) is complex:
            return {"$complex": [enc(o.real), enc(o.imag)]}
        if type(o) is io.BytesIO:
            return {"$bytesio": [_b64(o.getbuffer()), o.tell()]}
        if isinstance(o, np.ndarray):
            if o.dtype.hasobject:
                return {"$ndarray_obj": {"shape": list(o.shape), "items": [enc(v) for v in o.ravel().tolist()]}}
            return {"$ndarray": {"dtype": o.dtype.str, "shape": list(o.shape), "data": _b64(np.ascontiguousarray(o).tobytes())}}
        if isinstance(o, np.generic):
            return {"$npscalar": {"dtype": o.dtype.str, "data": _b64(o.tobytes())}}
        if isinstance(o, np.dtype):
            return {"$npdtype": o.str}
        if type(o) is datetime.timedelta:
            return {"$timedelta": [o.days, o.seconds, o.microseconds]}
        if type(o) is datetime.datetime:
            return {"$datetime": o.isoformat()}
        if type(o) is datetime.date:
            return {"$date": o.isoformat()}
        if type(o) is slice:
            return {"$slice": [enc(o.start), enc(o.stop), enc(o.step)]}
        if isinstance(o, TorchVersion):
            return {"$torch_version": str(o)}
        if isinstance(o, pathlib.PurePath):
            return {"$path": [getattr(o, "kind", type(o).__name__), str(o)]}
        if isinstance(o, Opaque):
            out = {"global": [o.module, o.name], "args": enc(o.args), "newobj": o.newobj}
            for field in ("kwargs", "state", "items", "dictitems"):
                if getattr(o, field):
                    out[field] = enc(getattr(o, field))
            return {"$opaque": out}
        if isinstance(o, GlobalRef) or isinstance(o, type) and issubclass(o, Building):
            ref = o if isinstance(o, GlobalRef) else GlobalRef(*o.global_)
            return {"$global": [ref.module, ref.name]}
        raise StoreError(f"cannot store a value of type {type(o).__name__}")


def path_value(kind: str, text: str) -> pathlib.PurePath:
    """A pickled path as the class it was, where this system can make one (else its pure flavour)."""
    cls = getattr(pathlib, kind, None) if kind in _PATH_CLASSES else None
    if cls is None:
        raise StoreError(f"unknown path class {kind!r} in the store")
    if (kind == "PosixPath" and os.name == "nt") or (kind == "WindowsPath" and os.name != "nt"):
        cls = pathlib.PureWindowsPath if kind == "WindowsPath" else pathlib.PurePosixPath
    return cls(text)


_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


def decode(data: Json, tensor: Callable[[Json], Any], torch_dtype: Callable[[str], Any] = TorchDType,
           torch_device: Callable[[str], Any] = TorchDevice, torch_version: Callable[[str], Any] = TorchVersion) -> Any:
    """Decode typed JSON; `tensor` rebuilds a plain tensor from its "$tensor" record. Opaque objects come
    back as `Opaque` records (never their real class), paths as pathlib paths."""

    def dec(d: Json) -> Any:
        if isinstance(d, list):
            return [dec(v) for v in d]
        if not isinstance(d, dict):
            return d
        ((tag, v),) = d.items()
        if tag == "$float":
            return float(v)
        if tag == "$torch_dtype":
            return torch_dtype(v)
        if tag == "$torch_device":
            return torch_device(v)
        if tag == "$tensor":
            return tensor(v)
        if tag == "$tuple":
            return tuple(dec(x) for x in v)
        if tag == "$dict":
            return {dec(k): dec(x) for k, x in v}
        if tag == "$odict":
            return collections.OrderedDict((dec(k), dec(x)) for k, x in v)
        if tag == "$set":
            return {dec(x) for x in v}
        if tag == "$frozenset":
            return frozenset(dec(x) for x in v)
        if tag == "$bytes":
            return base64.b64decode(v)
        if tag == "$bytearray":
            return bytearray(base64.b64decode(v))
        if tag == "$complex":
            return complex(dec(v[0]), dec(v[1]))
        if tag == "$bytesio":
            buf = io.BytesIO(base64.b64decode(v[0]))
            buf.seek(v[1])
            return buf
        if tag == "$ndarray":
            raw = base64.b64decode(v["data"])
            return np.frombuffer(raw, dtype=np.dtype(v["dtype"])).reshape(v["shape"]).copy()
        if tag == "$ndarray_obj":
            arr = np.empty(len(v["items"]), dtype=object)
            arr[:] = [dec(x) for x in v["items"]]
            return arr.reshape(v["shape"])
        if tag == "$npscalar":
            return np.frombuffer(base64.b64decode(v["data"]), dtype=np.dtype(v["dtype"]))[0]
        if tag == "$npdtype":
            return np.dtype(v)
        if tag == "$timedelta":
            return datetime.timedelta(days=v[0], seconds=v[1], microseconds=v[2])
        if tag == "$datetime":
            return datetime.datetime.fromisoformat(v)
        if tag == "$date":
            return datetime.date.fromisoformat(v)
        if tag == "$slice":
            return slice(dec(v[0]), dec(v[1]), dec(v[2]))
        if tag == "$torch_version":
            return torch_version(v)
        if tag == "$path":
            return path_value(*v)
        if tag == "$global":
            return GlobalRef(*v)
        if tag == "$opaque":
            return Opaque(v["global"][0], v["global"][1], dec(v["args"]), dec(v.get("state")),
                          kwargs=dec(v.get("kwargs", {"$dict": []})), items=dec(v.get("items", [])),
                          dictitems=dec(v.get("dictitems", [])), newobj=v["newobj"])
        raise StoreError(f"unknown typed value {tag!r} in the store (written by a newer shardstore?)")

    return dec(data)


class _TensorPreview:
    def __init__(self, record: Json):
        self.text = f"tensor({record['dtype']}{list(record['shape'])})"

    def __repr__(self) -> str:
        return self.text


def preview(data: Json) -> str:
    """A short, readable form of an encoded value (tensors by dtype and shape): for listings, without torch."""
    return SHORT_REPR.repr(decode(data, tensor=_TensorPreview))
