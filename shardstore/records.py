"""The inert records shardstore reads a pickle into: tensors as references to their bytes, torch's
dtypes, devices and versions as strings, and objects of classes shardstore never imports as data. The
safe unpickler (read/primitives/unpickle.py) builds them; the store keeps them (values.py); the torch
export writes them back. Nothing here is ever called from a pickle.

Objects of classes shardstore never imports are recorded as data, never called.

Trainers keep their own objects beside the tensors (a data-loader checkpoint, a config dataclass, a
numpy Generator). Refusing the whole checkpoint for them is the wrong trade, and importing their modules
would run the trainer's code, so each such object is kept as what pickle says about it: the global that
built it, the arguments it was built with, and the state it was given. `--format torch` writes exactly
that back, so the trainer, where its modules exist, gets its own objects again.

What *is* refused is anything that only exists to run code or touch the system (`os`, `subprocess`,
`builtins.eval`, `torch.load`, ...): see `refusal`. Nothing from a pickle is ever called either way;
the denylist guards what an export would write back, and names the attack in one line.
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass
from typing import Any


class TorchDType(str):
    """A torch dtype, by name ("bfloat16")."""


class TorchDevice(str):
    """A torch device, by its string form ("cuda:3")."""


@dataclass(frozen=True)
class StorageRef:
    key: str  # the record "data/<key>" in the zip
    dtype: str  # element dtype of the storage (uint8 for an untyped storage)
    numel: int


@dataclass
class TensorRef:
    """A plain tensor: a strided view into a storage that still lives in the rank file."""

    storage: StorageRef
    offset: int  # in elements of `dtype`
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


class TorchVersion(str):
    """`torch.torch_version.TorchVersion`: a str subclass; kept as the string it is."""


@dataclass(frozen=True)
class GlobalRef:
    """A class or function a pickle names as a value (not called): `module.name`."""

    module: str
    name: str

    def __repr__(self) -> str:
        return f"<global {self.module}.{self.name}>"


class Opaque:
    """An object shardstore does not import: `module.name` built from `args` (and `kwargs`), then given
    `state`; `items`/`dictitems` are what pickle appended or set into it. `newobj` says whether pickle
    built it as `cls.__new__(cls, *args)` (True) or by calling the global with `args` (False)."""

    __slots__ = ("module", "name", "args", "kwargs", "state", "items", "dictitems", "newobj")
    module: str
    name: str
    args: tuple
    kwargs: dict
    state: Any
    items: list
    dictitems: list
    newobj: bool

    def __init__(self, module: str, name: str, args: tuple = (), state: Any = None, *,
                 kwargs: dict | None = None, items: list | None = None, dictitems: list | None = None,
                 newobj: bool = False):
        _fill(self, module, name, args, kwargs, newobj)
        self.state = state
        self.items = list(items or ())
        self.dictitems = list(dictitems or ())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and _fields(self) == _fields(other)

    def __hash__(self) -> int:
        return hash((self.module, self.name))

    def __repr__(self) -> str:
        return SHORT_REPR.repr(self)


def _fill(obj: Opaque, module: str, name: str, args: tuple, kwargs: dict | None, newobj: bool) -> None:
    obj.module, obj.name, obj.args, obj.kwargs, obj.newobj = module, name, tuple(args), dict(kwargs or {}), newobj


def _fields(o: Opaque) -> tuple:
    return (o.module, o.name, o.args, o.kwargs, o.state, o.items, o.dictitems, o.newobj)


class _Repr(reprlib.Repr):
    """`<olmo_data.MixtureCheckpoint {world_size: 4, ...}>`: short, and never runs anything of the object's."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple, self.maxstring, self.maxother = 3, 6, 6, 6, 60, 80

    def repr_Opaque(self, obj: Opaque, level: int) -> str:  # noqa: N802 (reprlib's naming)
        name = f"{obj.module}.{obj.name}"
        if level <= 0:
            return f"<{name} ...>"
        parts = []
        if obj.args or not obj.newobj:
            parts.append("(" + ", ".join(self.repr1(a, level - 1) for a in obj.args) + ")")
        if isinstance(obj.state, dict):
            inner = ", ".join(f"{k}: {self.repr1(v, level - 1)}" for k, v in list(obj.state.items())[:self.maxdict])
            parts.append("{" + inner + (", ..." if len(obj.state) > self.maxdict else "") + "}")
        elif obj.state is not None:
            parts.append(self.repr1(obj.state, level - 1))
        if obj.items:
            parts.append(self.repr1(obj.items, level - 1))
        if obj.dictitems:
            parts.append(self.repr1(dict(obj.dictitems), level - 1))
        return f"<{name}" + (" " + " ".join(parts) if parts else "") + ">"

    def repr_BytesIO(self, obj: Any, level: int) -> str:  # noqa: N802
        return f"BytesIO({obj.getbuffer().nbytes} bytes)"


SHORT_REPR = _Repr()


