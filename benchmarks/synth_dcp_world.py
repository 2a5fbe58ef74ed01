"""An FSDP2 torch.distributed.checkpoint (DCP) checkpoint at any world size W (4096 and more), from one process.

What benchmarks/synth_dcp.py makes with W live gloo processes (`fully_shard` + AdamW + `get_state_dict` +
`dcp.save` of {"model", "optim", "trainer"}: the same values), which do not fit on 2 cores past a few
dozen, made here one rank at a time under torch's "fake" process group (same rank, same world size, no
communication). DCP's own `DefaultSavePlanner` and `FileSystemWriter` plan and write every rank; only the
collectives of `dcp.save` become loops in this process (each plan and result pickled and unpickled, as
gather_object and scatter_object_list do, which the .metadata bytes depend on):

  dcp.save on W ranks                           here
  every rank: local plan, gathered to rank 0    pass 1: for each rank, its state dict, planner and writer set
                                                  up, create_local_plan, prepare_local_plan
  rank 0: create_global_plan + prepare_global   rank 0's planner and writer, over all the plans
  every rank: write_data -> __{r}_0.distcp      pass 2: for each rank, finish_plan, write_data
  rank 0: finish -> .metadata                   rank 0's writer.finish

Rank 0's state dict is torch's own (fully_shard, AdamW, get_state_dict); another rank's is rank 0's with
each DTensor's local shard replaced by that rank's (torch.chunk's rows, an empty (0, ...) shard past the
end, AdamW's moments zeros as get_state_dict's first step leaves them), on that rank's mesh: a few ms a
rank where torch's own takes half a second. The rule is checked against torch's rank 0 on every run, and
`--exact` builds every rank with torch. tests/benchmarks/test_synth_dcp_world.py holds the files, both
ways, to a real gloo `dcp.save`'s, byte for byte (.metadata: but for its random save id and its path).

    python benchmarks/synth_dcp_world.py OUT WORLD [D_MODEL LAYERS [VOCAB]] [--fsync] [--exact]
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth import ModelSpec  # noqa: E402
from synth_dcp import Params  # noqa: E402


def _wire(obj):
    """What crossing a process boundary does to a DCP plan or write result: dist.gather_object and
    scatter_object_list pickle every rank's object, the coordinator's own included, and unpickle it on
    the receiver. The round trip matters for the .metadata bytes: objects shared within one rank's plan
    stay shared, objects shared between ranks or with the coordinator's metadata do not, and pickle's memo
    writes a shared string once and a copy twice."""
    return pickle.loads(pickle.dumps(obj))


class _Shared(nn.Module):
    """synth_dcp.Params' parameter names, holding the already drawn full tensors (aliased)."""

    def __init__(self, full: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in full.items():
            self.register_parameter(name, nn.Parameter(t))


def full_values(spec: ModelSpec) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in Params(spec).named_parameters()}


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding propagation keyed by DeviceMesh, and meshes compare equal across ranks (rank
    is not part of DeviceMesh.__eq__/__hash__): left alone, rank r's `param.detach()` in state_dict() comes
    back with rank 0's mesh (coordinate (0,)) and DCP plans rank 0's chunk on every rank. One process per
    rank never shares these caches; clearing them before each rank restores that."""
    from torch.distributed.tensor import DTensor

    torch._C._clear_DTensor_sharding_propagator_cache()
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    prop._propagate_tensor_meta_cached.cache_clear()


def _check_meshes(state_dict: dict, rank: int) -> None:
    from torch.distributed.tensor import DTensor

    for fqn, v in state_dict.items():
        if isinstance(v, DTensor) and v.device_mesh.get_coordinate() != (rank,):
            raise AssertionError(f"{fqn} on rank {rank} has mesh coordinate {v.device_mesh.get_coordinate()}")


def _rank_state(full: dict[str, torch.Tensor]) -> dict:
    """What synth_dcp._save hands to dcp.save on this rank (the fake process group is initialised):
    torch's own fully_shard + AdamW + get_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    _clear_dtensor_caches()
    model = _Shared(full)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4)
    model_sd, optim_sd = get_state_dict(model, opt)  # creates AdamW's state (step, exp_avg, exp_avg_sq)
    return {"model": model_sd, "optim": optim_sd, "trainer": {"global_step": 1}}


