"""Tensors that still live in a torch zip: checked against their storage, then viewed or copied in place.

A `TensorRef` (what the safe unpickler makes of a pickled tensor) names a storage record of its zip and a
strided view of it. Nothing here trusts the view until `check_view` has: whole numbers for shape, strides
and offset; a storage record that exists and holds exactly what its pickle declares; every element the
view reaches inside that record; no expanded view much larger than the record.
"""

from __future__ import annotations

import math
from typing import NoReturn

import numpy as np

from ... import dtypes
from ...errors import CheckpointError
from ...records import TensorRef
from .container import Container

# A tensor may view more elements than its storage holds only through stride-0 (expanded) views; past
# this size such a view is refused, so a few bytes of storage never become gigabytes in memory.
MAX_EXPANDED_BYTES = 16 << 20


def check_view(zf: Container, ref: TensorRef, where: str) -> None:
    shape, stride, offset = ref.shape, ref.stride, ref.offset
    numbers = (offset, *shape, *stride)
    if not all(type(v) is int for v in numbers) or len(shape) != len(stride):
        _refuse(zf, where, f"tensor with a malformed shape {shape!r:.60} or stride {stride!r:.60}")
    if min(numbers) < 0:
        _refuse(zf, where, "tensor with a negative size, stride or offset (corrupt file)")
    info, storage_info = dtypes.info(ref.dtype), dtypes.info(ref.storage.dtype)
    key = ref.storage.key
    entry = zf.entries.get(f"data/{key}")
    if entry is None:
        _refuse(zf, where, f"its storage record data/{key} is missing (corrupt file)")
    numel = ref.storage.numel
    if type(numel) is not int or entry.size != numel * storage_info.itemsize:
        _refuse(zf, where, f"storage data/{key} holds {entry.size} bytes, its pickle declares {numel} x "
                           f"{storage_info.itemsize} (corrupt file)")
    count = math.prod(shape)
    if count == 0:
        return
    last = offset + sum((n - 1) * st for n, st in zip(shape, stride))
    if (last + 1) * info.itemsize > entry.size:
        _refuse(zf, where, f"tensor view runs past its storage data/{key} (corrupt file)")
    if count * info.itemsize > max(entry.size, MAX_EXPANDED_BYTES):
        _refuse(zf, where, f"a tensor of {count * info.itemsize} bytes viewing a storage of {entry.size} (an "
                           f"expanded view this large is not a checkpoint)")


def _refuse(zf: Container, where: str, why: str) -> NoReturn:
    raise CheckpointError(f"{zf.path}: {where}: {why}")


def array(zf: Container, ref: TensorRef) -> np.ndarray:
    """A zero-copy numpy view (raw dtype) of the tensor."""
    check_view(zf, ref, "a tensor")
    info = dtypes.info(ref.dtype)
    if any(s == 0 for s in ref.shape):
        return np.empty(ref.shape, dtype=info.raw)
    storage = zf.record(f"data/{ref.storage.key}")
    start = ref.offset * info.itemsize
    base = np.frombuffer(storage, dtype=info.raw, count=(len(storage) - start) // info.itemsize, offset=start)
    return np.lib.stride_tricks.as_strided(base, shape=ref.shape, strides=[s * info.itemsize for s in ref.stride],
                                           writeable=False)


def byte_range(zf: Container, ref: TensorRef) -> tuple[int, int] | None:
    """(file offset, length) when the tensor is one C-contiguous run of bytes, else None."""
    check_view(zf, ref, "a tensor")
    info = dtypes.info(ref.dtype)
    expected = 1
    for n, s in reversed(list(zip(ref.shape, ref.stride))):
        if n != 1 and s != expected:
            return None
        expected *= n
    return zf.storage_offset(ref.storage.key) + ref.offset * info.itemsize, expected * info.itemsize
