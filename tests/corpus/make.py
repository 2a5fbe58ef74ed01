"""Write one member of the corpus: a real sharded checkpoint, saved by the trainers' own torch code.

    <venv of the member's torch>/bin/python -m tests.corpus.make NAME OUT_DIR

Each member is a tiny model trained one step by real FSDP processes (gloo, CPU) under the torch version
and configuration that `MEMBERS` names, saved the way its trainer saves it: by OLMo's own checkpointer
classes (ai2-olmo 0.6.0) where `olmo_code` says so, else through the same torch calls its trainer makes. Beside the checkpoint the
writing processes leave what they gathered themselves — FSDP's FULL_STATE_DICT of the model and of the
optimizer (`FSDP.optim_state_dict`), or DTensor's `full_tensor()` — as `expected.json`: every tensor's
dtype, shape and SHA-256 of its bytes, so the test compares bit for bit without the repository holding
every byte twice. `member.json` records the torch version and the configuration.

torch 1.13–2.1 FSDP was written for GPUs. To run it on a CPU as it ran on a cluster, `_cpu_shims` gives
it what a GPU node would: `torch.cuda.device_count()` is 8 (placements then read `cuda:{r % 8}`, as on
an 8-GPU node), streams and events that do nothing, and the two collectives gloo lacks
(`all_gather_into_tensor`, `reduce_scatter_tensor`) built from ones it has. Storages can be tagged
`cuda:{local rank}` at save (`cuda_tags`), as a GPU run without CPU offload writes them. Nothing of the
saved structure is changed by hand: every file is torch.save'd by the trainer's own code path.

The members are committed under tests/corpus/data/ (README.md there lists them); CI only reads them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import random
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from tests.corpus.olmo_data import MixtureCheckpoint

VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


@dataclass(frozen=True)
class Member:
    torch: str  # the version that must write it ("2.1": 2.1.x)
    trainer: str  # "olmo-legacy", "composer", "olmo-local", "torchtitan-dcp", "composer-dcp"
    world: int
    strategy: str = "FULL_SHARD"  # FSDP ShardingStrategy; HYBRID_SHARD uses two replica groups
    param_dtype: str = "float32"  # the parameters' own dtype
    mixed: str | None = None  # MixedPrecision param/reduce/buffer dtype (compute), over `param_dtype` storage
    use_orig_params: bool = True
    wrap: str = "block"  # "block" (one FSDP unit per transformer block, as OLMo wraps), "size", "none"
    offload: bool = True  # offload_to_cpu in the sharded state-dict config
    cuda_tags: bool = False  # storages tagged cuda:{local rank}, as a GPU run without offload saves them
    vocab: int = 250  # 250 rows divide by none of 3, 4, 8; 11000 makes the embedding a multi-cell array
    olmo_code: bool = False  # saved by OLMo's own checkpointer (ai2-olmo 0.6.0), precision from its TrainConfig
    notes: str = ""
    exercises: list[str] = field(default_factory=list)


MEMBERS: dict[str, Member] = {
    "olmo-legacy-t2.1-bf16mixed-w3": Member(
        "2.1", "olmo-legacy", 3, mixed="bfloat16", cuda_tags=True, vocab=11000, olmo_code=True,
        notes="OLMo torch_legacy as OLMo trained in 2023 (fsdp.precision: mixed, wrapping by block)",
        exercises=["mixed precision", "d0 % W != 0", "d0 < W (ranks holding nothing)", "cuda placements/storages",
                   "multi-cell arrays"]),
    "olmo-legacy-t2.0-shardgradop-w3": Member(
        "2.0", "olmo-legacy", 3, strategy="SHARD_GRAD_OP", wrap="size", offload=False,
        notes="SHARD_GRAD_OP, size-based wrapping, state dict not offloaded",
        exercises=["torch 2.0 pickles", "SHARD_GRAD_OP", "size-based wrap"]),
    "olmo-legacy-t1.13-w2": Member(
        "1.13", "olmo-legacy", 2, use_orig_params=False, wrap="none",
        notes="torch 1.13.1, one FSDP unit, use_orig_params=False", exercises=["torch 1.13 pickles"]),
    "composer-t2.1-hsdp-w4": Member(
        "2.1", "composer", 4, strategy="HYBRID_SHARD", mixed="bfloat16",
        notes="Composer 0.15-shaped HYBRID_SHARD (2 replica groups of 2): placements numbered within the group",
        exercises=["HSDP group-rank placements", "replicas", "mixed precision"]),
    "composer-t2.0-hsdp-w4": Member(
        "2.0", "composer", 4, strategy="HYBRID_SHARD", use_orig_params=False, cuda_tags=True,
        notes="Composer 0.13-shaped HYBRID_SHARD under torch 2.0.1, use_orig_params=False",
        exercises=["HSDP group-rank placements", "torch 2.0 pickles", "use_orig_params=False"]),
    "fsdp-t2.1-purebf16-w2": Member(
        "2.1", "olmo-legacy", 2, param_dtype="bfloat16", offload=False,
        notes="parameters and optimizer state in bf16 (no mixed precision)", exercises=["pure bf16"]),
    "composer-t2.13-hsdp-w4": Member(
        "2.13", "composer", 4, strategy="HYBRID_SHARD", mixed="float16",
        notes="HYBRID_SHARD under torch 2.13: placements name global ranks", exercises=["HSDP global placements", "fp16 mixed"]),
    "olmo-local-t2.1-bf16mixed-w3": Member(
        "2.1", "olmo-local", 3, mixed="bfloat16", vocab=11000, olmo_code=True,
        notes="OLMo `local` as every OLMo run wrote it: mixed precision aligns parameters to 8 elements",
        exercises=["flat-parameter padding of the compute dtype", "_shard_param_infos", "multi-cell flat arrays"]),
    "olmo-local-t2.1-hsdp-w4": Member(
        "2.1", "olmo-local", 4, strategy="HYBRID_SHARD", mixed="bfloat16", olmo_code=True,
        notes="OLMo `local` under hybrid sharding (peteish-style), mixed precision", exercises=["local HSDP", "padding"]),
    "olmo-local-t2.0-w2": Member(
        "2.0", "olmo-local", 2, mixed="bfloat16",
        notes="OLMo `local` under torch 2.0.1: _shard_indices/_shard_param_offsets, no alignment padding",
        exercises=["torch <= 2.0 flat-parameter metadata"]),
    "olmo-local-t2.13-fp16mixed-w3": Member(
        "2.13", "olmo-local", 3, mixed="float16",
        notes="the `local` layout from torch 2.13's FSDP1 (flat_param module path `_flat_param`)",
        exercises=["padding of the compute dtype (fp16)", "_flat_param._ShardParamInfo"]),
    "torchtitan-dcp-t2.13-w2": Member(
        "2.13", "torchtitan-dcp", 2, notes="torchtitan-shaped FSDP2 DCP: train_state values are io.BytesIO",
        exercises=["DCP bytes items that are BytesIO", "FSDP2 DTensors", "flattened optimizer state"]),
    "composer-dcp-t2.13-hsdp-w4": Member(
        "2.13", "composer-dcp", 4, strategy="HYBRID_SHARD",
        notes="Composer >= 0.16 under HSDP: the first replica group saves; rng (every rank's) on rank 0 only",
        exercises=["DCP from one replica group", "rng held by one unit"]),
}


# ---------------------------------------------------------------------------------------------- the model
D, HIDDEN = 24, 56


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 12 + 12 elements first: the next start is 4 mod 8, so bf16/fp16 compute pads 4 where fp32 pads
        # nothing, the case where reading the stored dtype's alignment goes wrong (OLMo's `8100, 4`)
        self.head_norm = nn.LayerNorm(D // 2)
        self.attn_norm = nn.LayerNorm(D)
        self.att_proj = nn.Linear(D, 3 * D, bias=False)
        self.attn_out = nn.Linear(D, D, bias=False)
        self.ff_proj = nn.Linear(D, 2 * HIDDEN, bias=False)
        self.ff_out = nn.Linear(HIDDEN, D, bias=False)
        self.gate = nn.Linear(D, 5)  # 5 + 120 elements: the next parameter's start needs alignment padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.att_proj(self.attn_norm(x))[..., :D]
        x = x + self.attn_out(torch.tanh(torch.cat([self.head_norm(h[..., :D // 2]), h[..., D // 2:]], -1)))
        up, gate = self.ff_proj(x).chunk(2, dim=-1)
        x = x + self.ff_out(up * torch.sigmoid(gate))
        return x + self.gate(x).sum(-1, keepdim=True) * 0.01


class Model(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D)
        self.scale = nn.Parameter(torch.ones(2))  # 2 rows: fewer than the world size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.linear(self.ln_f(x), self.wte.weight) * self.scale.sum()


class ComposerModel(nn.Module):
    """Composer's ComposerModel around the network: state-dict keys gain its `model.` prefix."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


