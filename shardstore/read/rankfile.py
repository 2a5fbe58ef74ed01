"""One rank file, read: who wrote it, the global shard layout of every ShardedTensor, its local pieces."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import dtypes
from ..errors import CheckpointError
from ..locations import StorageOptions
from .container import TorchZip
from .tree import Skeleton, flatten
from .unpickle import ShardedTensor, TensorRef, load


@dataclass(frozen=True)
class ShardSpec:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int  # the placement's rank, as the metadata names it


@dataclass(frozen=True)
class ShardedSpec:
    """The global description of one ShardedTensor, identical in every rank file of one replica group."""

    dtype: str
    shape: tuple[int, ...]
    shards: tuple[ShardSpec, ...]


@dataclass
class LocalPiece:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: TensorRef


class ShardedLeaf:
    """A ShardedTensor of this rank: dtype, global shape and local pieces up front; the global shard list
    (every rank's shard, repeated in every file) only when asked for, since at hundreds of ranks turning
    it into Python tuples for every file is where the time would go. Only the planner asks, once."""

    def __init__(self, dtype: str, shape: tuple[int, ...], pieces: list[LocalPiece], metadata: Any = None,
                 where: str = ""):
        self.dtype, self.shape, self.pieces = dtype, shape, pieces
        self._metadata, self._where = metadata, where

    @property
    def spec(self) -> ShardedSpec:
        try:
            shards = tuple(
                ShardSpec(tuple(map(int, m.shard_offsets)), tuple(map(int, m.shard_sizes)),
                          -1 if m.placement is None or m.placement.rank() is None else int(m.placement.rank()))
                for m in self._metadata.shards_metadata)
        except AttributeError as exc:
            raise CheckpointError(f"{self._where}: malformed ShardedTensor metadata ({exc})") from None
        return ShardedSpec(self.dtype, self.shape, shards)


@dataclass
class RankFile:
    path: str
    rank: int  # global rank
    world_size: int
    group_rank: int  # rank within the process group that sharded the tensors
    group_size: int
    skeleton: Skeleton
    leaves: dict[str, Any]  # path -> ShardedLeaf | TensorRef | python value
    zip: TorchZip = field(repr=False)

    def array(self, ref: TensorRef) -> np.ndarray:
        """A zero-copy numpy view (raw dtype) of a tensor that lives in this file."""
        info = dtypes.info(ref.dtype)
        storage = self.zip.record(f"data/{ref.storage.key}")
        base = np.frombuffer(storage, dtype=info.raw)
        if not ref.shape:
            return base[ref.offset: ref.offset + 1].reshape(())
        if any(s == 0 for s in ref.shape):
            return np.empty(ref.shape, dtype=info.raw)
        end = ref.offset + 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride))
        if ref.offset < 0 or end > base.size:
            raise CheckpointError(f"{self.path}: tensor view runs past its storage (corrupt file)")
        return np.lib.stride_tricks.as_strided(
            base[ref.offset:], shape=ref.shape, strides=[s * info.itemsize for s in ref.stride], writeable=False
        )

    def byte_range(self, ref: TensorRef) -> tuple[int, int] | None:
        """(file offset, length) when the tensor is one C-contiguous run of bytes, else None."""
        info = dtypes.info(ref.dtype)
        expected = 1
        for n, s in reversed(list(zip(ref.shape, ref.stride))):
            if n != 1 and s != expected:
                return None
            expected *= n
        start = self.zip.storage_offset(ref.storage.key) + ref.offset * info.itemsize
        return start, expected * info.itemsize

    def close(self) -> None:
        self.zip.close()


def _sharded_leaf(st: ShardedTensor, where: str) -> ShardedLeaf:
    md = st.metadata
    try:
        dtype = str(md.tensor_properties.dtype)
        shape = tuple(map(int, md.size))
        pieces = [LocalPiece(tuple(map(int, s.metadata.shard_offsets)), tuple(map(int, s.metadata.shard_sizes)), s.tensor)
                  for s in st.local_shards]
    except AttributeError as exc:
        raise CheckpointError(f"{where}: malformed ShardedTensor metadata ({exc})") from None
    dtypes.info(dtype)
    for piece in pieces:
        if tuple(piece.tensor.shape) != piece.sizes:
            raise CheckpointError(f"{where}: local shard has shape {piece.tensor.shape}, metadata says {piece.sizes}")
        if len(piece.offsets) != len(shape) or any(o < 0 or o + n > d for o, n, d in zip(piece.offsets, piece.sizes, shape)):
            raise CheckpointError(f"{where}: local shard at {list(piece.offsets)} lies outside {list(shape)}")
    return ShardedLeaf(dtype, shape, pieces, md, where)


def read_rank_file(path: str | os.PathLike[str], encode_key: Any = repr,
                   storage_options: StorageOptions | None = None, strict: bool = False) -> RankFile:
    """Open and unpickle one rank file (safely: see `unpickle`), leaving every tensor byte where it is."""
    zf = TorchZip(path, storage_options)
    try:
        name = os.fspath(path)
        zf.verify("data.pkl")
        obj = load(zf.record("data.pkl"), name, strict)
        skeleton, raw = flatten(obj, encode_key)
        leaves: dict[str, Any] = {}
        pg = None
        for p, leaf in raw.items():
            if isinstance(leaf, ShardedTensor):
                leaves[p] = _sharded_leaf(leaf, f"{name}: {p}")
                pg = pg or leaf.pg_state
            else:
                leaves[p] = leaf
        if pg is None:
            # No ShardedTensor at all: FSDP at world size 1 (NO_SHARD) saves whole tensors.
            rank, world, group_rank, group_size = 0, 1, 0, 1
        else:
            try:
                rank, world = int(pg.global_rank), int(pg.global_world_size)
                group_rank, group_size = int(pg.local_rank), int(pg.local_world_size)
            except AttributeError:
                raise CheckpointError(f"{name}: ShardedTensor carries no process-group state") from None
        return RankFile(name, rank, world, group_rank, group_size, skeleton, leaves, zf)
    except BaseException:
        zf.close()
        raise
