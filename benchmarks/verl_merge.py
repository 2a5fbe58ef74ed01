"""veRL's own merge, as `python -m verl.model_merger merge --backend fsdp` runs it
(verl/model_merger/fsdp_model_merger.py), without veRL installed: `torch.load` every rank's model file in a
thread pool (all held at once), take each DTensor's local tensor cast to bf16, `torch.cat` them along the
placement's dimension, and save the merged state dict as safetensors (`save_pretrained` writes it that way).

    python benchmarks/verl_merge.py ACTOR_DIR OUT_DIR
"""

from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard


def merge(actor: Path, out: Path) -> None:
    world = int(re.search(r"world_size_(\d+)", next(actor.glob("model_world_size_*_rank_0.pt")).name)[1])
    shards: list[dict] = [{}] * world

    def load(rank: int) -> None:
        shards[rank] = torch.load(actor / f"model_world_size_{world}_rank_{rank}.pt", map_location="cpu",
                                  weights_only=False)

    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        list(pool.map(load, range(world)))
    mesh_names = next((v.device_mesh.mesh_dim_names for v in shards[0].values() if isinstance(v, DTensor)), None)
    merged = {}
    for key in list(shards[0]):
        parts = [s.pop(key) for s in shards]
        if isinstance(parts[0], DTensor):
            placements = tuple(parts[0].placements)
            if mesh_names and mesh_names[0] in ("dp", "ddp"):
                placements = placements[1:]  # veRL discards the replicate dimension (and keeps every copy)
            (placement,) = placements
            assert isinstance(placement, Shard)
            merged[key] = torch.cat([p._local_tensor.bfloat16() for p in parts], dim=placement.dim).contiguous()
        else:
            merged[key] = torch.cat([p.bfloat16() for p in parts], dim=0)
    out.mkdir(parents=True, exist_ok=True)
    save_file(merged, out / "model.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    merge(Path(sys.argv[1]), Path(sys.argv[2]))
