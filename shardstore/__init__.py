"""shardstore: unshard sharded PyTorch training checkpoints through an on-disk Zarr v3 store.

    import shardstore
    store = shardstore.ingest("ckpt.zarr", shardstore.rank_files("ckpt/step1000"))
    w = store["model/transformer.wte.weight"]     # lazy: w.shape, w.dtype, w[0:4] -> torch.Tensor
    store["trainer/checkpoints"]                  # other values as they were (paths, Opaque records)
    shardstore.export(store, "hf-out")            # model.safetensors (+ index when sharded)
"""

from __future__ import annotations

from .api import average, export, follow, ingest, open, rank_files, scratch_location, unshard, watch
from .errors import CheckpointError, ExportError, ShardstoreError, StoreError, UnsafePickleError
from .inspect import Inspected, inspect
from .progress import Progress
from .records import GlobalRef, Opaque
from .store.handle import TensorHandle
from .store.store import Status, Store
from .verify import Difference, VerifyResult, verify

__version__ = "0.1.0"
__all__ = ["open", "ingest", "watch", "export", "unshard", "verify", "average", "follow", "inspect", "Inspected", "VerifyResult", "Difference", "rank_files", "scratch_location", "Store", "Status",
           "TensorHandle", "Opaque", "GlobalRef", "Progress", "ShardstoreError", "CheckpointError",
           "UnsafePickleError", "StoreError", "ExportError", "__version__"]
