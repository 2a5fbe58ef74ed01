"""`--format megatron`: a Hugging Face model (or any checkpoint `--format hf` maps onto one) as the
Megatron-Core `torch_dist` checkpoint megatron-core's `dist_checkpointing.load` reads at any tensor,
pipeline and expert parallel layout, in a Megatron-LM run folder:

    OUT/latest_checkpointed_iteration.txt    "release", written last
    OUT/release/__{i}_0.distcp               the tensors, each chunk a run of rows of one source tensor
    OUT/release/.metadata                    written after them: the folder is a checkpoint only once whole
    OUT/release/metadata.json                {"sharded_backend": "torch_dist", ...}, as megatron-core writes it

Each Megatron tensor is written under the key megatron-core saves it under whatever its layout (layers
stacked on a leading axis, SequentialMLP's experts on the next: megatron_inverse.stacked), as chunks that
are the transformers tensors' own rows where they land (megatron_inverse.placements): q, k and v of each
query group, gate and up, whole tensors elsewhere. So nothing is rearranged in memory: each chunk is one
range of one source file's bytes, copied kernel-side, and DCP's reader (megatron's is DCP's) assembles
whatever slice a rank asks for. The vocabulary's padding rows are zeros. Beside the tensors go what
megatron-core saves with a GPTModel's: each module's `_extra_state` per layer (`[None]`: no FP8
metadata), and the common state (`common_state`: Megatron-LM's `args` for the model, `checkpoint_version`
3.0, `iteration` 0) that Megatron-LM's `load_checkpoint` reads.

The keys are those of the layer spec the loading job builds (`--transformer-impl`, Megatron-LM's): a model
loads only the keys its spec saves, and the two specs differ where a norm is a module under one and fused
into a linear layer under the other (megatron_inverse.TRANSFORMER_ENGINE), and in which modules keep an
`_extra_state` (`_with_extra_state`).
"""

from __future__ import annotations

import itertools
import json
from argparse import Namespace
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from .. import tempfiles
from ..errors import ExportError
from ..ranges import BLOCK, Part
from ..records import TorchDType
from ..sink.output import OutputFile
from ..store.store import Store
from ..tree import Node
from . import chunks, dcp, hf
from .contract import ExportRequest, OutputFormat, Planned, Progress, Written
from .hf import gpt_oss
from .hf.spec import HFModel
from .hf.megatron_inverse import (TRANSFORMER_ENGINE, Placed, architecture, layers_stacked, mtp_copies, padded_vocab,
                                  placements, stacked)
from .hf.megatron import MOE_BLOCKS
from .hf.megatron_llama import (DEEPSEEK_V3, GPT_OSS, QWEN2_MOE, QWEN3, QWEN3_MOE, count, need, number,
                                rope_key, with_defaults)
from .resolve import ArrayRef

ITERATION_FILE = "latest_checkpointed_iteration.txt"
WHERE = "the model's config.json"
RELEASE = "release"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
# the linear layers whose `_extra_state` megatron-core saves (an MoE's experts' and shared expert's too, MLA's,
# a multi-token-prediction layer's projection)
LINEARS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight",
           "linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
           "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "eh_proj.weight")
VOCAB_MULTIPLE = 128  # Megatron-LM's make_vocab_size_divisible_by
COMMON_ITEM = "common_state/shard_0_1"  # megatron-core >= 0.19's common state, a bytes item


@dataclass(frozen=True)
class Zeros(ArrayRef):
    """A chunk of zeros (the vocabulary's padding rows): no store array behind it."""

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[Part]:
        left = self.nbytes
        while left:
            yield bytes(min(left, BLOCK))
            left -= min(left, BLOCK)

    def stored_crc(self, store: Store) -> int | None:
        return None