# ---------------------------------------------------------------------------------------------- CPU shims
class _Event:
    def record(self, *a: Any) -> None: ...
    def wait(self, *a: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: return True


class _Stream:
    def __init__(self, *a: Any, **k: Any) -> None: ...
    def wait_stream(self, *a: Any) -> None: ...
    def wait_event(self, *a: Any) -> None: ...
    def record_event(self, *a: Any) -> _Event: return _Event()
    def synchronize(self) -> None: ...
    def __enter__(self) -> "_Stream": return self
    def __exit__(self, *a: Any) -> None: ...


class _Done:
    def wait(self, *a: Any) -> bool: return True
    def is_completed(self) -> bool: return True


class _CpuTorch:
    """`torch` for one module of torch 1.13, whose tensors made for a collective are put on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **kwargs)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as a dtype gloo moves everywhere (gloo of that era lacks bf16)."""
    return t.view(torch.uint8) if t.element_size() == 2 else t


_GLOO = {"all_gather": dist.all_gather, "all_reduce": dist.all_reduce, "broadcast": dist.broadcast}


def _all_gather(outputs: list[torch.Tensor], input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """NCCL gathers pieces of different sizes (FSDP's optimizer state); gloo wants one size: pad, trim."""
    outs, src = [_bits(o) for o in outputs], _bits(input.contiguous()).reshape(-1)
    width = max(o.numel() for o in outs)
    if all(o.numel() == width for o in outs):
        _GLOO["all_gather"](outs, src, group=group)
    else:
        padded = [torch.zeros(width, dtype=src.dtype) for _ in outs]
        _GLOO["all_gather"](padded, torch.cat([src, src.new_zeros(width - src.numel())]), group=group)
        for o, p in zip(outs, padded):
            o.reshape(-1).copy_(p[:o.numel()])
    return _Done() if async_op else None


def _broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    _GLOO["broadcast"](_bits(tensor), src, group=group)
    return _Done() if async_op else None


def _all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    if tensor.dtype in (torch.bfloat16, torch.float16):  # reduced in fp32, as gloo can
        wide = tensor.float()
        _GLOO["all_reduce"](wide, op=op, group=group)
        tensor.copy_(wide)
    else:
        _GLOO["all_reduce"](tensor, op=op, group=group)
    return _Done() if async_op else None


def _all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    return _all_gather(list(output.chunk(dist.get_world_size(group))), input, group, async_op)


def _reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                           async_op: bool = False) -> Any:
    total = input.float()
    _GLOO["all_reduce"](total, op=op, group=group)
    output.copy_(total.chunk(dist.get_world_size(group))[dist.get_rank(group)].to(output.dtype))
    return _Done() if async_op else None


def _cpu_shims() -> None:
    if VERSION >= (2, 2):
        return  # FSDP runs on the CPU as it is
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp

    torch.cuda.device_count = lambda: 8
    if VERSION < (2, 1):  # FSDP refuses to start without CUDA; nothing below allocates on it
        torch.cuda.is_available = lambda: True
        torch.cuda.current_device = lambda: 0
        torch.cuda.is_current_stream_capturing = lambda: False  # asked by the optimizer once CUDA "exists"
    for backend in (torch.cuda, getattr(torch, "cpu", None)):  # FSDP's device handle: torch.cuda, or torch.cpu (2.1)
        if backend is not None:
            backend.Stream, backend.Event = _Stream, _Event
            backend.current_stream = lambda *a, **k: _Stream()
            backend.stream = lambda *a, **k: contextlib.nullcontext()
            backend.synchronize = lambda *a, **k: None
    dist.all_gather, dist.all_reduce, dist.broadcast = _all_gather, _all_reduce, _broadcast
    dist.all_gather_into_tensor = dist._all_gather_base = _all_gather_into_tensor
    dist.reduce_scatter_tensor = dist._reduce_scatter_base = _reduce_scatter_tensor
    torch.Tensor.record_stream = lambda self, *a: None  # a CPU tensor has no stream to record
    # 1.13 and 2.0 compute on the current GPU whatever device_id says
    if VERSION < (2, 0):
        import torch.distributed.fsdp._optim_utils as optim_utils

        fsdp.FullyShardedDataParallel._get_compute_device = lambda self, *a: torch.device("cpu")
        optim_utils.torch = _CpuTorch()  # its cross-rank key check builds a tensor on "cuda"
    elif VERSION < (2, 1):
        import torch.distributed.fsdp._init_utils as init_utils
        import torch.distributed.fsdp._optim_utils as optim_utils

        init_utils._get_compute_device = lambda *a, **k: torch.device("cpu")
        # a cross-rank check that every rank has rank 0's optimizer keys, built on a CUDA tensor
        optim_utils._check_missing_keys_on_rank = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # the state-dict code of 1.13/2.0 moves shards to "the GPU"


@contextlib.contextmanager
def _cuda_tags(rank: int, on: bool):
    """Tag CPU storages `cuda:{local rank}` while saving, as a GPU run that did not offload writes them."""
    if not on:
        yield
        return
    import torch.serialization as ser

    entry = (1, lambda obj: f"cuda:{rank % 8}" if getattr(obj, "device", None) is not None
             and obj.device.type == "cpu" else None, lambda obj, location: None)
    ser._package_registry.append(entry)
    ser._package_registry.sort(key=lambda e: e[0])
    try:
        yield
    finally:
        ser._package_registry.remove(entry)


# ---------------------------------------------------------------------------------------------- saving
def _wrap(model: nn.Module, m: Member, groups: Any) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, wrap

    kwargs: dict[str, Any] = {"sharding_strategy": getattr(ShardingStrategy, m.strategy),
                              "device_id": torch.device("cpu")}
    if VERSION >= (2, 0):  # 1.13 had only flat parameters
        kwargs["use_orig_params"] = m.use_orig_params
    if groups is not None:
        kwargs["process_group"] = groups
    if m.olmo_code:  # `fsdp.precision: mixed` with `precision: amp_bf16`: OLMo's own MixedPrecision
        kwargs["mixed_precision"] = _olmo_config(m).fsdp_precision
    elif m.mixed:
        dt = getattr(torch, m.mixed)
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=dt, reduce_dtype=dt, buffer_dtype=dt)
    if m.wrap == "block":  # what OLMo's `by_block` wrapping and Composer's per-block wrapping amount to
        kwargs["auto_wrap_policy"] = functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    elif m.wrap == "size":  # each block (6533 parameters) its own unit; the tied embedding stays in the root
        kwargs["auto_wrap_policy"] = functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=6500)
    return FSDP(model, **kwargs)


