"""What OLMo's own sharded formats share (`local`, `olmo_core`): unit naming, the optimizer subtree as
OLMo's unsharders return it, and one unit type for a file of pieces and values.

OLMo's unsharders key the optimizer state by parameter id, `{"state": {id: {key: tensor}},
"param_groups": [...]}`, with every state tensor in its parameter's full shape; the model is a flat dict
of parameter names with FSDP's wrapper names removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .. import paths
from ..errors import CheckpointError
from .contract import Node, ShardedSpec, ShardSpec
from .trainer import TRAIN

MODEL, OPTIM = "model", "optim"
WRAPPED = "_fsdp_wrapped_module."
PARAM_GROUPS = paths.join(OPTIM, "param_groups")


def clean(name: str) -> str:
    return name.replace(WRAPPED, "")


def relative(path: str) -> str:
    """"model/rank3.pt" from a unit's full path: how the store names units (extra["units"])."""
    return "/".join(path.rstrip("/").replace("\\", "/").split("/")[-2:])


def model_path(fqn: str) -> str:
    return paths.join(MODEL, paths.escape(fqn))


def state_path(pid: Any, key: Any) -> str:
    return paths.join(OPTIM, "state", paths.escape(pid), paths.escape(key))


def model_tree(fqns: list[str], encode_key: Any) -> Node:
    return Node("dict", MODEL, [(encode_key(f), Node("leaf", model_path(f))) for f in fqns])


def optim_tree(state: list[tuple[Any, list[Any]]], encode_key: Any) -> Node:
    """{"state": {id: {key: leaf}}, "param_groups": leaf} for (id, state keys) in order."""
    node = Node("dict", paths.join(OPTIM, "state"))
    for pid, keys in state:
        per = Node("dict", paths.join(node.path, paths.escape(pid)),
                   [(encode_key(k), Node("leaf", state_path(pid, k))) for k in keys])
        node.children.append((encode_key(pid), per))
    return Node("dict", OPTIM, [(encode_key("state"), node), (encode_key("param_groups"), Node("leaf", PARAM_GROUPS))])


def flat_spec(dtype: str, shape: tuple[int, ...], pieces: list[tuple[int, int, int]]) -> ShardedSpec:
    """A tensor whose pieces are (holder, first element, count) ranges of its flattened elements."""
    return ShardedSpec(dtype, shape, tuple(ShardSpec((lo,), (n,), r) for r, lo, n in pieces if n), flat=True)


def planned_place(name: str, path: str, facts: dict[str, Any], key: str, what: str) -> tuple[int, int]:
    """A unit file's number among the units the store was planned from (by `name`, as the plan lists
    them), and their count. A file the plan does not list, or a store another format planned (its facts
    have no `key`), is refused by name."""
    listed = facts.get("units", [])
    if name not in listed or key not in facts:
        raise CheckpointError(f"{path}: not a file of the {what} checkpoint the store holds")
    return listed.index(name), len(listed)


def open_olmo_unit(path: str, storage_options: Any, strict: bool, encode_key: Any, facts: dict[str, Any], key: str,
                   what: str, open_file: Callable[..., Any]) -> Any:
    """One unit of an OLMo folder checkpoint, placed by the store's facts about it (`facts[key]`, its
    `units` list and digest): a trainer-state file, or what `open_file(path, kind, file name, index, count,
    digest, facts, storage_options, strict)` makes of a model/ or optim/ file."""
    from .trainer import open_trainer

    index, count = planned_place(relative(path), path, facts, key, what)
    digest = facts["metadata"]
    kind, name = relative(path).split("/")
    if kind == TRAIN:
        return open_trainer(path, index, count, digest, storage_options, strict, encode_key)
    return open_file(path, kind, name, index, count, digest, facts, storage_options, strict)


@dataclass
class FileUnit:
    """One file of a checkpoint, opened and checked: its pieces (ArrayLeafs) and values, still on disk.
    `container` is the torch zip or safetensors file the tensors view."""

    path: str
    rank: int  # the unit's number in the checkpoint
    world_size: int
    group_rank: int
    group_size: int
    digest: str
    leaves: dict[str, Any]
    container: Any

    @property
    def size(self) -> int:
        return self.container.size

    def value_zip(self, path: str) -> Any:
        return self.container

    def close(self) -> None:
        self.container.close()