def plan_items(store: Store, subtree: str, request: ExportRequest
               ) -> tuple[HFModel, Placed, list[dcp.Item], dict[str, Any]]:
    """The Hugging Face model the store is (export/hf), and it placed in Megatron's names: the tensor
    chunks and the other items of the checkpoint, and what `.metadata` describes each key as."""
    model, sources, _ = chunks.model_arrays(store, subtree, request, request.dtype or "bfloat16")
    arch = architecture(model.config or {}, WHERE)
    config = with_defaults(model.config or {}, arch)
    if arch == DEEPSEEK_V3:
        model, config = _without_absent_mtp(model, config, sources)
        copies = mtp_copies(config, list(sources))
        if copies:
            sources = {k: v for k, v in sources.items() if k not in copies}
            model.notes.append(f"{', '.join(copies)}: the hub's copies of the embedding and output layer, which "
                               f"Megatron's multi-token prediction takes from the model: not written")
    multiple = request.vocab_multiple or VOCAB_MULTIPLE
    vocab_rows = padded_vocab(need(config, "vocab_size", WHERE), multiple)
    impl = request.transformer_impl or TRANSFORMER_ENGINE
    placed = placements(config, {k: it.shape for k, it in sources.items()}, WHERE, vocab_rows=vocab_rows, impl=impl)
    keys = stacked(placed.shapes, layers_stacked(config))
    index_of = {member: (key, index) for key, (_, members) in keys.items() for member, index in members.items()}
    dtypes = {p.target: sources[p.hf].dtype for p in placed.placements}
    described: dict[str, Any] = {key: ("tensor", dtypes[next(iter(members))], shape)
                                 for key, (shape, members) in keys.items()}
    items = []
    for p in placed.placements:
        source = sources[p.hf].source
        key, index = index_of[p.target]
        rest = placed.shapes[p.target][1:]
        if p.member is not None:  # a Megatron tensor stacked with others in the transformers one
            items.append(chunks.unstacked_item(key, (*index, 0) + (0,) * len(rest),
                                               (1,) * len(index) + placed.shapes[p.target], source, p.member,
                                               p.interleave, p.transpose))
            continue
        first, stop = p.rows or (0, source.shape[0])
        items.append(chunks.rows_item(key, (*index, p.at) + (0,) * len(rest), (1,) * len(index) + (stop - first, *rest),
                                      source, (p.rows,) if p.rows else None))
    for target, (first, stop) in placed.padding.items():
        key, index = index_of[target]
        rest = placed.shapes[target][1:]
        sizes = (1,) * len(index) + (stop - first, *rest)
        zeros = Zeros(target, dtypes[target], sizes)
        items.append(dcp.Item(key, ((*index, first) + (0,) * len(rest), sizes), zeros, zeros.nbytes))
    for fqn, value in _objects(config, keys, vocab_rows, multiple, impl).items():
        described[fqn] = ("bytes",)
        items.append(dcp.Item(fqn, None, value, 0))
    return model, placed, items, described


def _without_absent_mtp(model: HFModel, config: dict[str, Any], sources: dict[str, Any]
                        ) -> tuple[HFModel, dict[str, Any]]:
    """A DeepSeek-V3 model whose config counts multi-token-prediction layers its files do not hold
    (transformers' save_pretrained leaves them out): written without them, the config saying so."""
    layers, count = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers") or 0
    if not count or any(k.startswith(f"model.layers.{layers}.") for k in sources):
        return model, config
    config = {**config, "num_nextn_predict_layers": 0}
    model.notes.append(f"num_nextn_predict_layers is {count}, but the files hold no multi-token-prediction layer "
                       f"(model.layers.{layers}): written without one, and config.json says 0")
    return replace(model, config=config), config


def _objects(config: dict[str, Any], keys: dict[str, tuple[tuple[int, ...], dict[str, tuple[int, ...]]]],
             vocab_rows: int, multiple: int, impl: str) -> dict[str, dcp.Value]:
    """The objects megatron-core saves beside a GPTModel's tensors (`keys`: the tensors' keys, each with
    its global shape and members): the `_extra_state` of each module that has one (`_with_extra_state`) of
    each layer (and expert: `shard_{layer}.{expert}_{layers}.{experts}`; `shard_0_1` outside the layers),
    and the common state. Each `[None]`: no FP8 metadata, which a Transformer Engine module loads as it
    loads its own empty state."""
    out = {}
    for key, (shape, members) in keys.items():
        lead = shape[:len(next(iter(members.values())))] or (1,)
        for module in _with_extra_state(key, impl):
            for index in itertools.product(*map(range, lead)):
                shard = f"{'.'.join(map(str, index))}_{'.'.join(map(str, lead))}"
                out[f"{module}._extra_state/shard_{shard}"] = dcp.Value([None])
    out[COMMON_ITEM] = dcp.Value([{"args": megatron_args(config, vocab_rows, multiple, impl),
                                                "checkpoint_version": 3.0, "iteration": 0,
                                                "num_floating_point_operations_so_far": 0}])
    return out


