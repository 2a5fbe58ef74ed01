"""What OLMo's own sharded formats share (`local`, `olmo_core`): unit naming and the optimizer subtree as
OLMo's unsharders return it.

OLMo's unsharders key the optimizer state by parameter id, `{"state": {id: {key: tensor}},
"param_groups": [...]}`, with every state tensor in its parameter's full shape; the model is a flat dict
of parameter names with FSDP's wrapper names removed.
"""

from __future__ import annotations

from typing import Any, Callable

from ... import paths
from ...tree import KeyEncoder, Node
from ..unit import Place, planned_place, relative
from .trainer import TRAIN, open_trainer

MODEL, OPTIM = "model", "optim"
WRAPPED = "_fsdp_wrapped_module."
PARAM_GROUPS = paths.join(OPTIM, "param_groups")


def clean(name: str) -> str:
    return name.replace(WRAPPED, "")


def model_path(fqn: str) -> str:
    return paths.join(MODEL, paths.escape(fqn))


def state_path(pid: Any, key: Any) -> str:
    return paths.join(OPTIM, "state", paths.escape(pid), paths.escape(key))


def model_tree(fqns: list[str], encode_key: KeyEncoder) -> Node:
    return Node("dict", MODEL, [(encode_key(f), Node("leaf", model_path(f))) for f in fqns])


def optim_tree(state: list[tuple[Any, list[Any]]], encode_key: KeyEncoder) -> Node:
    """{"state": {id: {key: leaf}}, "param_groups": leaf} for (id, state keys) in order."""
    node = Node("dict", paths.join(OPTIM, "state"))
    for pid, keys in state:
        per = Node("dict", paths.join(node.path, paths.escape(pid)),
                   [(encode_key(k), Node("leaf", state_path(pid, k))) for k in keys])
        node.children.append((encode_key(pid), per))
    return Node("dict", OPTIM, [(encode_key("state"), node), (encode_key("param_groups"), Node("leaf", PARAM_GROUPS))])


def open_olmo_unit(path: str, storage_options: Any, strict: bool, encode_key: KeyEncoder, facts: dict[str, Any], key: str,
                   what: str, open_file: Callable[..., Any]) -> Any:
    """One unit of an OLMo folder checkpoint, placed by the store's facts about it (`facts[key]`, its
    `units` list and digest): a trainer-state file, or what `open_file(path, kind, file name, place, facts,
    storage_options, strict)` makes of a model/ or optim/ file."""
    place = Place(*planned_place(relative(path), path, facts, key, what), facts["metadata"])
    kind, name = relative(path).split("/")
    if kind == TRAIN:
        return open_trainer(path, place, storage_options, strict, encode_key)
    return open_file(path, kind, name, place, facts, storage_options, strict)
