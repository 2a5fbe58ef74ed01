"""An OLMo-shaped torch.distributed.checkpoint (DCP) checkpoint, saved the way FSDP2 trainers save one.

`world` gloo processes build the model's parameters (OLMo's names and shapes from synth.ModelSpec),
`fully_shard` them, create AdamW's state and `dcp.save` model and optimizer together, as torchtitan and
OLMo-core do: `.metadata` plus one `__{rank}_0.distcp` per rank.

    python benchmarks/synth_dcp.py OUT WORLD D_MODEL LAYERS
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth import ModelSpec  # noqa: E402


class Params(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for name, shape in spec.shapes().items():
            self.register_parameter(name.replace(".", "_"), nn.Parameter(torch.randn(shape, generator=gen) * 0.02))


def _save(rank: int, world: int, out: str, spec: ModelSpec, port: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = Params(spec)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4)
    model_sd, optim_sd = get_state_dict(model, opt)  # creates AdamW's state (step, exp_avg, exp_avg_sq)
    dcp.save({"model": model_sd, "optim": optim_sd, "trainer": {"global_step": 1}}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def generate(out: str | os.PathLike[str], world: int, spec: ModelSpec) -> Path:
    out = Path(out)
    if (out / ".metadata").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_save, args=(world, str(out), spec, port), nprocs=world, join=True)
    return out


if __name__ == "__main__":
    generate(sys.argv[1], int(sys.argv[2]), ModelSpec(int(sys.argv[3]), int(sys.argv[4])))