def _optimizer(model: nn.Module, m: Member) -> torch.optim.Optimizer:
    """AdamW with OLMo's two groups (decay / no decay, each naming its params) where FSDP keeps the
    original parameters; one group over the flat parameters otherwise."""
    if not m.use_orig_params:
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if "norm" in name or name.endswith(".bias") or "scale" in name else decay).append((name, p))
    groups = [{"params": [p for _, p in g], "param_names": [n for n, _ in g], "weight_decay": wd}
              for g, wd in ((decay, 0.1), (no_decay, 0.0))]
    return torch.optim.AdamW(groups, lr=1e-2)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, vocab, (2, 6), generator=gen)
    logits = model(ids).float()
    nn.functional.cross_entropy(logits.flatten(0, 1), torch.randint(0, vocab, (12,), generator=gen)).backward()
    opt.step()


def _trainer_state(rank: int, world: int) -> dict[str, Any]:
    """What OLMo's trainer_state_dict() puts beside `model` and `optim` in every rank file."""
    random.seed(rank)
    np.random.seed(rank)
    return {"epoch": 0, "global_step": 1, "global_train_examples_seen_this_epoch": 2 * world,
            "global_train_tokens_seen": 12 * world, "world_size": world,
            "checkpoints": [Path("/scratch/run/step1")], "unsharded_checkpoints": [], "ephemeral_checkpoints": [],
            "data_checkpoint": MixtureCheckpoint(world),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                    "cuda": torch.Generator().manual_seed(100 + rank).get_state()}}


