"""Flatten a rank's state dict into a tree skeleton plus leaves addressed by path.

Only containers that hold a tensor somewhere below are descended into; any other subtree (param_groups,
an RNG tuple, a config dict) is one opaque leaf. That keeps per-rank records small at large world sizes
while every tensor still gets its own path.
"""

from __future__ import annotations

import collections
from typing import Any

from .. import paths
from ..errors import CheckpointError
from .contract import Node, Skeleton
from .unpickle import DTensor, ShardedTensor, TensorRef


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, (ShardedTensor, DTensor, TensorRef)):
        return True
    if isinstance(obj, dict):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


def flatten(obj: Any, encode_key: Any) -> tuple[Skeleton, dict[str, Any]]:
    """Return (skeleton, {path: leaf}) in state-dict order. `encode_key` turns a key into JSON.

    The skeleton is a `Node` tree (read/contract.py): containers with their children under their keys
    (encoded by `encode_key`; a list's keys are its indices), and leaves.
    """
    leaves: dict[str, Any] = {}
    if type(obj) in (dict, collections.OrderedDict) and obj and not _holds_tensor(obj):
        # A state of values only (a trainer-state file: OLMo-core's train/rank0.pt holds its step and data
        # loader position): each top-level key a leaf, so it joins a checkpoint's tree key by key.
        kind = "odict" if isinstance(obj, collections.OrderedDict) else "dict"
        children = []
        for key, value in obj.items():
            path = paths.escape(key)
            if path in leaves:
                raise CheckpointError(f"two keys of the state dict map to the same path {path!r}")
            leaves[path] = value
            children.append((encode_key(key), Node("leaf", path)))
        return Node(kind, "", children), leaves
    return _walk(obj, "", leaves, encode_key), leaves


def _walk(node: Any, path: str, leaves: dict[str, Any], encode_key: Any) -> Skeleton:
    # A module-level function, not a closure: a recursive closure is a reference cycle, and this one
    # would keep every object of the rank file alive until the cyclic GC ran.
    if (type(node) in (dict, collections.OrderedDict) or isinstance(node, (list, tuple))) and _holds_tensor(node):
        if isinstance(node, dict):
            kind = "odict" if isinstance(node, collections.OrderedDict) else "dict"
            items = list(node.items())
        else:
            kind = "tuple" if isinstance(node, tuple) else "list"
            items = list(enumerate(node))
        children = []
        seen: set[str] = set()
        for key, value in items:
            name = paths.escape(key)
            if name in seen:
                raise CheckpointError(f"two keys of {path or 'the state dict'} map to the same path {name!r}")
            seen.add(name)
            children.append((encode_key(key), _walk(value, paths.join(path, name), leaves, encode_key)))
        return Node(kind, path, children)
    if path == "":
        raise CheckpointError("the checkpoint holds no tensors")
    leaves[path] = node
    return Node("leaf", path)
