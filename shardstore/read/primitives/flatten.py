"""Flatten a rank's state dict into a tree skeleton plus leaves addressed by path.

Only containers that hold a tensor somewhere below are descended into; any other subtree (param_groups,
an RNG tuple, a config dict) is one opaque leaf. That keeps per-rank records small at large world sizes
while every tensor still gets its own path.
"""

from __future__ import annotations

import collections
from typing import Any

from ... import paths
from ...errors import CheckpointError
from ...records import TensorRef
from ...tree import MAX_DEPTH, MAX_REVISITS, KeyEncoder, Node, Skeleton
from .unpickle import DTensor, ShardedTensor


def _tensor_holders(root: Any) -> set[int]:
    """The ids of every container below `root` (itself included) that holds a tensor somewhere below it.
    Iterative, each object visited once however many paths reach it; refused past MAX_DEPTH or when a
    container holds itself."""
    holders: set[int] = set()
    done: set[int] = set()
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    depth = 0
    while stack:
        node, leaving = stack.pop()
        if leaving:
            open_.discard(id(node))
            done.add(id(node))
            depth -= 1
            if any(_holds(child, holders) for child in _children(node)):
                holders.add(id(node))
            continue
        if not _container(node) or id(node) in done:
            continue
        depth += 1
        if id(node) in open_ or depth > MAX_DEPTH:
            raise CheckpointError(f"values nested too deeply (over {MAX_DEPTH} levels), or containing themselves")
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node))
    return holders


def _container(obj: Any) -> bool:
    return isinstance(obj, (dict, list, tuple))


def _children(obj: Any) -> Any:
    return obj.values() if isinstance(obj, dict) else obj


def _holds(obj: Any, holders: set[int]) -> bool:
    return isinstance(obj, (ShardedTensor, DTensor, TensorRef)) or id(obj) in holders


def flatten(obj: Any, encode_key: KeyEncoder) -> tuple[Skeleton, dict[str, Any]]:
    """Return (skeleton, {path: leaf}) in state-dict order. `encode_key` turns a key into JSON.

    The skeleton is a `Node` tree (read/contract.py): containers with their children under their keys
    (encoded by `encode_key`; a list's keys are its indices), and leaves.
    """
    leaves: dict[str, Any] = {}
    holders = _tensor_holders(obj)
    if type(obj) in (dict, collections.OrderedDict) and obj and not _holds(obj, holders):
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
    return _walk(obj, "", leaves, encode_key, _Visits(holders)), leaves


class _Visits:
    """The containers a walk may still enter: each holder once, and MAX_REVISITS more in all."""

    def __init__(self, holders: set[int]):
        self.holders, self.left = holders, len(holders) + MAX_REVISITS

    def enter(self, node: Any) -> bool:
        if not _holds(node, self.holders):
            return False
        self.left -= 1
        if self.left < 0:
            raise CheckpointError("the same containers reached by too many paths (a forged pickle)")
        return True


def _walk(node: Any, path: str, leaves: dict[str, Any], encode_key: KeyEncoder, visits: _Visits) -> Skeleton:
    # A module-level function, not a closure: a recursive closure is a reference cycle, and this one
    # would keep every object of the rank file alive until the cyclic GC ran. Its depth is bounded by
    # _tensor_holders' (it only enters containers holding a tensor).
    if (type(node) in (dict, collections.OrderedDict) or isinstance(node, (list, tuple))) and visits.enter(node):
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
            children.append((encode_key(key), _walk(value, paths.join(path, name), leaves, encode_key, visits)))
        return Node(kind, path, children)
    if path == "":
        raise CheckpointError("the checkpoint holds no tensors")
    leaves[path] = node
    return Node("leaf", path)