def _hybrid_groups(world: int) -> tuple[Any, Any]:
    """(shard group, replicate group) of this rank: shard groups of contiguous ranks, two replicas."""
    size = world // 2
    shard = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(2)]
    replicate = [dist.new_group([r, r + size]) for r in range(size)]
    rank = dist.get_rank()
    return shard[rank // size], replicate[rank % size]


def _full_fsdp1(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What FSDP itself gathers: the FULL_STATE_DICT model and the full optimizer state keyed by name."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False) if VERSION >= (2, 0) else FullStateDictConfig()
    if VERSION >= (2, 1):
        from torch.distributed.fsdp import FullOptimStateDictConfig

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config,
                                  FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        full = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
        # keyed by parameter index in 1.13 / 2.0: by name, in the model's parameter order, like 2.1+
        names = list(dict(model.named_parameters()))
        return {"model": model.state_dict(), "optim": {
            "state": {_clean(names[i]) if isinstance(i, int) else i: v for i, v in full["state"].items()},
            "param_groups": full["param_groups"]}}


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_flat_param", "flat_param")


def _sharded_fsdp1(model: nn.Module, opt: torch.optim.Optimizer, m: Member) -> dict[str, Any]:
    """SHARDED_STATE_DICT as the trainers of each torch version called it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    if VERSION < (2, 0):  # 1.13: no state-dict configs
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return {"model": model.state_dict(), "optim": FSDP.sharded_optim_state_dict(model, opt)}
    from torch.distributed.fsdp import ShardedStateDictConfig

    if VERSION >= (2, 1):
        from torch.distributed.fsdp import ShardedOptimStateDictConfig

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=m.offload),
                                  ShardedOptimStateDictConfig(offload_to_cpu=m.offload)):
            return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=m.offload)):
        return {"model": model.state_dict(), "optim": FSDP.sharded_optim_state_dict(model, opt)}


_FLAT_PARAM_METADATA = ("_fqns", "_shard_param_offsets", "_shard_indices", "_numels", "_numels_with_padding",
                        "_shapes", "_shard_numel_padded", "_shard_param_infos")


def _local_state(model: nn.Module) -> dict[str, Any]:
    """OLMo's LocalShardedCheckpointer `_get_flat_param_state_to_save`: every FSDP module's handles."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    modules = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDP):
            continue
        handles = getattr(module, "_handles", None)
        if handles is None:  # torch >= 2.1: one handle
            handles = [module._handle] if module._handle is not None else []
        saved = []
        for handle in handles:
            flat = handle.flat_param
            data = {"flat_param.data": flat.detach()}
            for key in _FLAT_PARAM_METADATA:
                if hasattr(flat, key):
                    data[f"flat_param.{key}"] = getattr(flat, key)
            saved.append(data)
        modules.append({"handles": saved, "name": name})
    return {"modules": modules}


def _fsdp1_run(rank: int, m: Member, out: Path) -> dict[str, Any]:
    """Train and save as `m.trainer` does; return what the processes gather (rank 0 keeps it)."""
    groups = _hybrid_groups(m.world) if m.strategy == "HYBRID_SHARD" else None
    torch.manual_seed(1234)
    net = Model(m.vocab).to(getattr(torch, m.param_dtype))
    model = _wrap(ComposerModel(net) if m.trainer.startswith("composer") else net, m, groups)
    opt = _optimizer(model, m)
    _train_step(model, opt, rank, m.vocab)
    if m.olmo_code:
        _olmo_save(rank, m, model, opt, out)
    elif m.trainer == "olmo-local":
        for kind, state in (("model", _local_state(model)), ("optim", opt.state_dict()),
                            ("train", _trainer_state(rank, m.world))):
            (out / kind).mkdir(parents=True, exist_ok=True)
            with _cuda_tags(rank, m.cuda_tags):
                torch.save(state, out / kind / f"rank{rank}.pt")
        if rank == 0:
            (out / "metadata.yaml").write_text(f"world_size: {m.world}\n")
    elif m.trainer == "composer-dcp":
        _composer_dcp(rank, m, model, opt, out, groups)
    else:
        state = _sharded_fsdp1(model, opt, m)
        with _cuda_tags(rank, m.cuda_tags):
            if m.trainer == "composer":
                folder = out / "ep0-ba1"
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(_composer_state(state, rank, m.world), folder / f"ep0-ba1-rank{rank}.pt")
            else:
                torch.save({**state, **_trainer_state(rank, m.world)}, out / f"rank{rank}.pt")
    dist.barrier()
    return _full_fsdp1(model, opt)


def _olmo_config(m: Member) -> Any:
    """The TrainConfig fields an OLMo run sets for this member (the rest are OLMo's defaults)."""
    from olmo.config import FSDPConfig, FSDPPrecision, ShardedCheckpointerType, TrainConfig
    from torch.distributed.fsdp import ShardingStrategy

    checkpointer = ShardedCheckpointerType.local if m.trainer == "olmo-local" else ShardedCheckpointerType.torch_legacy
    return TrainConfig(run_name="corpus", precision="amp_bf16", save_overwrite=True, sharded_checkpointer=checkpointer,
                       fsdp=FSDPConfig(use_orig_params=m.use_orig_params, precision=FSDPPrecision.mixed,
                                       sharding_strategy=getattr(ShardingStrategy, m.strategy)))


def _olmo_save(rank: int, m: Member, model: nn.Module, opt: torch.optim.Optimizer, out: Path) -> None:
    """What OLMo's Trainer does at a sharded save: the checkpointer its config names writes the folder
    (rank files, metadata.yaml where it has one, and the run's config.yaml)."""
    from olmo.checkpoint import build_sharded_checkpointer

    build_sharded_checkpointer(_olmo_config(m)).save_checkpoint(out, model, opt, _trainer_state(rank, m.world))


def _composer_state(state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Composer 0.13-0.15's sharded rank file (`state_dict_type: sharded`): model keys under its
    ComposerModel's `model.` prefix (the state dict is the wrapped model's, as is)."""
    return {"state": {"model": state["model"], "optimizers": {"DecoupledAdamW": state["optim"]},
                      "schedulers": [{"base_lrs": [1e-2], "last_epoch": 1}], "algorithms": [], "callbacks": {},
                      "rank_zero_seed": 17, "run_name": "corpus",
                      "timestamp": {"epoch": 0, "batch": 1, "sample": 2 * world, "token": 12 * world},
                      "integrations": {}, "metadata": {"composer_env_info": {"world_size": world}}},
            "rng": [{"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}]}


def _composer_dcp(rank: int, m: Member, model: nn.Module, opt: torch.optim.Optimizer, out: Path, groups: Any) -> None:
    """Composer >= 0.16 under HSDP: the sharded state dict saved with dcp.save by the first replica group
    only; rng, every rank's state gathered to a list, only in global rank 0's state dict."""
    import torch.distributed.checkpoint as dcp

    state = _sharded_fsdp1(model, opt, m)
    rngs: list[Any] = [None] * m.world
    dist.all_gather_object(rngs, {"python": random.getstate(), "torch": torch.get_rng_state()})
    full = {"state": {"model": state["model"], "optimizers": {"DecoupledAdamW": state["optim"]},
                      "timestamp": {"epoch": 0, "batch": 1}, "run_name": "corpus"}}
    if rank == 0:
        full["rng"] = rngs
    first = dist.new_group(list(range(m.world // 2)))
    if rank < m.world // 2:
        dcp.save(full, checkpoint_id=str(out / "ep0-ba1"), process_group=first)


def _torchtitan_run(rank: int, m: Member, out: Path) -> dict[str, Any]:
    """torchtitan-shaped: FSDP2, model keys at the top level, flattened optimizer state, TrainState with
    torch.save'd loss histories in io.BytesIO values, all through dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234)
    model = Model(m.vocab)
    mesh = init_device_mesh("cpu", (m.world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, rank, m.vocab)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    losses = {}
    for name, value in (("global_avg_losses", [2.5, 2.25]), ("global_max_losses", [3.0, 2.75]), ("log_steps", [1, 2])):
        losses[name] = io.BytesIO()
        torch.save(value, losses[name])
    state = {**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt, options=flat),
             "train_state": {"step": 2, **losses}, "lr_scheduler": {"lr_scheduler_0": {"last_epoch": 2}}}
    dcp.save(state, checkpoint_id=str(out / "step-2"))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, opt, options=full)}


