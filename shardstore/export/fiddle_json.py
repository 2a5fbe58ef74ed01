"""fiddle's JSON form of a tree of `Config`s (fiddle/_src/experimental/serialization.py), written without
fiddle: what NeMo 2 keeps as `context/io.json` and reads back with `nemo.lightning.io.load_context`.

A `Config` is an object `{"type": pyref(fiddle Config), "items": [["Attr(name='x')", value], ...],
"metadata": ref(BuildableTraverserMetadata naming the class and the argument names), "paths": [...]}`; a
value is a leaf (`{"type": "leaf", "value": ...}`), a reference to another object, or a pyref (a class or
a constant such as `torch.bfloat16`); a dict is an object of `builtins.dict` items. Every object is named
`{kind}_{n}` in "objects", counted once in "refcounts", and "root" refers to the top one. NeMo finds a
sub-config (`load_context(path, "model")`) by the "paths" recorded for it, so each value carries its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

VERSION = "0.0.1"
_CONFIG = ("fiddle._src.config", "Config")
_METADATA = ("fiddle._src.config", "BuildableTraverserMetadata")


@dataclass(frozen=True)
class PyRef:
    """A module-level name (a class, a function, `torch.bfloat16`), as fiddle refers to it."""

    module: str
    name: str


@dataclass(frozen=True)
class Config:
    """`fdl.Config(cls, **arguments)`; only the arguments that differ from the class's defaults are given."""

    cls: PyRef
    arguments: dict[str, Any] = field(default_factory=dict)


def dumps(root: Config) -> dict[str, Any]:
    """The JSON object fiddle's `serialization.dump_json` writes for `root` (to be passed to json.dumps)."""
    writer = _Writer()
    top = writer.config(root, "<root>")
    return {"root": top, "objects": writer.objects, "refcounts": {k: 1 for k in writer.objects}, "version": VERSION}


def _pyref(ref: PyRef | tuple[str, str]) -> dict[str, Any]:
    module, name = (ref.module, ref.name) if isinstance(ref, PyRef) else ref
    return {"type": "pyref", "module": module, "name": name}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class _Writer:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self._counts: dict[str, int] = {}

    def _name(self, stem: str) -> str:
        self._counts[stem] = self._counts.get(stem, 0) + 1
        return f"{stem}_{self._counts[stem]}"

    def _object(self, stem: str, body: dict[str, Any]) -> dict[str, Any]:
        key = self._name(stem)
        self.objects[key] = body
        return {"type": "ref", "key": key}

    def _sequence(self, kind: str, items: list[list[Any]], metadata: Any, path: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"type": _pyref(("builtins", kind)), "items": items, "metadata": metadata}
        if path is not None:
            body["paths"] = [path]
        return self._object(kind, body)

    def _names(self, names: list[str]) -> dict[str, Any]:
        return self._sequence("tuple", [[f"Index(index={i})", n] for i, n in enumerate(names)], None)

    def _empty_dict(self) -> dict[str, Any]:
        return self._sequence("dict", [], {"type": _pyref(("builtins", "tuple")), "items": [], "metadata": None})

    def value(self, value: Any, path: str) -> Any:
        if isinstance(value, Config):
            return self.config(value, path)
        if isinstance(value, PyRef):
            return {**_pyref(value), "paths": [path]}
        if isinstance(value, dict):
            items = [[f"Key(key={k!r})", self.value(v, f"{path}[{k!r}]")] for k, v in value.items()]
            return self._sequence("dict", items, self._names(list(value)), path)
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"type": "leaf", "value": value, "paths": [path]}
        raise TypeError(f"{path}: {type(value).__name__} is not written into a fiddle config here")

    def config(self, config: Config, path: str) -> dict[str, Any]:
        items = [[f"Attr(name={k!r})", self.value(v, f"{path}.{k}")] for k, v in config.arguments.items()]
        metadata = self._object("buildable_traverser_metadata", {
            "type": _pyref(_METADATA), "metadata": _pyref(_METADATA), "items": [
                ["Attr(name='fn_or_cls')", _pyref(config.cls)],
                ["Attr(name='argument_names')", self._names(list(config.arguments))],
                ["Attr(name='argument_tags')", self._empty_dict()],
                ["Attr(name='argument_history')", self._empty_dict()]]})
        return self._object(_snake(config.cls.name), {"type": _pyref(_CONFIG), "items": items, "metadata": metadata,
                                                      "paths": [path]})