class Building(Opaque):
    """Base of the per-global classes the unpickler hands out (pickle's NEWOBJ wants a real class).

    NEWOBJ calls only `cls.__new__(cls, *args)`; REDUCE calls the class, which runs `__new__` and then
    `__init__`: that difference is how the record knows which one built it, so it can write the same back."""

    __slots__ = ()
    global_: tuple[str, str]

    def __new__(cls, *args: Any, **kwargs: Any) -> "Building":
        obj = object.__new__(cls)
        _fill(obj, cls.global_[0], cls.global_[1], args, kwargs, True)
        obj.state, obj.items, obj.dictitems = None, [], []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # only REDUCE gets here
        self.newobj = False

    def __setstate__(self, state: Any) -> None:  # BUILD
        self.state = state

    def append(self, item: Any) -> None:  # APPEND(S) into a list subclass
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S) into a dict subclass
        self.dictitems.append((key, value))


def building_class(module: str, name: str) -> type[Building]:
    """A fresh stand-in class for one global. It never touches the real module."""
    return type(name.rsplit(".", 1)[-1], (Building,), {"__slots__": (), "global_": (module, name),
                                                       "__module__": "shardstore.opaque"})


def as_record(obj: Any) -> Any:
    """A Building instance -> a plain `Opaque`; a Building class -> a `GlobalRef`; anything else unchanged."""
    if isinstance(obj, type) and issubclass(obj, Building):
        return GlobalRef(*obj.global_)
    if isinstance(obj, Building):
        return Opaque(obj.module, obj.name, obj.args, obj.state, kwargs=obj.kwargs, items=obj.items,
                      dictitems=obj.dictitems, newobj=obj.newobj)
    return obj


# ---------------------------------------------------------------------------------------------- policy
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE = re.compile(rf"{_IDENT}(\.{_IDENT})*\Z")
_NAME = re.compile(rf"{_IDENT}\Z")
_NESTED_CLASS = re.compile(r"[A-Z][A-Za-z0-9_]*(\.[A-Z][A-Za-z0-9_]*)*\Z")

# Modules (and everything below them) that exist to run code, reach the system, or load more pickles.
DENIED_MODULES = frozenset("""
os posix nt posixpath ntpath subprocess _posixsubprocess sys importlib imp runpy pickle _pickle pickletools
marshal shutil socket _socket ssl select selectors ctypes _ctypes code codeop pty tty types
webbrowser multiprocessing _multiprocessing threading _thread signal asyncio concurrent io _io fileinput
tempfile glob shelve dbm sqlite3 pydoc pdb bdb timeit trace profile cProfile doctest inspect ast gc
resource fcntl mmap platform sysconfig site pkgutil zipimport zipfile tarfile gzip bz2 lzma ftplib
http urllib smtplib telnetlib xmlrpc socketserver logging.config logging.handlers _winapi msvcrt winreg
_osx_support setuptools distutils pip ensurepip venv dill cloudpickle joblib jsonpickle yaml pandas.io
torch.hub torch.jit torch._C torch.ops torch._ops torch.package torch.utils.cpp_extension torch.fx
torch.distributed.rpc torch._dynamo torch._inductor torch.compiler torch.multiprocessing torch.classes
torch.serialization torch.storage torch._utils torch._tensor torch.library torch.backends
numpy.lib.npyio numpy.lib.format numpy.ctypeslib numpy.f2py numpy.distutils numpy.testing
""".split())

# Single callables of otherwise ordinary modules.
DENIED_NAMES = frozenset({
    ("operator", "attrgetter"), ("operator", "methodcaller"), ("functools", "reduce"),
    ("torch", "load"), ("torch", "save"), ("torch", "compile"), ("torch", "from_file"),
    ("numpy", "load"), ("numpy", "save"), ("numpy", "savez"), ("numpy", "savez_compressed"), ("numpy", "savetxt"),
    ("numpy", "loadtxt"), ("numpy", "genfromtxt"), ("numpy", "fromfile"), ("numpy", "memmap"),
    ("numpy", "frompyfunc"), ("numpy", "vectorize"), ("numpy", "piecewise"), ("numpy", "apply_along_axis"),
    ("codecs", "open"), ("codecs", "lookup"), ("pandas", "read_pickle"), ("copyreg", "add_extension"),
})

# builtins holds eval, exec, open and friends: only inert types from it become opaque records.
BUILTIN_TYPES = frozenset("object int float str bytes bool list tuple dict range frozenset set slice complex "
                          "bytearray NotImplemented Ellipsis".split())


def refusal(module: str, name: str) -> str | None:
    """Why the global `module.name` is refused as an opaque record, or None when it may be one."""
    if not _MODULE.match(module) or not (_NAME.match(name) or _NESTED_CLASS.match(name)):
        return "not a plain module-level name"
    if "." in name and not _NESTED_CLASS.match(name):
        return "an attribute of another object"
    if module in ("builtins", "__builtin__"):
        return None if name in BUILTIN_TYPES else "a builtin that can run code or reach the system"
    parts = module.split(".")
    if any(".".join(parts[:i]) in DENIED_MODULES for i in range(1, len(parts) + 1)):
        return "its module can run code or reach the system"
    if (module, name.split(".")[0]) in DENIED_NAMES:
        return "it can run code or reach the system"
    return None