def _run(rank: int, name: str, out: str, port: int) -> None:
    m = MEMBERS[name]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=m.world)
    _cpu_shims()
    gathered = (_torchtitan_run if m.trainer == "torchtitan-dcp" else _fsdp1_run)(rank, m, Path(out))
    if rank == 0:
        Path(out, "expected.json").write_text(json.dumps(digests(gathered), indent=1, sort_keys=True) + "\n")
        Path(out, "member.json").write_text(json.dumps({"name": name, "written_by": f"torch {torch.__version__}",
                                                        **asdict(m)}, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def digests(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor below `obj` by its path ("optim/state/wte.weight/exp_avg"): dtype, shape and the
    SHA-256 of its bytes in C order; non-tensor leaves by repr."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(digests(v, f"{prefix}{k}/"))
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in obj):
        for i, v in enumerate(obj):
            out.update(digests(v, f"{prefix}{i}/"))
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[prefix.rstrip("/")] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                   "sha256": hashlib.sha256(raw).hexdigest()}
    else:
        out[prefix.rstrip("/")] = {"repr": repr(obj)}
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(name: str, out: str | os.PathLike[str]) -> Path:
    m = MEMBERS[name]
    if ".".join(map(str, VERSION)) != m.torch:
        raise SystemExit(f"{name} is written by torch {m.torch}, this is torch {torch.__version__}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_run, args=(name, str(out), _free_port()), nprocs=m.world, join=True)
    return out


if __name__ == "__main__":
    make(sys.argv[1], sys.argv[2])
