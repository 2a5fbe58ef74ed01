"""The Hugging Face export of Megatron-Core GPT models (`megatron.py`), run backwards: where each tensor of a
transformers model goes in the Megatron-Core model its config.json describes.

Megatron's names and shapes are built from the config as megatron-core's GPTModel has them (`shapes`),
the forward mapping is asked where each transformers tensor comes from in them, and that answer is
inverted (`placements`): a transformers tensor's rows land, block by block, at rows of a Megatron tensor
(q, k and v per query group into `linear_qkv`, gate and up into `linear_fc1`). Only what the forward
mapping says is placed, so the two directions cannot disagree; a Megatron row nothing lands on (the
vocabulary's padding) is named (`Placed.padding`), and a transformers tensor with no place is refused by
name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...errors import ExportError
from ..contract import TRANSFORMER_IMPLS
from . import gpt_oss, megatron
from .megatron_llama import (DEEPSEEK_V3, EMBEDDING, FINAL_NORM, GPT_OSS, MOE, NORMS, OUTPUT, QWEN2_MOE, QWEN3,
                             QWEN3_MOE, need)
from .spec import HFTensor

Shape = tuple[int, ...]
LAYER = re.compile(r"decoder\.layers\.([0-9]+)\.(.+)\Z")
EXPERT = re.compile(r"(.*)mlp\.experts\.local_experts\.([0-9]+)\.(.+)\Z")
# the architectures whose Megatron names are built here
BUILT = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", QWEN3, MOE, QWEN3_MOE, QWEN2_MOE, DEEPSEEK_V3,
         GPT_OSS)
# Megatron-LM's --transformer-impl: the layer spec a checkpoint's keys are those of. They differ only where a
# norm is a module of its own under one spec and fused into the next linear layer under the other: an MoE
# layer's pre-MLP norm (Transformer Engine: `pre_mlp_layernorm`; the local spec maps its own onto
# `mlp.linear_fc1.layer_norm_weight`) and multi-latent attention's (no map in the local spec)
TRANSFORMER_ENGINE = TRANSFORMER_IMPLS[0]


@dataclass(frozen=True)
class Placement:
    """Rows `rows` of transformers' tensor `hf` (all of them: None) land in Megatron's `target` from row `at`;
    or, `member` given, `hf` is stacked from several Megatron tensors (GPT-OSS's experts) and its `member`-th
    is `target`, whole, once its axes are swapped back (`transpose`) and its rows gathered back from the
    `interleave` ways they were dealt out (spec.HFTensor's stacking undone)."""

    hf: str
    rows: tuple[int, int] | None
    target: str
    at: int
    member: int | None = None
    interleave: int = 1
    transpose: bool = False


@dataclass(frozen=True)
class Placed:
    """A transformers model in Megatron's names: each Megatron tensor's shape (per layer, as the model's
    state dict has it), where every transformers tensor lands, and each Megatron tensor's rows nothing
    lands on (the vocabulary padded past `vocab_size`), which the writer fills with zeros."""

    shapes: dict[str, Shape]
    placements: tuple[Placement, ...]
    padding: dict[str, tuple[int, int]]


def architecture(config: dict[str, Any], where: str) -> str:
    """The transformers class `config` names (by its `architectures`, else its `model_type`), refused by name
    where its Megatron names are not built here."""
    arch = (config.get("architectures") or [None])[0]
    if arch is None and isinstance(config.get("model_type"), str):
        arch = megatron.BY_MODEL_TYPE.get(config["model_type"], f"model_type {config['model_type']}")
    if arch not in BUILT:
        raise ExportError(f"{where}: architecture {arch!r:.60} has no Megatron-Core GPT equivalent here; one of "
                          f"{', '.join(BUILT)}")
    return str(arch)


def padded_vocab(vocab: int, divisible_by: int) -> int:
    """Megatron-LM's vocabulary size with padding (`_vocab_size_with_padding`): `vocab` rounded up to a
    multiple of `divisible_by` (its make_vocab_size_divisible_by times the tensor-parallel size)."""
    return -(-vocab // divisible_by) * divisible_by


def shapes(config: dict[str, Any], where: str, te_norms: bool = True, vocab_rows: int | None = None,
           impl: str = TRANSFORMER_ENGINE) -> dict[str, Shape]:
    """Every tensor of the megatron-core GPTModel `config` describes, per layer, with its shape, under the
    keys a torch_dist checkpoint of layer spec `impl` holds (norms fused into the next linear layer where
    they are: `linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`, MLA's
    `linear_q_up_proj.layer_norm_weight`) or, with `te_norms` false, the local spec's module names; the
    embedding and output layer of `vocab_rows` rows (default: `vocab_size`, unpadded); DeepSeek-V3's
    multi-token-prediction layers as `mtp.layers.{i}`."""
    arch = architecture(config, where)
    fused = te_norms and impl == TRANSFORMER_ENGINE  # Transformer Engine's names where the specs differ
    if arch == DEEPSEEK_V3:
        return _deepseek(config, where, vocab_rows, fused)
    hidden, heads = need(config, "hidden_size", where), need(config, "num_attention_heads", where)
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    if type(groups) is not int or heads % groups:
        raise ExportError(f"{where}: {heads} heads in {groups!r:.20} key-value groups")
    vocab = vocab_rows or need(config, "vocab_size", where)
    ffn = need(config, "intermediate_size", where)
    out: dict[str, Shape] = {EMBEDDING: (vocab, hidden)}
    for i in range(need(config, "num_hidden_layers", where)):
        layer = f"decoder.layers.{i}."
        qkv = (heads + 2 * groups) * head_dim
        out[f"{layer}self_attention.linear_qkv.weight"] = (qkv, hidden)
        if arch in ("Qwen2ForCausalLM", QWEN2_MOE, GPT_OSS) or config.get("attention_bias"):
            out[f"{layer}self_attention.linear_qkv.bias"] = (qkv,)
        out[f"{layer}self_attention.linear_proj.weight"] = (hidden, heads * head_dim)
        if arch in (QWEN3, QWEN3_MOE):
            out[f"{layer}self_attention.q_layernorm.weight"] = (head_dim,)
            out[f"{layer}self_attention.k_layernorm.weight"] = (head_dim,)
        for key, candidates in NORMS.items():  # an MoE layer's pre-MLP norm is TE's module of its own
            module = not te_norms or fused and (arch in megatron.MOE_BLOCKS or arch == GPT_OSS) and \
                key == "post_attention_layernorm.weight"
            out[f"{layer}{candidates[1 if module else 0]}"] = (hidden,)
        if arch == GPT_OSS:
            out.update(gpt_oss.megatron_shapes(config, layer, hidden, where))
        elif arch in megatron.MOE_BLOCKS:
            _, count, width, _ = megatron.MOE_BLOCKS[arch]
            experts, expert_ffn = need(config, count, where), need(config, width, where)
            out[f"{layer}mlp.router.weight"] = (experts, hidden)
            for e in range(experts):
                out.update(_glu(f"{layer}mlp.experts.local_experts.{e}.", expert_ffn, hidden))
            if arch == QWEN2_MOE:
                out.update(_glu(f"{layer}mlp.shared_experts.", need(config, "shared_expert_intermediate_size", where),
                                hidden))
                out[f"{layer}mlp.shared_experts.gate_weight"] = (1, hidden)
        else:
            out.update(_glu(f"{layer}mlp.", ffn, hidden))
    out[FINAL_NORM] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        out[OUTPUT] = (vocab, hidden)
    return out


def _deepseek(config: dict[str, Any], where: str, vocab_rows: int | None, fused: bool) -> dict[str, Shape]:
    """DeepSeek-V3's tensors as megatron-core names them: multi-latent attention with its latents' norms as
    modules (the local spec) or, `fused`, in its up-projections (Transformer Engine's), dense layers first
    (TE's pre-MLP norm fused into `linear_fc1`), then MoE ones (router with its expert bias, the routed
    experts, one shared MLP), then the multi-token-prediction layers."""
    hidden, heads = need(config, "hidden_size", where), need(config, "num_attention_heads", where)
    q_lora, kv_lora = config.get("q_lora_rank"), need(config, "kv_lora_rank", where)
    nope, rope = need(config, "qk_nope_head_dim", where), need(config, "qk_rope_head_dim", where)
    v, layers = need(config, "v_head_dim", where), need(config, "num_hidden_layers", where)
    if fused and not q_lora:
        raise ExportError(f"{where}: q_lora_rank is {q_lora!r:.20}: megatron-core's Transformer Engine spec then fuses a "
                          f"norm into linear_q_proj, which DeepseekV3's q_proj does not have (q would be normalised "
                          f"twice); --transformer-impl local writes it under the local spec's names")
    dense = config.get("first_k_dense_replace")
    if type(dense) is not int or not 0 <= dense <= layers:
        raise ExportError(f"{where}: first_k_dense_replace is {dense!r:.40}; a count of the first layers")
    vocab = vocab_rows or need(config, "vocab_size", where)

    def layer(prefix: str, moe: bool) -> dict[str, Shape]:
        attn = f"{prefix}self_attention."
        out: dict[str, Shape] = {f"{prefix}input_layernorm.weight": (hidden,)}
        def norm(latent: str) -> str:
            return f"{attn}linear_{latent}_up_proj.layer_norm_weight" if fused else f"{attn}{latent}_layernorm.weight"

        if q_lora:
            out.update({f"{attn}linear_q_down_proj.weight": (q_lora, hidden), norm("q"): (q_lora,),
                        f"{attn}linear_q_up_proj.weight": (heads * (nope + rope), q_lora)})
        else:
            out[f"{attn}linear_q_proj.weight"] = (heads * (nope + rope), hidden)
        out.update({f"{attn}linear_kv_down_proj.weight": (kv_lora + rope, hidden), norm("kv"): (kv_lora,),
                    f"{attn}linear_kv_up_proj.weight": (heads * (nope + v), kv_lora),
                    f"{attn}linear_proj.weight": (hidden, heads * v),
                    f"{prefix}{'mlp.linear_fc1.layer_norm_weight' if fused and not moe else 'pre_mlp_layernorm.weight'}":
                        (hidden,)})
        if not moe:
            out.update(_glu(f"{prefix}mlp.", need(config, "intermediate_size", where), hidden))
            return out
        experts, width = need(config, "n_routed_experts", where), need(config, "moe_intermediate_size", where)
        out.update({f"{prefix}mlp.router.weight": (experts, hidden), f"{prefix}mlp.router.expert_bias": (experts,)})
        for e in range(experts):
            out.update(_glu(f"{prefix}mlp.experts.local_experts.{e}.", width, hidden))
        out.update(_glu(f"{prefix}mlp.shared_experts.", width * need(config, "n_shared_experts", where), hidden))
        return out

    out: dict[str, Shape] = {EMBEDDING: (vocab, hidden)}
    for i in range(layers):
        out.update(layer(f"decoder.layers.{i}.", i >= dense))
    for i in range(config.get("num_nextn_predict_layers") or 0):
        mtp = f"mtp.layers.{i}."
        out.update({f"{mtp}enorm.weight": (hidden,), f"{mtp}hnorm.weight": (hidden,),
                    f"{mtp}eh_proj.weight": (hidden, 2 * hidden), **layer(f"{mtp}transformer_layer.", True),
                    f"{mtp}final_layernorm.weight": (hidden,)})
    out[FINAL_NORM] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        out[OUTPUT] = (vocab, hidden)
    return out


def _glu(prefix: str, width: int, hidden: int) -> dict[str, Shape]:
    return {f"{prefix}linear_fc1.weight": (2 * width, hidden), f"{prefix}linear_fc2.weight": (hidden, width)}


def placements(config: dict[str, Any], hf_shapes: dict[str, Shape], where: str, te_norms: bool = True,
               vocab_rows: int | None = None, impl: str = TRANSFORMER_ENGINE) -> Placed:
    """Where each of a transformers model's tensors (`hf_shapes`, by name) lands in the Megatron-Core model
    its `config` describes: every one of them placed, every Megatron row but the vocabulary's padding
    landed on, each shape as the config says; else refused naming the tensor."""
    megatron_shapes = shapes(config, where, te_norms, vocab_rows, impl)
    model = megatron.plan(config, list(megatron_shapes), megatron_shapes, where, {})
    placed: list[Placement] = []
    landed: dict[str, int] = {}
    for tensor in model.tensors:
        if tensor.key not in hf_shapes:
            raise ExportError(f"{where}: has no {tensor.key}, which {config['architectures'][0] if config.get('architectures') else 'the model'} "
                              f"has (a folder of another model, or a config of another?)")
        if tensor.stack:
            placed.extend(_members(tensor, hf_shapes[tensor.key], megatron_shapes, where))
            for target in tensor.stack:
                landed[target] = megatron_shapes[target][0]
            continue
        blocks = tensor.rows or ((0, megatron_shapes[tensor.source][0]),)
        want = (sum(b - a for a, b in blocks), *megatron_shapes[tensor.source][1:])
        if tuple(hf_shapes[tensor.key]) != want:
            raise ExportError(f"{where}: {tensor.key} has shape {list(hf_shapes[tensor.key])}, the config makes it "
                              f"{list(want)} (a config of another model?)")
        first = 0
        for a, b in blocks:
            whole = tensor.rows is None
            placed.append(Placement(tensor.key, None if whole else (first, first + b - a), tensor.source, a))
            first += b - a
            landed[tensor.source] = landed.get(tensor.source, 0) + b - a
    stray = sorted(set(hf_shapes) - {p.hf for p in placed})
    if stray:
        raise ExportError(f"{where}: {stray[0]} has no place in Megatron-Core's GPT model (a tensor transformers' "
                          f"class does not have, or a config of another model)")
    padding = {}
    for name, shape in megatron_shapes.items():
        if landed.get(name, 0) != shape[0]:
            vocab = need(config, "vocab_size", where)
            assert name in (EMBEDDING, OUTPUT) and landed[name] == vocab, name  # the mapping places every other row
            padding[name] = (vocab, shape[0])
    return Placed(megatron_shapes, tuple(placed), padding)


def _members(tensor: HFTensor, shape: Shape, megatron_shapes: dict[str, Shape], where: str) -> list[Placement]:
    """A stacked transformers tensor's placements, one per Megatron tensor stacked in it, once its shape is
    the stack's (HFTensor: one per member, its axes swapped where `transpose`)."""
    one = megatron_shapes[tensor.stack[0]]
    want = (len(tensor.stack), *(one[:-2] + (one[-1], one[-2]) if tensor.transpose else one))
    if tuple(shape) != want:
        raise ExportError(f"{where}: {tensor.key} has shape {list(shape)}, the config makes it {list(want)} (a config "
                          f"of another model?)")
    return [Placement(tensor.key, None, target, 0, e, tensor.interleave, tensor.transpose)
            for e, target in enumerate(tensor.stack)]


def mtp_copies(config: dict[str, Any], keys: list[str]) -> list[str]:
    """The hub's copies of the embedding and output layer in DeepSeek-V3's multi-token-prediction layers
    (`model.layers.{N}.embed_tokens.weight`, `.shared_head.head.weight`: its README_WEIGHTS.md says they are
    the model's own), which Megatron's MTP takes from the model and does not save."""
    if architecture(config, "the model's config.json") != DEEPSEEK_V3:
        return []
    layers = config.get("num_hidden_layers") or 0
    count = config.get("num_nextn_predict_layers") or 0
    copies = {f"model.layers.{layers + i}.{name}" for i in range(count if type(count) is int else 0)
              for name in ("embed_tokens.weight", "shared_head.head.weight")}
    return [k for k in keys if k in copies]


def layers_stacked(config: dict[str, Any]) -> bool:
    """Whether megatron-core stacks the model's layers into one key each: not where they differ (its
    moe_layer_freq a pattern: DeepSeek-V3's dense layers first)."""
    return not config.get("first_k_dense_replace") if architecture(config, "the model's config.json") == DEEPSEEK_V3 \
        else True


def stacked(per_layer: dict[str, Shape], layers: bool = True) -> dict[str, tuple[Shape, dict[str, tuple[int, ...]]]]:
    """The keys of a torch_dist checkpoint, as megatron-core saves a GPTModel whatever its parallel layout:
    each layer's tensors stacked on a leading layer axis (`decoder.layers.self_attention.linear_qkv.weight`
    of [layers, rows, columns]; not where its layers differ, `layers` false: dense ones before MoE ones), a
    SequentialMLP's experts on an expert axis after it (`decoder.layers.mlp.experts.experts.linear_fc1.weight`),
    the rest as they are. Each key's global shape, and the index in it of each per-layer tensor."""
    keys: dict[str, dict[str, tuple[int, ...]]] = {}
    for name in per_layer:
        layer = LAYER.match(name) if layers else None
        prefix, rest, index = ("decoder.layers.", layer[2], (int(layer[1]),)) if layer else ("", name, ())
        expert = EXPERT.match(rest)
        if expert is not None:
            rest, index = f"{expert[1]}mlp.experts.experts.{expert[3]}", (*index, int(expert[2]))
        keys.setdefault(f"{prefix}{rest}", {})[name] = index
    out = {}
    for key, members in keys.items():
        first = next(iter(members))
        lead = tuple(max(index[d] for index in members.values()) + 1 for d in range(len(members[first])))
        if len(members) != (lead[0] * (lead[1] if len(lead) > 1 else 1) if lead else 1) or \
                any(per_layer[m] != per_layer[first] for m in members):
            raise ExportError(f"{first}: its layers (or experts) differ in shape or number; megatron-core stacks "
                              f"them into one {key}")
        out[key] = ((*lead, *per_layer[first]), members)
    return out
