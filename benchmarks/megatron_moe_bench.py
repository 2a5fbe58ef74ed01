"""DeepSeek-V3's structure as Megatron-Core saves it, at a tiny width: shardstore's plan, ingest and export
of a torch_dist checkpoint with thousands of .distcp files and well over 100,000 shards (issue 54).

    python benchmarks/megatron_moe_bench.py --megatron-python PY [--out benchmarks/out] [--repeat 3] [--s3]
    python benchmarks/megatron_moe_bench.py --megatron-python PY --real-size [--repeat 3]
    PY benchmarks/megatron_moe_bench.py --check [--out DIR]

The checkpoint (made once, cached under --out/ckpt) has DeepSeek-V3's tensors: 61 layers, the first 3
dense (`moe_layer_freq` a list, so megatron-core keys every layer on its own, `non_homogeneous_layers`),
256 routed experts and 1 shared expert in each MoE layer, multi-latent attention (q_lora_rank,
kv_lora_rank, the rope/nope split, q and kv layernorms), a sigmoid router with its fp32 expert_bias, one
multi-token-prediction layer; megatron-core's local (non-Transformer-Engine) layer spec, bf16 weights
(Megatron-LM's --bf16). It is saved as TP 2 x PP 16 x EP 64 (ETP 2, so EP = DP = 64, 2048 ranks;
the pipeline split 3 + 14 x 4 + 2 layers: `num_layers_in_first/last_pipeline_stage`) would save it with
megatron-core 0.19.2's `dist_checkpointing.save` as Megatron-LM's save_checkpoint calls it: a
`__{rank}_0.distcp` file for every rank that holds a main replica, `.metadata`, `metadata.json`, the common
state (Megatron-LM's args among it) in rank 0's file. Only the width is small: hidden 64, 4 heads.

How it is written (`generate`, run by the Python PY that has megatron-core): 2048 processes are more than
this machine runs, so each rank's sharded state dict is built here, rank by rank, out of megatron-core's
own objects (`ShardedTensor.from_rank_offsets`, `ShardedObject`, `apply_swiglu_sharded_factory` for the
gate/up halves of every fc1), with the keys, offsets and replica ids megatron-core's modules give them
(`rank_state`); and megatron-core's own save path turns them into files: `save_preprocess`, the
`common_state` object, `_replace_state_dict_keys_with_sharded_keys`, `mcore_to_pyt_state_dict`,
`MCoreSavePlanner` and `FileSystemWriterAsync` (each rank's local plan, its decentralized global plan, its
file written by the writer's own write function), then the coordinator's `create_global_plan` over all
ranks' local plans and the writer's `finish` (.metadata), what `save_state_dict_async_plan` and
`save_state_dict_async_finalize` do with the collectives taken out. Nothing of the DCP format is written
by hand.

`--check` (run by PY) proves the generator against megatron-core itself: it builds the same model at a
small size (4 layers, 1 dense, 8 experts, TP 2 x PP 2 x EP 2: 8 gloo processes on the CPU, GPTModel from
megatron-core's own decoder and MTP block specs) and saves it with `dist_checkpointing.save`, generates
the same small model, and requires the two to have the same per-rank sharded tensors (key, global shape,
offset, local shape, replica id, dtype), the same `.metadata` (every key's global shape and dtype, every
chunk's offsets and sizes, and the file and byte range of every item) and the same files with the same
sizes.

The benchmark times (page cache dropped, peak RSS summed over all processes, best of --repeat, the load
average noted): `shardstore unshard SRC OUT` (safetensors) and `--format hf` (when shardstore's Megatron
mapping knows DeepseekV3ForCausalLM), shardstore's own phases (plan alone as `--dry-run`, the one-pass
ingest and export from the phase line it prints, `ingest` and `export` through a store), and with `--s3`
(10 to 15 minutes more) requests per file as S3 would count them: the GETs and HEADs shardstore
makes of the checkpoint's files, as a local S3 API server (moto, bench.py's) answers them to
`unshard s3://...`, counted from its access log. Last, its `--format hf` output is compared, tensor by
tensor and bit for bit, with what torch's DCP loading of the whole checkpoint plus the same Hugging Face
mapping writes (megatron_moe_dcp_to_hf.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ITERATION = 10

# DeepSeek-V3's structure (its config.json: 61 layers, first_k_dense_replace 3, n_routed_experts 256,
# n_shared_experts 1, num_experts_per_tok 8, n_group 8, topk_group 4, routed_scaling_factor 2.5,
# num_nextn_predict_layers 1), a tiny width; and the small model the generator is checked with
WIDTH = {"hidden": 64, "heads": 4, "q_lora": 48, "kv_lora": 32, "qk_head": 16, "rope": 8, "v_head": 16,
         "ffn": 144, "moe_ffn": 16, "vocab": 1024}
DSV3 = {"name": "dsv3-tp2-pp16-ep64", "layers": 61, "dense": 3, "experts": 256, "topk": 8, "groups": 8,
        "group_topk": 4, "tp": 2, "pp": 16, "ep": 64, "first": 3, "last": 2, **WIDTH}
# the real-size comparison (--real-size): DeepSeek-V3's blocks at a width that makes a 5.3 GB checkpoint
# (2.6 B parameters, bf16), 1 dense + 5 MoE layers + the MTP layer, 64 experts, saved at TP 2 x EP 4
MOE_5G = {"name": "moe5g-tp2-ep4", "layers": 6, "dense": 1, "experts": 64, "topk": 8, "groups": 8, "group_topk": 4,
          "tp": 2, "pp": 1, "ep": 4, "first": None, "last": None, "hidden": 2048, "heads": 16, "q_lora": 512,
          "kv_lora": 256, "qk_head": 64, "rope": 32, "v_head": 64, "ffn": 5632, "moe_ffn": 1024, "vocab": 32768}
SMALL = {"name": "small-tp2-pp2-ep2", "layers": 4, "dense": 1, "experts": 8, "topk": 4, "groups": 4,
         "group_topk": 2, "tp": 2, "pp": 2, "ep": 2, "first": 1, "last": 3, **WIDTH}


# ---------------------------------------------------------------------------------------------------------
# The model as megatron-core configures it (both the generator and --check's real save use these)

def config(spec: dict[str, Any]) -> Any:
    """megatron-core's TransformerConfig of `spec`: what the real save builds its GPTModel with, and where
    the generator takes each pipeline stage's layers from (megatron-core's own offset functions)."""
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
        ffn_hidden_size=spec["ffn"], q_lora_rank=spec["q_lora"], kv_lora_rank=spec["kv_lora"],
        qk_head_dim=spec["qk_head"], qk_pos_emb_head_dim=spec["rope"], v_head_dim=spec["v_head"],
        rope_type="yarn", normalization="RMSNorm", qk_layernorm=True, use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        num_moe_experts=spec["experts"], moe_ffn_hidden_size=spec["moe_ffn"],
        moe_shared_expert_intermediate_size=spec["moe_ffn"], moe_layer_freq=_pattern(spec),
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=spec["topk"],
        moe_router_num_groups=spec["groups"], moe_router_group_topk=spec["group_topk"],
        moe_router_topk_scaling_factor=2.5, moe_router_pre_softmax=True, moe_router_dtype="fp32",
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, mtp_num_layers=1,
        tensor_model_parallel_size=spec["tp"], expert_model_parallel_size=spec["ep"],
        expert_tensor_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"],
        num_layers_in_first_pipeline_stage=spec["first"], num_layers_in_last_pipeline_stage=spec["last"],
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


def _pattern(spec: dict[str, Any]) -> list[int]:
    """DeepSeek-V3's first_k_dense_replace as Megatron-LM takes it: `--moe-layer-freq` as a list."""
    return [0] * spec["dense"] + [1] * (spec["layers"] - spec["dense"])