def _with_extra_state(key: str, impl: str) -> list[str]:
    """The modules beside tensor `key` whose `_extra_state` megatron-core saves: a layer's linear layers;
    under Transformer Engine also every norm that is a module of its own (TE's RMSNorm, an operation
    keeping FP8 state since TE 2.0: the final norm, an MoE layer's pre-MLP norm, MLA's input norm, q and k
    norms, the MTP layers' norms) and the attention beside each output projection (TEDotProductAttention's:
    megatron-core < 0.15 asks for it, later ones for none; a model reads only what it asks for)."""
    module = key.removesuffix(".weight")
    linear = [module] if key.startswith(("decoder.layers.", "mtp.layers.")) and key.endswith(LINEARS) else []
    if impl != TRANSFORMER_ENGINE:
        return linear
    if key.endswith("norm.weight"):
        return [module]
    if key.endswith("self_attention.linear_proj.weight"):
        return linear + [f"{module.removesuffix('linear_proj')}core_attention"]
    return linear


def megatron_args(config: dict[str, Any], vocab_rows: int, multiple: int, impl: str = TRANSFORMER_ENGINE) -> Namespace:
    """Megatron-LM's arguments for the model `config` describes, as its `check_checkpoint_args` compares
    them and `export/hf/megatron.config_from_args` reads them back."""
    arch = architecture(config, WHERE)
    config = with_defaults(config, arch)
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    args = dict(num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
                ffn_hidden_size=config["intermediate_size"], num_attention_heads=heads,
                group_query_attention=groups != heads, num_query_groups=groups,
                kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
                max_position_embeddings=config.get("max_position_embeddings"),
                seq_length=config.get("max_position_embeddings"), position_embedding_type="rope",
                add_position_embedding=False, rotary_percent=1.0,
                rotary_base=rope_theta(config, gpt_oss.DEFAULT_THETA if arch == GPT_OSS else 10000.0),
                normalization="RMSNorm", norm_epsilon=config.get("rms_norm_eps", 1e-5), swiglu=True,
                add_bias_linear=False, add_qkv_bias=arch in ("Qwen2ForCausalLM", QWEN2_MOE),
                qk_layernorm=arch in (QWEN3, QWEN3_MOE),
                untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
                padded_vocab_size=vocab_rows, make_vocab_size_divisible_by=multiple, ckpt_format="torch_dist",
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, fp16=dtype == "float16",
                bf16=dtype == "bfloat16",
                params_dtype=TorchDType(dtype if dtype in ("float16", "bfloat16") else "float32"), iteration=0,
                transformer_impl=impl)
    scaling = rope_scaling(config)
    if arch == DEEPSEEK_V3:
        args.update(_deepseek_args(config, scaling))
    elif arch == GPT_OSS:
        args.update(gpt_oss.megatron_args(config, scaling, WHERE))
    elif scaling is not None:
        args.update(llama_scaling(scaling, f"{WHERE}: {rope_key(config)}"))
    if arch in MOE_BLOCKS:  # every layer's MLP sparse, routed as the class routes (megatron_llama._moe_class)
        _, experts_key, width_key, _ = MOE_BLOCKS[arch]  # (not `count`: the function of that name)
        args.update(num_experts=config[experts_key], moe_ffn_hidden_size=config[width_key],
                    moe_router_topk=topk(config, 2))
        if arch == QWEN2_MOE:
            args.update(moe_shared_expert_intermediate_size=config["shared_expert_intermediate_size"],
                        moe_shared_expert_gate=True, moe_router_pre_softmax=True)
    return Namespace(**args)


