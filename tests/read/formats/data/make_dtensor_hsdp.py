"""Write rank files of an FSDP2 model over a 2x2 (ddp, fsdp) mesh: python make_dtensor_hsdp.py OUT PORT."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def run(rank, world, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 5))
    mesh = init_device_mesh("cpu", (2, world//2), mesh_dim_names=("ddp", "fsdp"))
    fully_shard(m, mesh=mesh)
    torch.save(m.state_dict(), f"{out}/model_world_size_{world}_rank_{rank}.pt")
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(run, args=(4, sys.argv[1], int(sys.argv[2])), nprocs=4)
