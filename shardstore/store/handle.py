"""Reading one leaf back as torch objects: the lazy tensor handle and the decoder for other values."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import dtypes, values
from ..errors import StoreError
from .manifest import ArrayEntry, CommitRecord

if TYPE_CHECKING:
    import torch


class StoredCells(Protocol):
    """What a handle reads of its store (store.Store is one): the cells committed so far, and blobs."""

    def read(self, path: str, selection: Any = ...) -> np.ndarray: ...

    def has_cell(self, entry: ArrayEntry, index: tuple[int, ...]) -> bool: ...

    def arrived(self, entry: ArrayEntry) -> tuple[np.ndarray, np.ndarray]: ...

    def cells_present(self, path: str) -> set[int]: ...

    def records(self, refresh: bool = True) -> dict[int, CommitRecord]: ...

    def contributors(self, path: str) -> list[int]: ...

    def blob(self, digest: str) -> bytes: ...


class TensorHandle:
    """One sharded tensor in a store, read on demand: `h[0:4]` fetches only the chunks it overlaps."""

    def __init__(self, store: StoredCells, entry: ArrayEntry):
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

        dtype: torch.dtype = getattr(torch, self.entry.dtype)
        return dtype

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
        return to_torch(self._raw(selection), self.entry.dtype)

    def numpy(self, selection: Any = ...) -> np.ndarray:
        """The values of a selection as numpy numbers, exactly (bfloat16 and float8 as float32); no torch."""
        return dtypes.as_numbers(self._raw(selection), self.entry.dtype)

    def _raw(self, selection: Any) -> np.ndarray:
        staged = self._staged()
        self._check(selection, staged)
        return np.asarray(self._store.read(self.path, selection)) if staged is None else np.array(staged[0][selection])

    def _staged(self) -> tuple[np.ndarray, np.ndarray] | None:
        """A small tensor whose pieces wait in the ranks' staging files until every rank is in: what has
        arrived of it (store.arrived), or None once it is assembled (or is not staged)."""
        entry = self.entry
        if not entry.staged or not entry.shape or self._store.has_cell(entry, (0,) * len(entry.shape)):
            return None
        return self._store.arrived(entry)

    def check(self, selection: Any) -> None:
        """Refuse, before reading, a selection that this tensor cannot answer (see `check_selection`), that
        reaches outside it (see `check_bounds`), or whose rows have not arrived yet: a StoreError whose one
        line names the key. What `shardstore show` reads is checked here; reading itself (`h[0:100]`)
        clips slices as numpy and torch do."""
        self.check_bounds(selection)
        self._check(selection, self._staged())

    def _check(self, selection: Any, staged: tuple[np.ndarray, np.ndarray] | None) -> None:
        self.check_selection(selection)
        if staged is not None:
            self._refuse_missing(staged[1], selection)
        else:
            self._check_arrived(selection)

    def _refuse_missing(self, arrived: np.ndarray, selection: Any) -> None:
        """Refuse a selection of a staged tensor with an element not in yet, naming the rows that are not."""
        if np.all(arrived[selection]):
            return
        rows = [int(r) for r in np.nonzero(~arrived.reshape(self.entry.shape[0], -1).all(1))[0]]
        runs: list[list[int]] = []
        for r in rows:
            if runs and runs[-1][1] == r - 1:
                runs[-1][1] = r
            else:
                runs.append([r, r])
        text = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs[:10]) + (" ..." if len(runs) > 10 else "")
        raise StoreError(f"{self.path}: rows {text} have not arrived yet (their rank is not ingested); read other "
                         f"rows, or wait")

    def check_selection(self, selection: Any) -> None:
        """Refuse, in one line naming the key and the valid range, what numpy-style basic indexing of this
        tensor would reject or Zarr cannot do (negative steps)."""
        for dim, s in self._by_dimension(selection):
            size = self.entry.shape[dim]
            if isinstance(s, (int, np.integer)) and not isinstance(s, bool):
                if not -size <= s < size:
                    raise StoreError(f"{self.path}: index {s} is out of range for dimension {dim} of size {size} "
                                     f"(valid: {-size} to {size - 1})")
            elif isinstance(s, slice):
                if any(v is not None and not isinstance(v, (int, np.integer)) for v in (s.start, s.stop, s.step)):
                    raise StoreError(f"{self.path}: slice bounds must be whole numbers")
                if s.step is not None and s.step < 1:
                    raise StoreError(f"{self.path}: slice steps must be positive (dimension {dim}); "
                                     f"reverse the result instead")
            else:
                raise StoreError(f"{self.path}: selections are whole numbers, slices and '...', "
                                 f"not {type(s).__name__}")

    def check_bounds(self, selection: Any) -> None:
        """`check_selection`, and refuse a slice bound outside the tensor's dimension, or a slice that selects
        nothing of a dimension that has elements: numpy and torch clip these silently, so `0:2,600:700` of
        a [512, 64] tensor would be answered with `[]` where the reader asked for values that are not there."""
        self.check_selection(selection)
        for dim, s in self._by_dimension(selection):
            size = self.entry.shape[dim]
            if not isinstance(s, slice):
                continue
            text = ":".join("" if v is None else str(v) for v in (s.start, s.stop)) \
                + ("" if s.step is None else f":{s.step}")
            if any(v is not None and not -size <= v <= size for v in (s.start, s.stop)):
                raise StoreError(f"{self.path}: slice {text} is out of range for dimension {dim} of size {size} "
                                 f"(bounds: {-size} to {size})")
            if size and not range(*s.indices(size)):
                raise StoreError(f"{self.path}: slice {text} selects nothing of dimension {dim} of size {size}")

    def _by_dimension(self, selection: Any) -> list[tuple[int, Any]]:
        """(dimension, its index or slice) for each entry of a selection other than '...' (which stands for
        the dimensions between); a selection with two '...' or more indices than dimensions is refused."""
        shape = self.entry.shape
        sel = selection if isinstance(selection, tuple) else (selection,)
        if sum(s is Ellipsis for s in sel) > 1:
            raise StoreError(f"{self.path}: a selection may hold one '...' at most")
        explicit = [s for s in sel if s is not Ellipsis]
        if len(explicit) > len(shape):
            raise StoreError(f"{self.path}: {len(explicit)} indices for a {len(shape)}-d tensor of shape {list(shape)}")
        if Ellipsis in sel:
            at = sel.index(Ellipsis)
            dims = list(range(at)) + list(range(len(shape) - (len(sel) - at - 1), len(shape)))
        else:
            dims = list(range(len(explicit)))
        return list(zip(dims, explicit))

    def _check_arrived(self, selection: Any) -> None:
        """Refuse to read rows whose cells no ingested rank has delivered (Zarr would return zeros)."""
        entry = self.entry
        if not entry.shape or not entry.ncells:
            return
        first = selection[0] if isinstance(selection, tuple) and selection else selection
        if first is Ellipsis or (isinstance(selection, tuple) and not selection):
            first = slice(None)
        if isinstance(first, int):
            n = entry.shape[0]
            rows = range(first % n, first % n + 1) if -n <= first < n else range(0)
        elif isinstance(first, slice):
            rows = range(*first.indices(entry.shape[0]))
        else:
            rows = range(entry.shape[0])
        if not rows:
            return
        lo, hi = min(rows[0], rows[-1]), max(rows[0], rows[-1])
        per_row = entry.ncells // entry.grid[0]
        wanted = {i * per_row + j for i in range(lo // entry.cell[0], hi // entry.cell[0] + 1) for j in range(per_row)}
        if wanted - self._store.cells_present(self.path):
            self._store.records()  # a rank may have been committed since we last looked
        missing = sorted(wanted - self._store.cells_present(self.path))
        if missing:
            start = (missing[0] // per_row) * entry.cell[0]
            end = min(start + entry.cell[0], entry.shape[0])
            raise StoreError(f"{self.path}: rows {start}-{end - 1} have not arrived yet (their rank is not "
                             f"ingested); read other rows, or wait")

    def read(self) -> "torch.Tensor":
        return self[...]

    def stats(self, selection: Any = None, block_bytes: int = 16 << 20) -> dict[str, float | int]:
        """min/max/mean/std (population)/L2 norm over the finite values, and how many are NaN or infinite.

        Without a selection the whole tensor is streamed in row blocks, so memory stays bounded.
        """
        acc = {"count": 0, "nan": 0, "inf": 0, "sum": 0.0, "sumsq": 0.0, "min": np.inf, "max": -np.inf}

        def add(values: np.ndarray) -> None:
            x = np.asarray(values, dtype=np.float64).reshape(-1)
            nan = np.isnan(x)
            acc["nan"] += int(nan.sum())
            acc["inf"] += int(np.isinf(x).sum())
            x = x[np.isfinite(x)]
            if x.size:
                acc["count"] += int(x.size)
                acc["sum"] += float(x.sum())
                acc["sumsq"] += float(np.dot(x, x))
                acc["min"] = min(acc["min"], float(x.min()))
                acc["max"] = max(acc["max"], float(x.max()))

        if selection is not None or not self.entry.shape:
            add(self.numpy(... if selection is None else selection))
        else:
            row = max(1, self.entry.nbytes // max(self.entry.shape[0], 1))
            step = max(1, block_bytes // row)
            for lo in range(0, self.entry.shape[0], step):
                add(self.numpy(slice(lo, lo + step)))
        n = acc["count"]
        mean = acc["sum"] / n if n else float("nan")
        var = max(acc["sumsq"] / n - mean * mean, 0.0) if n else float("nan")
        return {"count": n, "nan": acc["nan"], "inf": acc["inf"], "min": float(acc["min"]) if n else float("nan"),
                "max": float(acc["max"]) if n else float("nan"), "mean": mean, "std": var ** 0.5,
                "norm": acc["sumsq"] ** 0.5}

    def __repr__(self) -> str:
        return f"TensorHandle({self.path!r}, shape={list(self.entry.shape)}, dtype=torch.{self.entry.dtype})"


def to_torch(raw: np.ndarray, dtype: str) -> "torch.Tensor":
    """Store bits (raw numpy dtype) -> a torch tensor of the recorded dtype, bit for bit."""
    import torch

    arr = raw if raw.flags.c_contiguous and raw.flags.writeable else raw.copy(order="C")  # keeps 0-d shapes
    return torch.from_numpy(arr).view(getattr(torch, dtypes.info(dtype).name))


def _tensor_bytes(store: StoredCells, record: dict[str, Any]) -> bytes:
    """A "$tensor" record's bytes: inline, or a blob of the store."""
    return store.blob(record["blob"]) if "blob" in record else base64.b64decode(record["data"])


