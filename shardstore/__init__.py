"""shardstore: unshard sharded PyTorch training checkpoints through an on-disk Zarr v3 store.

    import shardstore
    store = shardstore.ingest("ckpt.zarr", shardstore.rank_files("ckpt/step1000"))
    w = store["model/transformer.wte.weight"]     # lazy: w.shape, w.dtype, w[0:4] -> torch.Tensor
    store["trainer/checkpoints"]                  # other values as they were (paths, Opaque records)
    shardstore.export(store, "hf-out")            # model.safetensors (+ index when sharded)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import average, export, follow, ingest, open, rank_files, scratch_location, unshard, watch
    from .errors import CheckpointError, ExportError, ShardstoreError, StoreError, UnsafePickleError
    from .inspect import Inspected, inspect
    from .progress import Progress
    from .records import GlobalRef, Opaque
    from .store.handle import TensorHandle
    from .store.store import Status, Store
    from .verify import Difference, VerifyResult, verify

__version__ = "0.1.0"

# The public names by the module that defines them, imported on first use (PEP 562): `shardstore --version`
# and `--help` import this package, and the API behind these names brings numpy, zarr and the readers.
_FROM = {
    "api": ("open", "ingest", "watch", "export", "unshard", "average", "follow", "rank_files", "scratch_location"),
    "errors": ("ShardstoreError", "CheckpointError", "UnsafePickleError", "StoreError", "ExportError"),
    "inspect": ("inspect", "Inspected"),
    "verify": ("verify", "VerifyResult", "Difference"),
    "progress": ("Progress",),
    "records": ("Opaque", "GlobalRef"),
    "store.handle": ("TensorHandle",),
    "store.store": ("Store", "Status"),
}
_MODULE = {name: module for module, names in _FROM.items() for name in names}

__all__ = ["open", "ingest", "watch", "export", "unshard", "verify", "average", "follow", "inspect", "Inspected",
           "VerifyResult", "Difference", "rank_files", "scratch_location", "Store", "Status", "TensorHandle", "Opaque",
           "GlobalRef", "Progress", "ShardstoreError", "CheckpointError", "UnsafePickleError", "StoreError",
           "ExportError", "__version__"]


def __getattr__(name: str) -> Any:
    module = _MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'shardstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps the public names above the submodules that share them (`export`, `ingest`, `inspect`, `verify`,
    `follow`, `average`): importing one sets it as this package's attribute, which would hide the function
    (as the eager `from .api import export` once rebound it). `import shardstore.export.registry` still
    works: submodules are found in sys.modules."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MODULE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