def megatron_args(spec: dict[str, Any]) -> Any:
    """Megatron-LM's arguments for this model (saved in the common state, as save_checkpoint does)."""
    import argparse as ap

    import torch

    return ap.Namespace(
        num_layers=spec["layers"], hidden_size=spec["hidden"], ffn_hidden_size=spec["ffn"],
        num_attention_heads=spec["heads"], group_query_attention=False, num_query_groups=spec["heads"],
        kv_channels=spec["qk_head"], multi_latent_attention=True, q_lora_rank=spec["q_lora"],
        kv_lora_rank=spec["kv_lora"], qk_head_dim=spec["qk_head"], qk_pos_emb_head_dim=spec["rope"],
        v_head_dim=spec["v_head"], qk_layernorm=True, rotary_scaling_factor=40.0, rope_type="yarn",
        mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096,
        max_position_embeddings=4096, seq_length=4096, position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=True, padded_vocab_size=spec["vocab"],
        make_vocab_size_divisible_by=128, num_experts=spec["experts"], moe_ffn_hidden_size=spec["moe_ffn"],
        moe_shared_expert_intermediate_size=spec["moe_ffn"], moe_shared_expert_gate=False,
        moe_layer_freq=_pattern(spec), moe_router_topk=spec["topk"], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_pre_softmax=True, moe_router_num_groups=spec["groups"],
        moe_router_group_topk=spec["group_topk"], moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
        moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall", mtp_num_layers=1,
        tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"],
        expert_model_parallel_size=spec["ep"], expert_tensor_parallel_size=spec["tp"],
        decoder_first_pipeline_num_layers=spec["first"], decoder_last_pipeline_num_layers=spec["last"],
        ckpt_format="torch_dist", fp16=False, bf16=True, params_dtype=torch.bfloat16, iteration=ITERATION)


def common_state(spec: dict[str, Any]) -> dict[str, Any]:
    """What Megatron-LM's save_checkpoint saves beside the model (generate_state_dict), without the optimizer."""
    return {"args": megatron_args(spec), "checkpoint_version": 3.0, "iteration": ITERATION,
            "num_floating_point_operations_so_far": 0}


# ---------------------------------------------------------------------------------------------------------
# The generator: each rank's sharded state dict, as megatron-core's modules make it