def _expected_local(path: tuple, full: dict[str, torch.Tensor], rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s local shard of the DTensor at `path` in _rank_state's dict, as FSDP2 makes it:
    parameters are chunk `rank` of torch.chunk on dim 0 (FSDP2's `_chunk_with_empty`: empty chunks past
    the end), AdamW's moments after get_state_dict's initialising step with zero gradients are zeros."""
    if path[0] == "model":
        name = path[1]
    elif path[0] == "optim" and path[1] == "state" and path[3] in ("exp_avg", "exp_avg_sq"):
        name = path[2]
    else:
        raise KeyError(f"no rule for the DTensor at {path}")
    t = full[name]
    # torch.chunk(t, world, 0)[rank] without making all W pieces (O(W) per rank, O(W^2) in all): pieces of
    # ceil(n / W) rows, the last shorter, none past the end. Past the end _chunk_with_empty pads with 1-D
    # empties, but FSDP2's shard is padded[:0] of the rank-0-sized padded shard (fsdp_param.py
    # _init_sharded_param), so an empty shard keeps the trailing dims: (0, *rest).
    n = t.shape[0]
    size = -(-n // world)
    start = min(rank * size, n)
    chunk = t.narrow(0, start, max(0, min(size, n - start)))
    return chunk.clone() if path[0] == "model" else torch.zeros(chunk.shape, dtype=chunk.dtype)


def _walk(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, (*path, k))
    else:
        yield path, obj


def _map_dtensors(obj, fn, path=()):
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: _map_dtensors(v, fn, (*path, k)) for k, v in obj.items()}
    return fn(path, obj) if isinstance(obj, DTensor) else obj


def _template_check(template: dict, full: dict[str, torch.Tensor], world: int) -> None:
    """Rank 0's state dict made by torch must hold exactly what _expected_local says for rank 0."""
    from torch.distributed.tensor import DTensor

    for path, v in _walk(template):
        if isinstance(v, DTensor):
            mine, torchs = _expected_local(path, full, 0, world), v.to_local()
            if (mine.shape != torchs.shape or mine.stride() != torchs.stride() or mine.dtype != torchs.dtype
                    or not torch.equal(mine.view(torch.uint8) if mine.numel() else mine,
                                       torchs.contiguous().view(torch.uint8) if torchs.numel() else torchs)
                    or mine.requires_grad != torchs.requires_grad):
                raise AssertionError(f"rank 0's {path} from torch differs from the rule")


def _fast_rank_state(template: dict, full: dict[str, torch.Tensor], rank: int, world: int) -> dict:
    """Rank `rank`'s state dict: rank 0's (torch-made) with every DTensor replaced by this rank's shard on
    this rank's mesh (the mesh fully_shard's default makes: init_device_mesh over the W-rank world)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))

    def shard(path: tuple, t: DTensor) -> DTensor:
        return DTensor.from_local(_expected_local(path, full, rank, world), mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())

    return _map_dtensors(template, shard)


def generate(out: str | os.PathLike[str], world: int, spec: ModelSpec, fsync: bool = False,
             log: bool = True, exact: bool = False) -> dict[str, float]:
    """Write the checkpoint into `out`. `exact`: run torch's fully_shard + get_state_dict on every rank
    (about 0.5 s a rank: DTensor sharding propagation for AdamW's step, uncached); by default only on
    rank 0, the other ranks' state dicts being rank 0's with each DTensor's shard replaced
    (DTensor.from_local on the rank's mesh; a few ms a rank). Both are checked against each other by
    tests/benchmarks/test_synth_dcp_world.py."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.simplefilter("ignore")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    full = full_values(spec)
    times["values"] = time.perf_counter() - t0

    # pass 1: every rank's local step (dcp.save's local_step), one rank at a time
    t0 = time.perf_counter()
    planners, writers, plans = [], [], []
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            if exact or rank == 0:
                state = _rank_state(full)
                if rank == 0:
                    template = state
                    _template_check(template, full, world)
            else:
                _clear_dtensor_caches()
                state = _fast_rank_state(template, full, rank, world)
            state_dict = _stateful_to_state_dict(state)
            writer = FileSystemWriter(out, sync_files=fsync)  # what dcp.save(checkpoint_id=out) makes
            planner = DefaultSavePlanner()
            planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(),
                                   is_coordinator=rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            _check_meshes(planner.state_dict, rank)
            plan = writer.prepare_local_plan(planner.create_local_plan())
        finally:
            dist.destroy_process_group()
        planners.append(planner)
        writers.append(writer if rank == 0 else None)
        plans.append(_wire(plan))  # gather_object to rank 0
        del state_dict, state
        if log and (rank % 256 == 255 or rank == world - 1):
            print(f"  planned {rank + 1}/{world}  {time.perf_counter() - t0:.1f} s", flush=True)
    times["plan"] = time.perf_counter() - t0
    del full, template
    gc.collect()

    # rank 0: dcp.save's global_step (dedup across ranks, global metadata, __{r}_ prefixes)
    t0 = time.perf_counter()
    central, metadata = planners[0].create_global_plan(plans)
    central = writers[0].prepare_global_plan(central)
    del plans
    times["global"] = time.perf_counter() - t0

    # pass 2: every rank's write_data, then rank 0's finish
    t0 = time.perf_counter()
    results = []
    for rank in range(world):
        planner = planners[rank]
        final = planner.finish_plan(_wire(central[rank]))  # scatter_object_list from rank 0
        writer = writers[0] if rank == 0 else FileSystemWriter(out, sync_files=fsync)
        if rank:
            writer.set_up_storage_writer(False, rank=rank, use_collectives=True)
        fut = writer.write_data(final, planner)
        fut.wait()
        results.append(_wire(fut.value()))  # gather_object to rank 0
        planners[rank] = None  # the rank's shards can go
        if log and (rank % 256 == 255 or rank == world - 1):
            print(f"  wrote {rank + 1}/{world}  {time.perf_counter() - t0:.1f} s", flush=True)
    writers[0].finish(metadata=metadata, results=results)
    times["write"] = time.perf_counter() - t0
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("world", type=int)
    ap.add_argument("d_model", type=int, nargs="?", default=320)
    ap.add_argument("layers", type=int, nargs="?", default=1)
    ap.add_argument("vocab", type=int, nargs="?", default=50304)
    ap.add_argument("--fsync", action="store_true", help="fsync every file as torch's default writer does")
    ap.add_argument("--exact", action="store_true", help="torch's fully_shard + get_state_dict on every rank")
    args = ap.parse_args()
    t0 = time.perf_counter()
    times = generate(args.out, args.world, ModelSpec(args.d_model, args.layers, args.vocab), fsync=args.fsync,
                     exact=args.exact)
    size = sum(p.stat().st_size for p in Path(args.out).iterdir())
    print(f"W={args.world}: {len(list(Path(args.out).glob('*.distcp')))} .distcp, {size / 1e6:.1f} MB, "
          f"{time.perf_counter() - t0:.1f} s ({', '.join(f'{k} {v:.1f} s' for k, v in times.items())})")


if __name__ == "__main__":
    main()
