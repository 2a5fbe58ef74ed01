"""shardstore: unshard per-rank FSDP ShardedTensor checkpoints through an on-disk Zarr v3 store.

    import shardstore
    store = shardstore.unshard_to_store("ckpt/step1000", "ckpt.zarr")   # or shardstore.ingest(...)
    w = store["model/transformer.wte.weight"]     # lazy: w.shape, w.dtype, w[0:4] -> torch.Tensor
    shardstore.export(store, "hf-out")            # model.safetensors (+ index when sharded)
"""

from __future__ import annotations

from .api import export, ingest, open, unshard, watch
from .errors import CheckpointError, ExportError, ShardstoreError, StoreError, UnsafePickleError
from .store.handle import TensorHandle
from .store.store import Status, Store

__version__ = "0.1.0"
__all__ = ["open", "ingest", "watch", "export", "unshard", "Store", "Status", "TensorHandle", "ShardstoreError",
           "CheckpointError", "UnsafePickleError", "StoreError", "ExportError", "__version__"]
