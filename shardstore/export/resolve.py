"""Turn the store back into a state dict whose big tensors are still on disk.

Sharded arrays become `ArrayRef`s (a path, a dtype, a shape) that the writers stream from the store;
everything else is decoded from its typed JSON. A leaf whose value differs between ranks (RNG states,
per-rank counters) resolves to the lowest rank's value, which is what every rank-0 writer does; the
store keeps all of them (`Store.values(path)`).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, Iterator

from .. import dtypes, paths, values
from ..errors import ExportError
from ..ranges import Part, joined
from ..store.handle import decode_value
from ..store.store import Store
from ..tree import Node, node_at

Rows = tuple[tuple[int, int], ...]  # blocks of rows [first, stop), in the order they are written


# rows blocks smaller than this are read with their neighbours, a span of up to WINDOW bytes at a time: one
# stream of the store per block costs more than the block's bytes
SMALL_ROWS, WINDOW = 64 << 10, 4 << 20


@dataclass(frozen=True)
class ArrayRef:
    """A tensor still in the store: writers stream its bytes (`parts`) instead of loading it."""

    path: str
    dtype: str
    shape: tuple[int, ...]  # of what this reference gives: with `rows`, those blocks of rows one after another
    rows: Rows | None = None  # only these blocks of rows [first, stop) of the array (a split fused weight)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.info(self.dtype).itemsize

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[Part]:
        if self.rows is None:
            yield from store.stream(self.path, allow_partial=allow_partial)
            return
        rows, row = self.rows, math.prod(self.shape[1:]) * dtypes.info(self.dtype).itemsize
        i = 0
        while i < len(rows):
            block = rows[i]
            j = i + 1
            if (block[1] - block[0]) * row < SMALL_ROWS:  # the small blocks near it, read once
                first, stop = block
                while j < len(rows) and (rows[j][1] - rows[j][0]) * row < SMALL_ROWS and \
                        (max(stop, rows[j][1]) - min(first, rows[j][0])) * row <= WINDOW:
                    first, stop = min(first, rows[j][0]), max(stop, rows[j][1])
                    j += 1
            if j == i + 1:
                yield from store.stream(self.path, allow_partial=allow_partial, rows=block)
            else:  # rows picked one by one (torchtitan's q, its rotary halves paired): their span read once
                span = memoryview(joined(store.stream(self.path, allow_partial=allow_partial, rows=(first, stop))))
                for a, b in rows[i:j]:
                    yield span[(a - first) * row:(b - first) * row]
            i = j

    def stored_crc(self, store: Store) -> int | None:
        """The CRC-32 of exactly these bytes, combined from what the source files stored, where known (else
        the writer computes it from the bytes)."""
        return store.stored_crc(self.path) if self.rows is None else None


def object_value(store: Store, path: str, rank: int | None = None, lean: bool = False) -> Any:
    """A leaf's value: the lowest rank's, or `rank`'s (`lean`: see handle.decode_value)."""
    by_rank = store.object_values(path)
    if not by_rank:
        raise ExportError(f"{path}: no rank holding it has been ingested")
    if rank is not None and rank not in by_rank:
        raise ExportError(f"{path}: rank {rank} has not been ingested")
    return decode_value(store, by_rank[min(by_rank) if rank is None else rank], lean)


# The top-level parts of a checkpoint that are never a model's weights: an optimizer's state (the HF
# Trainer's optimizer_N/, torchtitan's, Lightning's optimizer_states) and a trainer's counters
NOT_A_MODEL = frozenset({"optimizer", "optim", "optimizer_states", "lr_scheduler", "lr_schedulers",
                         "train_state", "dataloader", "scheduler"})


def model_node(tree: Node, subtree: str) -> Node:
    """The model's node: `subtree`'s, and for the root, the root without the parts beside a model saved at
    the top level (torchtitan's model keys beside `optimizer`, `train_state`, `lr_scheduler`, `dataloader`)."""
    node = node_at(tree, subtree)
    if subtree.strip("/"):
        return node
    beside = {paths.escape(n) for n in NOT_A_MODEL}
    kept = [(key, child) for key, child in node.children if child.path not in beside]
    return Node(node.kind, node.path, kept) if kept else node


def build(store: Store, node: Node, plain_dicts: bool = False, rank: int | None = None, lean: bool = False) -> Any:
    """The state dict below `node`, with ArrayRefs for sharded tensors; per-rank values from `rank`
    (default: the lowest rank); `lean`, values without torch (see handle.decode_value)."""
    if node.kind == "leaf":
        entry = store.manifest.arrays.get(node.path)
        if entry is not None:
            return ArrayRef(node.path, entry.dtype, entry.shape)
        value = object_value(store, node.path, rank, lean)
        return _plain(value) if plain_dicts else value
    items = [(values.decode(k, tensor=_no_tensor), build(store, c, plain_dicts, rank, lean)) for k, c in node.children]
    if node.kind == "odict" and not plain_dicts:
        return collections.OrderedDict(items)
    if node.kind in ("dict", "odict"):
        return dict(items)
    seq = [v for _, v in items]
    return tuple(seq) if node.kind == "tuple" else seq


def leaves(node: Node, dcp_names: bool = False) -> Iterator[tuple[list[Any], str]]:
    """(keys from `node` down, store path) of every leaf below `node`, in state-dict order. With
    `dcp_names`, keys as torch.distributed.checkpoint's `flatten_state_dict` names them: a dict key as
    `str(key)` (parameter id 17 is "17"), a list or tuple position as its int."""
    if node.kind == "leaf":
        yield [], node.path
        return
    for key, child in node.children:
        key = values.decode(key, tensor=_no_tensor)
        if dcp_names and node.kind in ("dict", "odict"):
            key = str(key)
        for keys, path in leaves(child, dcp_names):
            yield [key] + keys, path


def _plain(value: Any) -> Any:
    """OrderedDict -> dict all the way down: what the OLMo unsharder returns."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value


def _no_tensor(record: Any) -> Any:
    raise ExportError("a tensor used as a dict key")


def tensors_only(store: Store, node: Node) -> bool:
    """Whether every leaf below `node` is known from the plan (an array, or a value known not to be a
    tensor): a plain value's shape comes with the data, too late for a layout made before it."""
    facts = store.manifest.facts
    return all(path in store.manifest.arrays or path in facts.not_tensors for _, path in leaves(node))
