"""A first benchmark: a real FSDP checkpoint, shardstore against the physical floor, one table.

    python benchmarks/bench.py [--world-size 4] [--layers 8] [--out benchmarks/out]

Generates an OLMo-like checkpoint (vocab 50304 x d_model 1024 embedding, `--layers` MLP blocks, fp32
params + AdamW moments) with real gloo/FSDP processes, then times, with the page cache dropped before
each step when running as root: `cp -r` (+ `sync`, since shardstore makes its data durable), `shardstore
ingest`, `export` to safetensors and to torch, and `unshard` end to end; wall time and peak RSS come from
/usr/bin/time. The comparison with OLMo's own unsharder and the metadata-heavy world sizes are open work.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class OlmoLike(nn.Module):
    def __init__(self, layers: int, d_model: int = 1024, vocab: int = 50304) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.LayerNorm(d_model))
            for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for block in self.blocks:
            h = h + block(h)
        return h @ self.wte.weight.t()


def _rank(rank: int, world: int, out: str, layers: int, port: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = FSDP(OlmoLike(layers), device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 50304, (1, 8))).logsumexp(-1).sum().backward()
    opt.step()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True),
                              ShardedOptimStateDictConfig(offload_to_cpu=True)):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    torch.save(state, Path(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def generate(out: Path, world: int, layers: int) -> None:
    if (out / f"rank{world - 1}.pt").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, str(out), layers, port), nprocs=world)


def measure(name: str, cmd: list[str]) -> tuple[str, float, int]:
    if os.geteuid() == 0:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", *cmd], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed: {proc.stderr.strip()}")
    wall, rss = proc.stderr.strip().splitlines()[-1].split()
    return name, float(wall), int(rss) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args()
    ckpt = args.out / f"olmo-like-w{args.world_size}-l{args.layers}"
    generate(ckpt, args.world_size, args.layers)
    size = sum(f.stat().st_size for f in ckpt.glob("rank*.pt"))
    work = args.out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    exe = [sys.executable, "-m", "shardstore.cli"]
    files = [str(f) for f in sorted(ckpt.glob("rank*.pt"))]
    rows = [
        measure("cp -r", ["cp", "-r", str(ckpt), str(work / "cp")]),
        measure("cp -r + sync", ["sh", "-c", f"cp -r {ckpt} {work / 'cp2'} && sync"]),
        measure("shardstore ingest", [*exe, "ingest", str(work / "store"), *files, "-q"]),
        measure("shardstore export (safetensors)", [*exe, "export", str(work / "store"), str(work / "st"), "-q"]),
        measure("shardstore export (torch)", [*exe, "export", str(work / "store"), str(work / "pt"), "--format", "torch", "-q"]),
        measure("shardstore unshard (safetensors)", [*exe, "unshard", str(ckpt), str(work / "un"), "-q"]),
    ]
    print(f"checkpoint: {ckpt.name}, {size / 1e9:.2f} GB in {len(files)} rank files; {os.cpu_count()} cores")
    print(f"{'step':<34}{'wall s':>8}{'ckpt GB/s':>10}{'peak RSS MB':>13}")
    for name, wall, rss in rows:
        print(f"{name:<34}{wall:>8.2f}{size / 1e9 / wall:>10.2f}{rss / 1e6:>13.0f}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