def topk(config: dict[str, Any], default: int) -> int:
    """The experts each token is routed to (`num_experts_per_tok`; the class's `default`)."""
    return count(config, "num_experts_per_tok", default, WHERE)


def rope_theta(config: dict[str, Any], default: float = 10000.0) -> float:
    """The rotary base, where either transformers writes it: `rope_theta` (< 5) or `rope_parameters` (5);
    else the class's `default`."""
    if config.get("rope_theta") is not None:
        return number(config, "rope_theta", default, WHERE)
    return number(_rope_parameters(config, "rope_parameters"), "rope_theta", default, f"{WHERE}: rope_parameters")


def rope_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    """The rotary embeddings' scaling, where either transformers writes it (`rope_scaling` < 5,
    `rope_parameters` 5), with its type under `rope_type`; None for plain rotary embeddings."""
    scaling = _rope_parameters(config, "rope_scaling") or _rope_parameters(config, "rope_parameters")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind in (None, "default") else {**scaling, "rope_type": kind}


def _rope_parameters(config: dict[str, Any], key: str) -> dict[str, Any]:
    """`config[key]`, an object ({} where absent or null), or refused naming it."""
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise ExportError(f"{WHERE}: {key} is {value!r:.40}; an object of the rotary embeddings' parameters")
    return value


# Megatron-LM's Llama 3 scaling (--use-rope-scaling) fixes all but the factor
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama_scaling(scaling: dict[str, Any], where: str) -> dict[str, Any]:
    """Megatron-LM's arguments for a Llama-family model's scaled rotary embeddings: Llama 3's
    (--use-rope-scaling --rope-scaling-factor); refused by name where Megatron-LM's GPT arguments cannot
    say it, rather than written as plain rotary embeddings."""
    fixed = {k: number(scaling, k, v, where) for k, v in LLAMA3_FIXED.items()}
    if scaling["rope_type"] != "llama3" or fixed != LLAMA3_FIXED:
        raise ExportError(f"{WHERE}: rotary embeddings scaled as {scaling!r:.160}; Megatron-LM's "
                          f"arguments say Llama 3's scaling with {LLAMA3_FIXED} and a factor only")
    return dict(use_rope_scaling=True, rope_scaling_factor=number(scaling, "factor", 8.0, where))


def _deepseek_args(config: dict[str, Any], rope: dict[str, Any] | None) -> dict[str, Any]:
    """DeepSeek-V3's arguments (its Megatron-LM scripts' flags): multi-latent attention with norms over its
    latents, YaRN (or plain) rotary embeddings, the dense layers first (moe_layer_freq), sigmoid routing with
    an expert bias, groups, scaled weights, the shared experts as one MLP, the multi-token-prediction layers;
    what export/hf/deepseek.config_from_args reads back."""
    experts, width = config["n_routed_experts"], config["moe_intermediate_size"]
    layers, dense = config["num_hidden_layers"], config["first_k_dense_replace"]
    groups, chosen = count(config, "n_group", 1, WHERE), count(config, "topk_group", 1, WHERE)
    args = dict(multi_latent_attention=True, q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
                qk_head_dim=config["qk_nope_head_dim"], qk_pos_emb_head_dim=config["qk_rope_head_dim"],
                v_head_dim=config["v_head_dim"], kv_channels=config["v_head_dim"], qk_layernorm=True,
                group_query_attention=False, num_query_groups=1, norm_epsilon=config.get("rms_norm_eps", 1e-6),
                num_experts=experts, moe_ffn_hidden_size=width, moe_router_topk=topk(config, 2),
                moe_layer_freq=[0] * dense + [1] * (layers - dense) if dense else 1,
                moe_shared_expert_intermediate_size=width * config["n_shared_experts"],
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=True,
                moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=chosen if groups > 1 else None,
                moe_router_topk_scaling_factor=number(config, "routed_scaling_factor", 1.0, WHERE),
                mtp_num_layers=config.get("num_nextn_predict_layers") or None)
    if rope is not None and rope["rope_type"] == "yarn":
        where = f"{WHERE}: {rope_key(config)}"
        args.update(rope_type="yarn", rotary_scaling_factor=number(rope, "factor", 1.0, where),
                    mscale=number(rope, "mscale", 1.0, where), mscale_all_dim=number(rope, "mscale_all_dim", 0.0, where),
                    beta_fast=number(rope, "beta_fast", 32.0, where), beta_slow=number(rope, "beta_slow", 1.0, where),
                    original_max_position_embeddings=count(rope, "original_max_position_embeddings", 4096, where))
    elif rope is None:
        args.update(rope_type="rope")
    else:
        raise ExportError(f"the model's config.json: rotary embeddings scaled as {rope['rope_type']!r:.40}; "
                          f"Megatron's multi-latent attention takes YaRN or none")
    return args


