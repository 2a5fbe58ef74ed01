"""fiddle's JSON form written without fiddle (export/fiddle_json.py): every reference resolves, every object
is counted, each Config names its class and argument names in its metadata, and each value records the path
NeMo's `load_context` finds a sub-config by. (NeMo 2.7.3's own loader reads what `--format nemo` writes:
tests/fixtures/nemo_load.py, out of CI.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from shardstore.export.fiddle_json import Config, PyRef, dumps

MODEL = PyRef("pkg.models", "TinyModel")
ROOT = Config(PyRef("pkg.io", "Context"), {
    "model": Config(MODEL, {"config": Config(PyRef("pkg.models", "TinyConfig"), {
        "layers": 2, "eps": 1e-5, "name": "tiny", "flag": True, "nothing": None,
        "dtype": PyRef("torch", "bfloat16")})}),
    "extra": {"seed": 3}})


def _refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        own = [value["key"]] if value.get("type") == "ref" else []
        return own + [k for v in value.values() for k in _refs(v)]
    if isinstance(value, list):
        return [k for v in value for k in _refs(v)]
    return []


def test_every_reference_resolves_and_every_object_is_counted() -> None:
    doc = json.loads(json.dumps(dumps(ROOT)))  # what json.dumps writes and NeMo reads back
    assert doc["version"] == "0.0.1" and set(doc["refcounts"]) == set(doc["objects"])
    assert set(_refs(doc)) == set(doc["objects"])  # nothing unreferenced


def test_a_config_names_its_class_arguments_and_paths() -> None:
    doc = dumps(ROOT)
    by_path = {obj["paths"][0]: obj for obj in doc["objects"].values() if "paths" in obj}
    config = by_path["<root>.model.config"]
    assert config["type"] == {"type": "pyref", "module": "fiddle._src.config", "name": "Config"}
    meta = dict(doc["objects"][config["metadata"]["key"]]["items"])
    assert meta["Attr(name='fn_or_cls')"] == {"type": "pyref", "module": "pkg.models", "name": "TinyConfig"}
    names = doc["objects"][meta["Attr(name='argument_names')"]["key"]]["items"]
    assert [n for _, n in names] == ["layers", "eps", "name", "flag", "nothing", "dtype"]
    items = dict(config["items"])
    assert items["Attr(name='layers')"] == {"type": "leaf", "value": 2, "paths": ["<root>.model.config.layers"]}
    assert items["Attr(name='eps')"]["value"] == 1e-5 and items["Attr(name='nothing')"]["value"] is None
    assert items["Attr(name='dtype')"] == {"type": "pyref", "module": "torch", "name": "bfloat16",
                                           "paths": ["<root>.model.config.dtype"]}
    extra = by_path["<root>.extra"]
    assert extra["type"]["name"] == "dict" and extra["items"][0][0] == "Key(key='seed')"


def test_a_value_fiddle_cannot_hold_here_is_refused_by_its_path() -> None:
    with pytest.raises(TypeError, match=r"<root>\.bad: bytes"):
        dumps(Config(MODEL, {"bad": b"raw"}))
