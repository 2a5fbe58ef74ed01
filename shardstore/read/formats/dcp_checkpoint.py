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
    """The .metadata, parsed; or, in a `FileShare`, the part of it one file's reading needs."""

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

    @cached_property
    def _chunk_sizes(self) -> dict[str, dict[tuple[int, ...], tuple[int, ...]]]:
        return {fqn: dict(chunks) for fqn, (_, _, chunks) in self.tensors.items()}

    def share(self, name: str) -> "FileShare":
        """What a worker needs of the .metadata to read the file `name`: its items, the tensors they are
        chunks of (with those chunks alone), their paths. Shipped with the worker's task, so no worker
        parses the .metadata again, nor starts holding all of it (DeepSeek-V3's structure: 88 MB parsed,
        and a forked worker copied 210 MB of the pages it shared with its parent as it touched them)."""
        items = self.by_file.get(name, [])
        chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        for item in items:
            if item.fqn in self.tensors:
                own = chunks.setdefault(item.fqn, [])
                if item.offsets is not None and not item.boxes:
                    own.append((item.offsets, self._chunk_sizes[item.fqn][item.offsets]))
        tensors = {fqn: (self.tensors[fqn][0], self.tensors[fqn][1], own) for fqn, own in chunks.items()}
        fqns = dict.fromkeys(item.fqn for item in items)
        part = DcpCheckpoint(self.folder, self.digest, tensors, [f for f in fqns if f not in self.tensors],
                             {fqn: self.paths[fqn] for fqn in fqns}, items, [name], self.megatron_fsdp)
        return FileShare(self.files.index(name) if name in self.files else -1, len(self.files), part)

    def ends(self) -> dict[str, int]:
        """Each file's least size: the end of the last item the metadata places in it."""
        ends: dict[str, int] = {}
        for item in self.items:
            ends[item.file] = max(ends.get(item.file, 0), item.offset + item.length)
        return ends


@dataclass(frozen=True)
class FileShare:
    """One file's part of a DCP checkpoint (`DcpCheckpoint.share`), and its place among the files."""

    rank: int  # in the checkpoint's file order; -1: not a file of it
    count: int  # files in the checkpoint
    ckpt: DcpCheckpoint
    beside: str | None = None  # a file of values beside the .distcp files: the store subtree it fills

    def store_paths(self) -> list[str]:
        return [self.ckpt.store_path(fqn) for fqn in self.ckpt.paths]

    def subtrees(self) -> list[str]:
        return [] if self.beside is None else [self.beside]
