"""OLMo-like sharded checkpoints at any world size, from one process.

256 live processes do not fit on 2 cores, so each rank's file is built the way that rank would build it,
one rank at a time: torch's "fake" process-group backend stands in for the job (same rank, same world
size, no communication), FSDP's own `_create_chunk_sharded_tensor` makes the ShardedTensors, and
`torch.save` writes them. tests/benchmarks/test_synth.py shows a file made this way is byte-for-byte the
file a real gloo process group writes.

Tensor values are seeded by (tensor name, rank), so any rank's shard can be made without the others.
"""

from __future__ import annotations

import collections
import math
import os
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ModelSpec:
    d_model: int = 1024
    layers: int = 24
    vocab: int = 50304
    olmo1: bool = False  # OLMo 1 (OLMo-7B): non-parametric norms and an untied output layer

    @property
    def hidden(self) -> int:
        return int(math.ceil(8 * self.d_model / 3 / 128)) * 128

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """OLMo's parameter names and shapes (SwiGLU MLP, fused QKV): OLMo 2 adds norm weights (q/k norms too)
        and ties the output to wte; OLMo 1 has neither, and an output layer of its own."""
        d, h = self.d_model, self.hidden
        out = {"transformer.wte.weight": (self.vocab, d)}
        for i in range(self.layers):
            b = f"transformer.blocks.{i}"
            out |= {f"{b}.att_proj.weight": (3 * d, d), f"{b}.attn_out.weight": (d, d),
                    f"{b}.ff_proj.weight": (2 * h, d), f"{b}.ff_out.weight": (d, h)}
            if not self.olmo1:
                out |= {f"{b}.{n}_norm.weight": (d,) for n in ("attn", "ff", "q", "k")}
        out |= {"transformer.ff_out.weight": (self.vocab, d)} if self.olmo1 else {"transformer.ln_f.weight": (d,)}
        return out

    def config_yaml(self) -> str:
        """The `model` section OLMo's TrainConfig writes for this model (what --format hf reads)."""
        olmo2 = str(not self.olmo1).lower()
        return (f"model:\n  d_model: {self.d_model}\n  n_heads: {self.d_model // 64}\n  n_layers: {self.layers}\n"
                f"  mlp_hidden_size: {2 * self.hidden}\n  activation_type: swiglu\n  block_type: sequential\n"
                f"  rope: true\n  rope_theta: {10000 if self.olmo1 else 500000}\n  include_bias: false\n"
                f"  layer_norm_type: {'default' if self.olmo1 else 'rms'}\n  layer_norm_with_affine: {olmo2}\n"
                f"  layer_norm_eps: 1.0e-06\n  attention_layer_norm: {olmo2}\n  norm_after: {olmo2}\n"
                f"  max_sequence_length: 4096\n  vocab_size: {self.vocab}\n  embedding_size: {self.vocab}\n"
                f"  weight_tying: {olmo2}\n  eos_token_id: 50279\n  pad_token_id: 1\n"
                f"sharded_checkpointer: torch_legacy\n")

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes().values())


def chunk_values(name: str, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 4099 + rank)
    return torch.randn(shape, generator=gen)


def _sharded(name: str, shape: tuple[int, ...], rank: int, world: int, pg: Any, device: torch.device) -> Any:
    from torch.distributed.fsdp._shard_utils import _create_chunk_sharded_tensor

    full = torch.empty(shape)  # untouched pages cost nothing: only this rank's chunk is filled
    chunks = full.chunk(world, dim=0)
    if rank < len(chunks):
        chunks[rank].copy_(chunk_values(name, rank, tuple(chunks[rank].shape)))
    return _create_chunk_sharded_tensor(full, rank, world, 8, pg, device=device)


def rank_state(spec: ModelSpec, rank: int, world: int, pg: Any, device: torch.device) -> dict[str, Any]:
    """What OLMo's legacy checkpointer saves on `rank`: model, optim (AdamW, after one step), rng, trainer.
    `pg` is the group the tensors are sharded over: the world, or under hybrid sharding the rank's shard
    group (its replica group's copy, whose chunks are numbered by the rank within it)."""
    shapes = spec.shapes()
    shard_rank, shards = dist.get_rank(pg), dist.get_world_size(pg)
    model = collections.OrderedDict((n, _sharded(n, s, shard_rank, shards, pg, device)) for n, s in shapes.items())
    state = {n: {"step": torch.tensor(1.0), "exp_avg": _sharded(n + "/exp_avg", s, shard_rank, shards, pg, device),
                 "exp_avg_sq": _sharded(n + "/exp_avg_sq", s, shard_rank, shards, pg, device)}
             for n, s in shapes.items()}
    return {"model": model,
            "optim": {"state": state, "param_groups": [{"lr": 4e-4, "betas": (0.9, 0.95), "eps": 1e-5,
                                                        "weight_decay": 0.1, "params": list(shapes)}]},
            "rng": {"python": rank, "torch": torch.full((16,), rank % 256, dtype=torch.uint8)},
            "trainer": {"global_step": 1, "global_train_tokens_seen": 4096 * world}}


def write_rank(out: Path, spec: ModelSpec, rank: int, world: int, pg: Any, device: torch.device) -> Path:
    path = out / f"rank{rank}.pt"
    tmp = out / f".tmp-rank{rank}" / path.name  # same file name: torch names the archive inside after it
    tmp.parent.mkdir(exist_ok=True)
    torch.save(rank_state(spec, rank, world, pg, device), tmp)
    os.replace(tmp, path)  # a crash never leaves a rank file that looks finished
    tmp.parent.rmdir()
    return path


def _write_ranks(out: str, spec: ModelSpec, ranks: list[int], world: int, device: str, group: int) -> None:
    import warnings

    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.simplefilter("ignore")
    for rank in ranks:
        if (Path(out) / f"rank{rank}.pt").exists():
            continue
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            # hybrid sharding: every rank makes every shard group, as torch's HSDP set-up does
            shard_groups = [dist.new_group(list(range(g, g + group))) for g in range(0, world, group)] \
                if group < world else [dist.group.WORLD]
            write_rank(Path(out), spec, rank, world, shard_groups[rank // group], torch.device(device))
        finally:
            dist.destroy_process_group()


def generate(out: str | os.PathLike[str], world: int, spec: ModelSpec, jobs: int = 2, device: str = "cpu",
             ranks: int | None = None, group: int | None = None) -> Path:
    """Write rank0.pt ... rank{world-1}.pt into `out` (ranks already there are kept); with `ranks`, only the
    first that many: a subset of a checkpoint too big for the disk, whose files are each full size. With
    `group`, hybrid sharding: shard groups of that many ranks, each holding a whole copy."""
    group = group or world
    if world % group:
        raise ValueError(f"world size {world} is not a multiple of the shard group's {group}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = list(range(world if ranks is None else ranks))
    (out / "config.yaml").write_text(spec.config_yaml())
    with ProcessPoolExecutor(jobs) as pool:
        list(pool.map(_write_ranks, [str(out)] * jobs, [spec] * jobs, [ranks[i::jobs] for i in range(jobs)],
                      [world] * jobs, [device] * jobs, [group] * jobs))
    return out