def decode_tensor(store: StoredCells, record: dict[str, Any]) -> "torch.Tensor":
    """A plain tensor from its "$tensor" record."""
    info = dtypes.info(record["dtype"])
    raw = _tensor_bytes(store, record)
    return to_torch(np.frombuffer(bytearray(raw), dtype=info.raw).reshape(record["shape"]), info.name)


@dataclass(frozen=True)
class TensorValue:
    """A plain tensor's dtype, shape and bytes (C order): what the torch writer needs of it, without torch."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def tensor_value(tensor: "torch.Tensor") -> TensorValue:
    import torch

    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return TensorValue(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), raw)


def decode_value(store: StoredCells, encoded: Any, lean: bool = False) -> Any:
    """A stored value as torch objects; `lean`, with shardstore's stand-ins for them instead (TensorValue,
    TorchDType, TorchDevice, TorchVersion), so that writing it back needs no torch."""
    if lean:
        return values.decode(encoded, tensor=lambda rec: TensorValue(
            dtypes.info(rec["dtype"]).name, tuple(rec["shape"]), _tensor_bytes(store, rec)))
    import torch

    return values.decode(encoded, tensor=lambda rec: decode_tensor(store, rec),
                         torch_dtype=lambda name: getattr(torch, name), torch_device=torch.device,
                         torch_version=torch.torch_version.TorchVersion)