def export_megatron(store: Store, out: Path, model: HFModel, plan: dcp.DcpPlan, jobs: int,
                    progress: Progress) -> list[Path]:
    """OUT/release/ (its tensors, then `.metadata`, then metadata.json), the model's config and tokenizer
    files beside it (what the job that loads it takes its --tokenizer-model from, and what tells a reader of
    the folder the vocabulary's unpadded size), then the iteration file naming it."""
    folder = out / RELEASE
    folder.mkdir(parents=True, exist_ok=True)
    tempfiles.sweep(folder, recursive=False)  # what a killed export left
    return dcp.export_dcp(store, folder, plan, jobs, progress) + _beside_release(out, model)


def _plan(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    model, _, items, described = plan_items(store, subtree, request)
    plan = dcp.DcpPlan(described, {}, dcp.spread(items, jobs), {})
    files = [f"{RELEASE}/{name}" for name in plan.names] + [f"{RELEASE}/{dcp.METADATA}", f"{RELEASE}/metadata.json"] \
        + hf.model_file_names(model) + [ITERATION_FILE]

    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        if partial is not None:
            raise ExportError("--allow-partial: a Megatron checkpoint is written whole or not at all")
        return export_megatron(store, out, model, plan, jobs, progress), [], model.notes

    return Planned(files, plan.nbytes, write)


@dataclass(frozen=True)
class MegatronDirect(chunks.ChunksDirect):
    """release/'s chunks as chunks.ChunksDirect writes them, then the model's files, then the iteration
    file."""

    model: HFModel | None = None

    @property
    def files(self) -> list[str]:
        assert self.model is not None
        return super().files + [f"{RELEASE}/metadata.json"] + hf.model_file_names(self.model) + [ITERATION_FILE]

    def finish(self, store: Store, out: Path) -> list[Path]:
        assert self.model is not None
        return super().finish(store, out) + _beside_release(out, self.model)


def _beside_release(out: Path, model: HFModel) -> list[Path]:
    """metadata.json, the model's files, then the iteration file that makes OUT a run Megatron-LM loads."""
    with OutputFile(out / RELEASE / "metadata.json") as f:
        f.write(json.dumps(BACKEND).encode())
    files = [out / RELEASE / "metadata.json"] + hf.write_model_files(out, model)
    with OutputFile(out / ITERATION_FILE) as f:
        f.write(RELEASE.encode())
    return files + [out / ITERATION_FILE]


def plan_direct(store: Store, request: ExportRequest, subtree: str, jobs: int) -> MegatronDirect | None:
    """Each chunk that is one run of rows of an array the ingest brings, laid out in release/'s files for
    its workers; the rest written at the finish from the store."""
    model, _, items, described = plan_items(store, subtree, request)
    fields = chunks.plan_direct(store, items, described, jobs, RELEASE)
    return None if fields is None else MegatronDirect(**fields, said=tuple(model.notes), model=model)


def _direct(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> MegatronDirect | None:
    return plan_direct(store, request, subtree, jobs)


# what it writes at OUT's top (release/ holds the rest): an earlier export's other files are refused up front
MAY_WRITE = r"latest_checkpointed_iteration\.txt|release|config\.json|generation_config\.json"
FORMAT = OutputFormat("megatron", subtree=True, may_write=MAY_WRITE, config_beside=False, resume_beside=False,
                      describes_model=True, single_file=False, takes_scheduler=False, plan=_plan, direct=_direct,
                      recognises=lambda out: (out / ITERATION_FILE).is_file(), reads_back_as_model=True,
                      pads_vocabulary=True)
