"""The key tree of a state dict: the one vocabulary every stage shares. Readers build it, the store keeps
it in its manifest, exporters rebuild the exact nesting from it; and the bounds every walk over a
pickled or JSON structure keeps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ExportError

# How deep a state dict's containers may nest (trainers' are a dozen levels at most), and how many more
# visits than containers a walk may make (a container reached by two paths is walked twice): a pickle's
# memo makes a DAG of a few objects and 2^40 paths, and the work must stay bounded by the file's size.
MAX_DEPTH = 200
MAX_REVISITS = 100_000

# How a reader spells a state-dict key in the key tree (values.encode: typed JSON).
KeyEncoder = Callable[[Any], Any]



@dataclass
class Node:
    """One node of a state dict's key tree. A container (`kind` dict, odict, list or tuple) lists its
    children in order, each under its real key as typed JSON (values.encode); a leaf has none. `path` is
    the node's store path. The tree is what the store keeps to rebuild the exact nesting."""

    kind: str
    path: str
    children: list[tuple[Any, "Node"]] = field(default_factory=list)

    def leaf_paths(self) -> list[str]:
        """Store paths of every leaf below, in state-dict order."""
        if self.kind == "leaf":
            return [self.path]
        return [p for _, child in self.children for p in child.leaf_paths()]

    def to_json(self) -> dict[str, Any]:
        if self.kind == "leaf":
            return {"t": "leaf", "p": self.path}
        return {"t": self.kind, "p": self.path, "c": [[key, child.to_json()] for key, child in self.children]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Node":
        return cls(d["t"], d["p"], [(key, cls.from_json(child)) for key, child in d.get("c", ())])


Skeleton = Node


def node_at(tree: Node, select: str) -> Node:
    """The tree node at a store path ("state/model"), or the root for ""."""
    node, target = tree, select.strip("/")
    while node.path != target:
        prefix = [c for _, c in node.children if target == c.path or target.startswith(c.path + "/")]
        if not prefix:
            raise ExportError(f"no subtree {select!r} in the store")
        node = prefix[0]
    return node
