"""A torch.distributed.checkpoint folder as its `.metadata` describes it, checked: every item's file and
byte range, every tensor's chunks. The DCP reading (`dcp.py`) makes it; Megatron-FSDP's renaming
(`megatron_fsdp.py`) takes one and gives another, under torch_dist's names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ... import paths


@dataclass(frozen=True)
class Item:
    """One entry of storage_data: a chunk of a tensor (offsets set) or a whole value, in one file."""

    fqn: str
    offsets: tuple[int, ...] | None
    file: str
    offset: int
    length: int
    squeeze: int = 0  # leading axes of 1 the item's tensor has and the checkpoint's key does not (layer, expert)
    # a flattened range of a block (Megatron's fully_sharded_model_space): (first element of the item, box
    # offsets, box sizes) of each box it fills, in order; the item's elements are these boxes end to end
    boxes: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    transforms: tuple[str, ...] = ()  # the stream transforms it was written through (primitives/transforms.py)


@dataclass
class DcpCheckpoint:
    folder: str
    digest: str  # of the .metadata bytes: every unit must come from the same one
    tensors: dict[str, tuple[str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]]  # fqn -> dtype, size, chunks
    values: list[str]  # fqns of bytes items
    paths: dict[str, tuple[Any, ...]]  # fqn -> its path in the nested state dict
    items: list[Item]
    files: list[str] = field(default_factory=list)  # unit order
    megatron_fsdp: bool = False  # Megatron-FSDP's save, under torch_dist's names (megatron_fsdp.py)

    def store_path(self, fqn: str) -> str:
        return paths.join(*(paths.escape(k) for k in self.paths[fqn]))

    @cached_property
    def by_file(self) -> dict[str, list[Item]]:
        """Each file's items in the metadata's order: a unit reads its own (1,922 files of 122,000 items,
        DeepSeek-V3 at EP 64 x PP 16 x TP 2, scanned all of them for each file)."""
        by_file: dict[str, list[Item]] = {}
        for item in self.items:
            by_file.setdefault(item.file, []).append(item)
        return by_file

    def ends(self) -> dict[str, int]:
        """Each file's least size: the end of the last item the metadata places in it."""
        ends: dict[str, int] = {}
        for item in self.items:
            ends[item.file] = max(ends.get(item.file, 0), item.offset + item.length)
        return ends