def rank_state(spec: dict[str, Any], cfg: Any, rank: int) -> dict[str, Any]:
    """Rank `rank`'s model sharded state dict (megatron-core's local spec, `non_homogeneous_layers`), in
    the order its modules list it. Megatron's rank order is tp-cp-ep-dp-pp; with ETP = TP and EP = DP an
    expert's tensor-parallel rank is the rank's TP rank and its expert-parallel rank its DP rank."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tp, pp, dp = spec["tp"], spec["pp"], spec["ep"]
    t, d, p = rank % tp, rank // tp % dp, rank // (tp * dp)
    make = _Maker(spec, t, d, rank)
    out: dict[str, Any] = {}
    if p == 0:
        out.update(make.column("embedding.word_embeddings.weight", spec["vocab"], spec["hidden"]))
    first = get_transformer_layer_offset(cfg, pp_rank=p)
    for i in range(first, first + get_num_layers_to_build(cfg, pp_rank=p)):
        out.update(make.layer(f"decoder.layers.{i}.", moe=_pattern(spec)[i] == 1))
    if p == pp - 1:
        out.update(make.whole("decoder.final_layernorm.weight", spec["hidden"]))
        mtp = "mtp.layers.0."
        out.update(make.whole(mtp + "enorm.weight", spec["hidden"]))
        out.update(make.whole(mtp + "hnorm.weight", spec["hidden"]))
        out.update(make.column(mtp + "eh_proj.weight", spec["hidden"], 2 * spec["hidden"], extra=True))
        out.update(make.layer(mtp + "transformer_layer.", moe=True))
        out.update(make.whole(mtp + "final_layernorm.weight", spec["hidden"]))
        out.update(make.column("output_layer.weight", spec["vocab"], spec["hidden"]))
        # the MTP stage's copy of the embedding, tied to the first stage's (multi_token_prediction.py)
        out.update(make.column("embedding.word_embeddings.weight", spec["vocab"], spec["hidden"],
                               replica=(1, 0, d), name="mtp_embedding"))
    return out


class _Maker:
    """megatron-core's ShardedTensors and ShardedObjects of one rank (TP rank `t`, DP = EP rank `d`), each
    filled with values of its own (seeded by rank and key) so a misplaced one shows."""

    def __init__(self, spec: dict[str, Any], t: int, d: int, rank: int) -> None:
        import torch

        self.spec, self.t, self.d = spec, t, d
        self.gen = torch.Generator().manual_seed(1000 + rank)

    def _data(self, *shape: int, fp32: bool = False) -> Any:
        import torch

        data = torch.randn(*shape, generator=self.gen)
        return data if fp32 else data.bfloat16()

    def _tensor(self, key: str, data: Any, *offsets: tuple[int, int, int], replica: tuple[int, ...],
                prepend: int = 0) -> Any:
        from megatron.core.dist_checkpointing import ShardedTensor

        return ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=replica, prepend_axis_num=prepend)

    def _extra(self, key: str, replica: tuple[int, ...], expert: int | None = None) -> dict[str, Any]:
        """A local linear layer's `_extra_state` (None, kept for compatibility with Transformer Engine)."""
        from megatron.core.dist_checkpointing import ShardedObject

        shape, offset = ((self.spec["experts"],), (expert,)) if expert is not None else ((1,), (0,))
        return {f"{key}._extra_state#{expert}": ShardedObject(f"{key}._extra_state", None, shape, offset, replica)}

    def whole(self, key: str, *shape: int, fp32: bool = False) -> dict[str, Any]:
        """A tensor every TP rank holds whole (norms, the router): replica (0, tp, dp)."""
        return {key: self._tensor(key, self._data(*shape, fp32=fp32), replica=(0, self.t, self.d))}

    def column(self, key: str, rows: int, cols: int, extra: bool = False, glu: bool = False,
               replica: tuple[int, ...] | None = None, name: str = "") -> dict[str, Any]:
        """A column-parallel weight (rows split over TP), its gate/up halves apart where `glu`."""
        tp = self.spec["tp"]
        sh = self._tensor(key, self._data(rows // tp, cols), (0, self.t, tp), replica=replica or (0, 0, self.d))
        out = {name or key: self._glu(sh, ()) if glu else sh}
        return {**out, **(self._extra(key[:-len(".weight")], (0, self.t, self.d)) if extra else {})}

    def row(self, key: str, rows: int, cols: int) -> dict[str, Any]:
        """A row-parallel weight (columns split over TP) and its `_extra_state`."""
        tp = self.spec["tp"]
        sh = self._tensor(key, self._data(rows, cols // tp), (1, self.t, tp), replica=(0, 0, self.d))
        return {key: sh, **self._extra(key[:-len(".weight")], (0, self.t, self.d))}

    @staticmethod
    def _glu(sh: Any, offsets: tuple[tuple[int, int, int], ...]) -> Any:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        return apply_swiglu_sharded_factory(sh, offsets)

    def layer(self, pre: str, moe: bool) -> dict[str, Any]:
        """A TransformerLayer of MLA attention and a dense or MoE MLP, megatron-core's local spec."""
        s = self.spec
        h, heads, att = s["hidden"], s["heads"], pre + "self_attention."
        out = self.whole(pre + "input_layernorm.weight", h)
        out.update(self.row(att + "linear_proj.weight", h, heads * s["v_head"]))
        out.update(self.column(att + "linear_q_down_proj.weight", s["q_lora"], h, extra=True))
        out.update(self.column(att + "linear_q_up_proj.weight", heads * (s["qk_head"] + s["rope"]), s["q_lora"],
                               extra=True))
        out.update(self.column(att + "linear_kv_down_proj.weight", s["kv_lora"] + s["rope"], h, extra=True))
        out.update(self.column(att + "linear_kv_up_proj.weight", heads * (s["qk_head"] + s["v_head"]), s["kv_lora"],
                               extra=True))
        out.update(self.whole(att + "q_layernorm.weight", s["q_lora"]))
        out.update(self.whole(att + "kv_layernorm.weight", s["kv_lora"]))
        out.update(self.whole(pre + "pre_mlp_layernorm.weight", h))
        if not moe:
            out.update(self.column(pre + "mlp.linear_fc1.weight", 2 * s["ffn"], h, extra=True, glu=True))
            out.update(self.row(pre + "mlp.linear_fc2.weight", h, s["ffn"]))
            return out
        out.update(self.whole(pre + "mlp.router.weight", s["experts"], h))
        out.update(self.whole(pre + "mlp.router.expert_bias", s["experts"], fp32=True))
        out.update(self.experts(pre + "mlp.experts.experts."))
        out.update(self.column(pre + "mlp.shared_experts.linear_fc1.weight", 2 * s["moe_ffn"], h, extra=True,
                               glu=True))
        out.update(self.row(pre + "mlp.shared_experts.linear_fc2.weight", h, s["moe_ffn"]))
        return out

    def experts(self, pre: str) -> dict[str, Any]:
        """This rank's routed experts (SequentialMLP: E / EP of them, each an MLP under the expert axis),
        replica (0, 0, expert-DP rank 0): EP = DP leaves no expert replicas."""
        s, tp = self.spec, self.spec["tp"]
        n, h, f = s["experts"] // s["ep"], s["hidden"], s["moe_ffn"]
        out: dict[str, Any] = {}
        for e in range(self.d * n, (self.d + 1) * n):
            axis = (0, e, s["experts"])
            fc1 = self._tensor(pre + "linear_fc1.weight", self._data(2 * f // tp, h), axis, (1, self.t, tp),
                               replica=(0, 0, 0), prepend=1)
            out[f"{pre}{e}.linear_fc1.weight"] = self._glu(fc1, (axis,))
            out.update(self._extra(pre + "linear_fc1", (0, self.t, 0), expert=e))
            out[f"{pre}{e}.linear_fc2.weight"] = self._tensor(pre + "linear_fc2.weight", self._data(h, f // tp), axis,
                                                              (2, self.t, tp), replica=(0, 0, 0), prepend=1)
            out.update(self._extra(pre + "linear_fc2", (0, self.t, 0), expert=e))
        return out


def _rank_plan(spec: dict[str, Any], folder: str, rank: int, write: bool) -> tuple[Any, Any]:
    """Rank `rank`'s part of megatron-core's save (serialization.save, TorchDistSaveShardedStrategy and
    state_dict_saver, without their collectives): its local plan, and (if `write`) its file written by
    megatron-core's FileSystemWriterAsync and the write results."""
    import queue

    import torch
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner,
                                                                   _replace_state_dict_keys_with_sharded_keys,
                                                                   mcore_to_pyt_state_dict)

    _fake_world(spec, rank)
    filesystem_async.get_write_results_queue = lambda *a, **k: queue.Queue()  # the async caller's, in-process
    state = {**common_state(spec), "model": rank_state(spec, _CONFIG[0], rank)}
    sharded, common = save_preprocess(state, validate_access_integrity=False)
    sharded["common_state"] = ShardedObject("common_state", common, (1,), (0,), replica_id=rank)
    sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, True)
    pyt = mcore_to_pyt_state_dict(sharded, False)
    writer = FileSystemWriterAsync(folder, separation_hint=None, thread_count=1, use_msc=False)
    planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False,
                               flatten_sharded_tensors=False)
    planner.set_up_planner(pyt, is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0)
    local = writer.prepare_local_plan(planner.create_local_plan())
    if not write:
        return local, (planner, writer)
    central = planner.finish_plan(writer.prepare_decentralized_global_plan(planner.create_decentralized_global_plan(local)))
    writer.prepare_write_data(central, planner)
    save, _, args = writer.get_save_function_and_args()
    if save:
        save(*args)
    return local, writer.retrieve_write_results()


_CONFIG: list[Any] = [None]


def _check_each_layout_once() -> None:
    """torch checks that the shards of every ShardedTensor megatron-core hands it do not overlap, on every
    rank, pairwise: 2 x 768 shards of an expert key each time, 5 s a rank here (2048 ranks: 3 hours). A
    layout is the same list on every rank, so the same check is kept here once per distinct list of
    (offsets, sizes); what it accepts and refuses is unchanged."""
    from torch.distributed._shard.sharded_tensor import api as sharded_tensor_api
    from torch.distributed._shard.sharding_spec import api as sharding_spec_api

    check, seen = sharding_spec_api.validate_non_overlapping_shards_metadata, set()

    def once(shards: list[Any]) -> None:
        layout = tuple((tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in shards)
        if layout not in seen:
            check(shards)
            seen.add(layout)

    sharding_spec_api.validate_non_overlapping_shards_metadata = once
    sharded_tensor_api.validate_non_overlapping_shards_metadata = once


def _fake_world(spec: dict[str, Any], rank: int) -> None:
    """torch's fake process group (no communication) as rank `rank` of the whole world: what megatron-core
    asks torch.distributed for while it saves (the rank the writer names its file after, the world size of
    each torch ShardedTensor's placements)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec["tp"] * spec["pp"] * spec["ep"])


def _ranks(job: tuple[dict[str, Any], str, list[int]]) -> list[tuple[int, bytes, bytes]]:
    """A worker's share of the ranks, each planned and written; each rank's local plan and write results
    pickled on their own, as the coordinator's two gather_object calls receive them."""
    import pickle

    spec, folder, ranks = job
    _setup(spec)
    return [(r, *map(pickle.dumps, _rank_plan(spec, folder, r, True))) for r in ranks]


def _setup(spec: dict[str, Any]) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.megatron_core import _stub_triton

    _stub_triton()
    _check_each_layout_once()
    if _CONFIG[0] is None:
        _CONFIG[0] = config(spec)


def generate(spec: dict[str, Any], run: Path, workers: int = 2) -> Path:
    """Write `spec`'s torch_dist checkpoint as megatron-core would (module docstring) into the Megatron-LM
    run folder `run` (iter_0000010/ and latest_checkpointed_iteration.txt)."""
    import multiprocessing
    import pickle

    _setup(spec)
    folder = run / f"iter_{ITERATION:07d}"
    shutil.rmtree(run, ignore_errors=True)
    folder.mkdir(parents=True)
    world = spec["tp"] * spec["pp"] * spec["ep"]
    jobs = [(spec, str(folder), list(range(w, world, workers))) for w in range(workers)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        done = sorted(r for part in pool.map(_ranks, jobs) for r in part)
    plans, results = [pickle.loads(p) for _, p, _ in done], [pickle.loads(w) for _, _, w in done]
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from torch.distributed.checkpoint.planner import SavePlan

    assert all(isinstance(p, SavePlan) for p in plans)
    _, (planner, writer) = _rank_plan(spec, str(folder), 0, False)  # the coordinator (rank 0)
    _, metadata = planner.create_global_plan(plans)
    metadata.all_local_plans = plans  # save_state_dict_async_plan keeps them for a later save to reuse
    writer.finish(metadata, results)
    save_config(CheckpointingConfig("torch_dist", 1), str(folder))
    (run / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return run


# ---------------------------------------------------------------------------------------------------------
# --check: the generator against megatron-core's own save of the same (small) model

def _real_save(rank: int, world: int, folder: str, port: int) -> None:
    """One gloo rank of megatron-core's own save of SMALL: GPTModel from megatron-core's decoder and MTP
    block specs (local), bf16 as Megatron-LM's Float16Module leaves it, `dist_checkpointing.save`.
    Stand-ins beyond tests/fixtures/megatron_core.py's: rotary tables made where use_cpu_initialization
    does not reach (torch.arange, the yarn table's device), and DotProductAttention, the local core
    attention, taking MLA's k_channels/v_channels (it has no state; nothing here runs a forward)."""
    import pickle

    import torch

    sys.path.insert(0, str(ROOT))
    from tests.fixtures.megatron_core import _cpu_shims, _stub_triton

    _stub_triton()
    _cpu_shims()
    arange = torch.arange
    torch.arange = lambda *a, **k: arange(*a, **{**k, "device": "cpu"})  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.transformer import dot_product_attention

    init = dot_product_attention.DotProductAttention.__init__
    dot_product_attention.DotProductAttention.__init__ = (  # type: ignore[method-assign]
        lambda self, *a, k_channels=None, v_channels=None, **k: init(self, *a, **k))
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = SMALL
    ps.initialize_model_parallel(spec["tp"], spec["pp"], expert_model_parallel_size=spec["ep"],
                                 expert_tensor_parallel_size=spec["tp"])
    cfg = config(spec)
    p = ps.get_pipeline_model_parallel_rank()
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", pp_rank=p)
    model = GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=spec["vocab"], max_sequence_length=64,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, block, use_transformer_engine=False, pp_rank=p))
    model = model.bfloat16()
    for m in model.modules():  # the router keeps its expert bias in fp32 (router.py), as Float16Module's does
        if hasattr(m, "_maintain_float32_expert_bias"):
            m._maintain_float32_expert_bias()
    sharded = model.sharded_state_dict()
    with open(f"{folder}.real{rank}.pkl", "wb") as f:
        pickle.dump(_rows(sharded), f)
    dist_checkpointing.save({**common_state(spec), "model": sharded}, folder)
    dist.barrier()
    dist.destroy_process_group()


def _rows(sharded: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Each ShardedTensor / ShardedObject of a sharded state dict (factories built), in order."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    rows = []
    for value in nested_values(sharded):
        for t in nested_values(value.build()) if isinstance(value, ShardedTensorFactory) else [value]:
            rows.append((type(t).__name__, t.key, tuple(t.global_shape), tuple(t.global_offset),
                         tuple(getattr(t, "local_shape", ()) or ()), t.replica_id, str(getattr(t, "dtype", ""))))
    return rows


def _metadata_view(folder: Path) -> dict[str, Any]:
    """A .metadata's content, without its save's random id: every key's type, shape, dtype and chunks, and
    every item's file and byte range."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(folder)).read_metadata()
    keys = {}
    for key, meta in md.state_dict_metadata.items():
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(meta, "chunks", []))
        keys[key] = (type(meta).__name__, tuple(getattr(meta, "size", ())),
                     str(getattr(getattr(meta, "properties", None), "dtype", "")), chunks)
    items = sorted((index.fqn, tuple(index.offset or ()), info.relative_path, info.offset, info.length)
                   for index, info in md.storage_data.items())
    plans = [sorted((i.index.fqn, tuple(i.index.offset or ())) for i in plan.items) for plan in md.all_local_plans]
    return {"keys": keys, "items": items, "plans": plans}


def check(out: Path) -> None:
    """--check (module docstring): the generator's SMALL checkpoint against megatron-core's own."""
    import multiprocessing
    import pickle

    # paths of one length: the .metadata names its folder
    real, made = out / "check-real" / f"iter_{ITERATION:07d}", out / "check-made"
    shutil.rmtree(real.parent, ignore_errors=True)
    real.mkdir(parents=True)
    world = SMALL["tp"] * SMALL["pp"] * SMALL["ep"]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_real_save, args=(r, world, str(real), 29741)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0, proc.exitcode
    generate(SMALL, made)
    folder = made / f"iter_{ITERATION:07d}"
    _setup(SMALL)
    for rank in range(world):
        with open(f"{real}.real{rank}.pkl", "rb") as f:
            want = pickle.load(f)
        got = _rows(rank_state(SMALL, _CONFIG[0], rank))
        assert got == want, f"rank {rank}: " + str(next((g, w) for g, w in zip(got, want) if g != w)
                                                    if len(got) == len(want) else (len(got), len(want)))
        Path(f"{real}.real{rank}.pkl").unlink()
    a, b = _metadata_view(real), _metadata_view(folder)
    assert a["keys"] == b["keys"], sorted(set(a["keys"].items()) ^ set(b["keys"].items()))[:4]
    assert a["items"] == b["items"], sorted(set(a["items"]) ^ set(b["items"]))[:4]
    assert a["plans"] == b["plans"]
    files = {p.name: p.stat().st_size for p in real.iterdir()}
    made_files = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert files == made_files, (files, made_files)
    print(f"check: the generator's {SMALL['name']} equals megatron-core 0.19.2's own save: {len(want)} sharded "
          f"objects on the last rank, {len(a['keys'])} keys, {len(a['items'])} items in {len(files) - 2} .distcp "
          f"files, each file the same size")
    shutil.rmtree(real.parent)
    shutil.rmtree(made)


def bench_real(run: Path, out: Path, repeat: int) -> None:
    """--real-size: MOE_5G against torch's DCP loading + the same Hugging Face mapping in one process
    (benchmarks/megatron_moe_dcp_to_hf.py), and against a copy + `sync` of the model's bytes (their byte
    ranges in the .distcp files, by .metadata: megatron_bench.py's floor); each round runs every contender
    once, page cache dropped, the rounds `repeat` times; the tool's output is checked equal to shardstore's,
    tensor by tensor, bit for bit, once. Prints a markdown table; writes megatron_moe_5g.json to `out`."""
    from bench import compare, compile_shardstore
    from megatron_bench import COPY_MODEL

    compile_shardstore()
    folder = run / f"iter_{ITERATION:07d}"
    shape = _shape(folder)
    work = out / "moe5g-work"
    runs = {"copy + `sync` of the model's bytes (the floor)": [sys.executable, "-c", COPY_MODEL, str(folder),
                                                               str(work / "model.bin")],
            "torch DCP load + HF DeepseekV3 mapping, one process": [
                sys.executable, str(HERE / "megatron_moe_dcp_to_hf.py"), str(folder), str(work / "tool"),
                str(MOE_5G["layers"])],
            "shardstore `unshard --format hf`": [*SHARDSTORE, "unshard", str(run), str(work / "hf"), "--format", "hf",
                                                 "-q"]}
    rounds = []
    for _ in range(repeat):
        print(f"round (load {os.getloadavg()[0]:.1f})", flush=True)
        rounds.append(compare(runs, work))
    _same_output(run, folder, work, MOE_5G)
    names = list(runs)
    best = {n: min((r for rnd in rounds for r in rnd if r["contender"] == n), key=lambda r: r["wall"]) for n in names}
    print(f"\n{MOE_5G['name']}: {shape['bytes'] / 1e9:.2f} GB in {shape['files']} .distcp files, {shape['shards']} "
          f"shards\n\n| contender | wall (best of {repeat}) | each round | vs the model's copy | peak RSS, all processes |")
    print("|---|---:|---|---:|---:|")
    for n in names:
        walls = [r["wall"] for rnd in rounds for r in rnd if r["contender"] == n]
        print(f"| {n} | {best[n]['wall']:.2f} s | {', '.join(f'{w:.1f}' for w in walls)} | "
              f"{best[n]['wall'] / best[names[0]]['wall']:.2f}x | {best[n]['peak_rss'] / 2**20:.0f} MB |")
    for i, rnd in enumerate(rounds):
        wall = {r["contender"]: r["wall"] for r in rnd}
        print(f"round {i + 1}: shardstore {wall[names[1]] / wall[names[2]]:.2f}x faster than the tool, "
              f"{wall[names[2]] / wall[names[0]]:.2f}x the model's copy")
    (out / "megatron_moe_5g.json").write_text(json.dumps({"shape": shape, "spec": MOE_5G, "rounds": rounds}, indent=1))


def _same_output(run: Path, folder: Path, work: Path, spec: dict[str, Any]) -> None:
    """The tool's safetensors and shardstore's --format hf hold the same tensors, bit for bit."""
    import torch
    from safetensors import safe_open

    for name, cmd in {"tool": [sys.executable, str(HERE / "megatron_moe_dcp_to_hf.py"), str(folder),
                               str(work / "tool"), str(spec["layers"])],
                      "hf": [*SHARDSTORE, "unshard", str(run), str(work / "hf"), "--format", "hf", "-q"]}.items():
        subprocess.run(cmd, check=True)
    with contextlib.ExitStack() as stack:  # each file opened once: DeepSeek-V3's header holds 46,181 tensors
        ours = {}
        for path in sorted((work / "hf").glob("*.safetensors")):
            f = stack.enter_context(safe_open(str(path), "pt"))
            ours.update({k: f for k in f.keys()})
        tool = stack.enter_context(safe_open(str(work / "tool" / "model.safetensors"), "pt"))
        assert set(tool.keys()) == set(ours), sorted(set(tool.keys()) ^ set(ours))[:4]
        for key, f in ours.items():
            a, b = f.get_tensor(key), tool.get_tensor(key)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key
    shutil.rmtree(work)
    print(f"the tool's output and shardstore's --format hf: the same {len(ours)} tensors, bit for bit")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--megatron-python", default=sys.executable)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--generate", action="store_true", help="(internal) write the DeepSeek-V3 checkpoint")
    ap.add_argument("--real-size", action="store_true", help="the 5.3 GB MoE against torch's tools and the disk")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="count requests per file on S3 (moto) too")
    args = ap.parse_args()
    if args.check:
        return check(args.out)
    spec = MOE_5G if args.real_size else DSV3
    run = args.out / "ckpt" / spec["name"]
    if args.generate:
        start = time.perf_counter()
        generate(spec, run)
        print(f"generated in {time.perf_counter() - start:.0f} s")
        return
    if not (run / "latest_checkpointed_iteration.txt").exists():
        subprocess.run([args.megatron_python, __file__, "--generate", "--out", str(args.out),
                        *(["--real-size"] if args.real_size else [])], check=True)
    sys.path.insert(0, str(HERE))
    if args.real_size:
        bench_real(run, args.out, args.repeat)
    else:
        bench(run, args.out, args.repeat, args.s3)


# ---------------------------------------------------------------------------------------------------------
# The benchmark

SHARDSTORE = [sys.executable, "-m", "shardstore"]


def _tree_pss(root: int) -> int:
    """Proportional set size of `root` and its children (/proc/PID/smaps_rollup): a page shared by a forked
    worker and its parent counted once, where RSS summed counts it in each."""
    total = 0
    for pid in [root, *map(int, Path(f"/proc/{root}/task/{root}/children").read_text().split())]:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total += next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")) * 1024
    return total


def _timed(cmd: list[str]) -> tuple[float, int, str, float, int]:
    """(wall s, peak RSS of all its processes, stderr, the 1-minute load average when it started, peak PSS)
    of `cmd`, page cache dropped first (bench.py's timed_tree, keeping the phase lines shardstore prints)."""
    from bench import _tree_rss, drop_caches

    drop_caches()
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with open(os.devnull, "w") as null, subprocess.Popen(cmd, stdout=null, stderr=subprocess.PIPE, text=True) as proc:
        peak = pss = 0
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            try:
                pss = max(pss, _tree_pss(proc.pid))
            except OSError:  # it ended between the two looks
                pass
            time.sleep(0.02)
        wall = time.perf_counter() - start
        err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[2:5])} failed: {err[-400:]}")
    return wall, peak, err, load, pss


def _phases(err: str) -> dict[str, float]:
    """shardstore's own phase lines ('ingest: 12.3 MiB in 4.5 s')."""
    import re

    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w[\w ]*): [\d.]+ \w+ in ([\d.]+) s", err, re.M)}


def _best(name: str, cmd: list[str], work: Path, repeat: int) -> dict[str, Any]:
    """The fastest of `repeat` cold runs of `cmd` (its output removed before each), with the load average
    each started under."""
    runs = []
    for _ in range(repeat):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        wall, rss, err, load, pss = _timed(cmd)
        runs.append({"wall": wall, "peak_rss": rss, "peak_pss": pss, "phases": _phases(err), "load": load})
        print(f"  {name}: {wall:.2f} s, {rss / 2**20:.0f} MB (PSS {pss / 2**20:.0f} MB), phases {runs[-1]['phases']}, "
              f"load {load:.1f}", flush=True)
    best = min(runs, key=lambda r: r["wall"])
    return {"contender": name, **best, "walls": [r["wall"] for r in runs], "loads": [r["load"] for r in runs]}


def _shape(folder: Path) -> dict[str, Any]:
    """The checkpoint's files, bytes, keys and shards (chunks and byte items of its .metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(folder)).read_metadata()
    files = sorted(folder.glob("*.distcp"))
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "metadata_bytes": (folder / ".metadata").stat().st_size, "keys": len(md.state_dict_metadata),
            "shards": len(md.storage_data), "model_keys": sum(k != "common_state" for k in md.state_dict_metadata)}


def s3_requests(run: Path, work: Path, fmt: str) -> dict[str, Any]:
    """`shardstore unshard s3://... OUT` with the checkpoint on a local S3 API server (moto, bench.py's
    way), the requests the server answered, by method and per .distcp file."""
    import collections
    import socket

    from bench import _requests

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "moto.log", "w+")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=log)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    try:
        time.sleep(2)
        upload = ("import s3fs, sys; fs = s3fs.S3FileSystem(); fs.mkdir('bench'); "
                  "fs.put(sys.argv[1], 'bench/ckpt', recursive=True)")
        subprocess.run([sys.executable, "-c", upload, str(run)], check=True, env=env)
        log.flush()
        before = len(_requests(log))
        start = time.perf_counter()
        subprocess.run([*SHARDSTORE, "unshard", "s3://bench/ckpt", str(work / "out"), "--format", fmt, "-q"],
                       check=True, env=env)
        wall = time.perf_counter() - start
        log.flush()
        counts = collections.Counter(method for method, _ in _requests(log)[before:])
    finally:
        server.terminate()
        server.wait()
        log.close()
    files = len(list((run / f"iter_{ITERATION:07d}").glob("*.distcp")))
    return {"format": fmt, "wall": wall, "requests": dict(counts), "per_file": sum(counts.values()) / files}


def bench(run: Path, out: Path, repeat: int, s3_too: bool) -> None:
    """Times shardstore on the DeepSeek-V3-structure checkpoint (module docstring); prints a markdown table
    and writes megatron_moe.json to `out`."""
    from bench import compile_shardstore

    compile_shardstore()  # as pip leaves an installed package
    folder = run / f"iter_{ITERATION:07d}"
    shape = _shape(folder)
    print(f"{DSV3['name']}: {shape['files']} .distcp files, {shape['bytes'] / 1e6:.0f} MB, {shape['keys']} keys, "
          f"{shape['shards']} shards; .metadata {shape['metadata_bytes'] / 1e6:.1f} MB", flush=True)
    work = out / "moe-work"
    runs = {"plan (`unshard --dry-run`)": ["--dry-run"], "unshard safetensors": [],
            "unshard --format hf": ["--format", "hf"]}
    results = [_best(name, [*SHARDSTORE, "unshard", str(run), str(work / "out"), *extra], work, repeat)
               for name, extra in runs.items()]
    ingest = [*SHARDSTORE, "ingest", str(work / "store"), *map(str, sorted(folder.glob("*.distcp"))), "-q"]
    results.append(_best("ingest (into a store)", ingest, work, 1))
    export = [*SHARDSTORE, "export", str(work / "store"), str(work / "st"), "-q"]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    from bench import timed_tree

    subprocess.run(ingest, check=True)
    wall, rss = timed_tree(export)
    results.append({"contender": "export safetensors (from that store)", "wall": wall, "peak_rss": rss,
                    "peak_pss": 0, "phases": {}, "walls": [wall], "loads": [os.getloadavg()[0]]})
    shutil.rmtree(work, ignore_errors=True)
    # --format hf reads the same items (14 min a run on moto)
    s3 = [s3_requests(run, work / "s3", "safetensors")] if s3_too else []
    shutil.rmtree(work, ignore_errors=True)
    _same_output(run, folder, work, DSV3)
    print("\n| contender | wall (best of runs) | runs | peak RSS, all processes | peak PSS | load average at its "
          "start | phases |")
    print("|---|---:|---|---:|---:|---|---|")
    for r in results:
        print(f"| {r['contender']} | {r['wall']:.2f} s | {', '.join(f'{w:.1f}' for w in r['walls'])} | "
              f"{r['peak_rss'] / 2**20:.0f} MB | {r['peak_pss'] / 2**20:.0f} MB | "
              f"{', '.join(f'{x:.1f}' for x in r['loads'])} | "
              f"{', '.join(f'{k} {v:.1f} s' for k, v in r['phases'].items())} |")
    for r in s3:
        print(f"S3 (moto), unshard --format {r['format']}: {r['per_file']:.2f} requests per .distcp file "
              f"({', '.join(f'{n} {m}' for m, n in sorted(r['requests'].items()))}), {r['wall']:.1f} s")
    (out / "megatron_moe.json").write_text(json.dumps({"shape": shape, "spec": DSV3, "results": results, "s3": s3},
                                                      indent=1))


if __name__ == "__main__":
    main()
