"""Reading one leaf back as torch objects: the lazy tensor handle and the decoder for other values."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import dtypes, values

if TYPE_CHECKING:
    import torch

    from .manifest import ArrayEntry
    from .store import Store


class TensorHandle:
    """One sharded tensor in a store, read on demand: `h[0:4]` fetches only the chunks it overlaps."""

    def __init__(self, store: "Store", entry: "ArrayEntry"):
        self._store = store
        self.entry = entry
        self.path = entry.path

    @property
    def shape(self) -> "torch.Size":
        import torch

        return torch.Size(self.entry.shape)

    @property
    def dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.entry.dtype)

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    def __len__(self) -> int:
        return self.entry.shape[0]

    @property
    def ranks(self) -> list[int]:
        """The ranks whose files this tensor's data came from (so far)."""
        return self._store.contributors(self.path)

    def __getitem__(self, selection: Any) -> "torch.Tensor":
        return to_torch(self._store.read(self.path, selection), self.entry.dtype)

    def read(self) -> "torch.Tensor":
        return self[...]

    def __repr__(self) -> str:
        return f"TensorHandle({self.path!r}, shape={list(self.entry.shape)}, dtype=torch.{self.entry.dtype})"


def to_torch(raw: np.ndarray, dtype: str) -> "torch.Tensor":
    """Store bits (raw numpy dtype) -> a torch tensor of the recorded dtype, bit for bit."""
    import torch

    arr = raw if raw.flags.c_contiguous and raw.flags.writeable else raw.copy(order="C")  # keeps 0-d shapes
    return torch.from_numpy(arr).view(getattr(torch, dtypes.info(dtype).name))


def decode_tensor(store: "Store", record: dict[str, Any]) -> "torch.Tensor":
    """A plain tensor from its "$tensor" record."""
    info = dtypes.info(record["dtype"])
    raw = store.blob(record["blob"]) if "blob" in record else base64.b64decode(record["data"])
    return to_torch(np.frombuffer(bytearray(raw), dtype=info.raw).reshape(record["shape"]), info.name)


def decode_value(store: "Store", encoded: Any) -> Any:
    import torch

    return values.decode(encoded, tensor=lambda rec: decode_tensor(store, rec),
                         torch_dtype=lambda name: getattr(torch, name), torch_device=torch.device)
