"""Megatron-Core DeepSeek-V3 models (multi-latent attention, a dense first block, sigmoid routing with
an expert bias, a shared expert, multi-token prediction) as transformers' DeepseekV3ForCausalLM.

MLA's weights need no reordering: Megatron keeps each head's q as [nope; rope], the kv down-projection's
rows as [latent; rope] and each head's kv up-projection rows as [k_nope; v], as the hub does, and applies
its rotary embeddings interleaved (`rope_interleave`). The q and kv latents' norms are modules of their
own in the local spec (`q_layernorm`) or live in the up-projection under Transformer Engine's names
(`linear_q_up_proj.layer_norm_weight`). Megatron's multi-token-prediction layers (`mtp.layers.{i}`, the
inner layer saved as `transformer_layer`, held as `mtp_model_layer`) are the hub's `model.layers.{N+i}`,
which transformers does not build (it ignores them on load) and engines use for speculative decoding.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ...errors import ExportError
from .megatron_llama import glu, need, number

GLU = ("gate_proj", "up_proj", "down_proj")


def attention(take: Callable[..., None], shapes: dict[str, Any], config: dict[str, Any], source: str, hf: str,
              hidden: int, where: str) -> None:
    """One layer's MLA: q through its low-rank latent (or one projection without q_lora_rank), k and v
    through theirs, the latents' norms under either spec's names."""
    heads, q_lora = need(config, "num_attention_heads", where), config.get("q_lora_rank")
    kv_lora, v = need(config, "kv_lora_rank", where), need(config, "v_head_dim", where)
    nope, rope = need(config, "qk_nope_head_dim", where), need(config, "qk_rope_head_dim", where)
    attn, out = f"{source}self_attention.", f"{hf}self_attn."
    if q_lora:
        take(f"{out}q_a_proj.weight", f"{attn}linear_q_down_proj.weight", None, (q_lora, hidden))
        take(f"{out}q_a_layernorm.weight", _norm(shapes, attn, "q"), None, (q_lora,))
        take(f"{out}q_b_proj.weight", f"{attn}linear_q_up_proj.weight", None, (heads * (nope + rope), q_lora))
    else:
        take(f"{out}q_proj.weight", f"{attn}linear_q_proj.weight", None, (heads * (nope + rope), hidden))
    take(f"{out}kv_a_proj_with_mqa.weight", f"{attn}linear_kv_down_proj.weight", None, (kv_lora + rope, hidden))
    take(f"{out}kv_a_layernorm.weight", _norm(shapes, attn, "kv"), None, (kv_lora,))
    take(f"{out}kv_b_proj.weight", f"{attn}linear_kv_up_proj.weight", None, (heads * (nope + v), kv_lora))
    take(f"{out}o_proj.weight", f"{attn}linear_proj.weight", None, (hidden, heads * v))


def _norm(shapes: dict[str, Any], attn: str, latent: str) -> str:
    """The norm of MLA's q or kv latent: the local spec's module, or Transformer Engine's fused one."""
    local, fused = f"{attn}{latent}_layernorm.weight", f"{attn}linear_{latent}_up_proj.layer_norm_weight"
    return fused if fused in shapes and local not in shapes else local


def mlp(take: Callable[..., None], config: dict[str, Any], index: int, source: str, hf: str, hidden: int,
        where: str) -> None:
    """Layer `index`'s MLP: dense below first_k_dense_replace, else the router (its weight and expert
    bias), the routed experts and the shared ones (one MLP n_shared_experts experts wide)."""
    if index < _dense(config, where):
        glu(take, f"{hf}mlp.", f"{source}mlp.", GLU, need(config, "intermediate_size", where), hidden)
        return
    experts, width = need(config, "n_routed_experts", where), need(config, "moe_intermediate_size", where)
    router = f"{source}mlp.router."
    take(f"{hf}mlp.gate.weight", f"{router}weight", None, (experts, hidden))
    take(f"{hf}mlp.gate.e_score_correction_bias", f"{router}expert_bias", None, (experts,))
    for e in range(experts):
        glu(take, f"{hf}mlp.experts.{e}.", f"{source}mlp.experts.local_experts.{e}.", GLU, width, hidden)
    shared = width * need(config, "n_shared_experts", where)
    glu(take, f"{hf}mlp.shared_experts.", f"{source}mlp.shared_experts.", GLU, shared, hidden)


def _dense(config: dict[str, Any], where: str) -> int:
    """How many layers come first as dense ones: said by the config (transformers' default is not 0)."""
    dense = config.get("first_k_dense_replace")
    if type(dense) is not int or dense < 0:
        raise ExportError(f"{where}: first_k_dense_replace is {dense!r:.40}; the count of dense layers first, "
                          f"which a DeepseekV3 config must say")
    return dense


def mtp(take: Callable[..., None], shapes: dict[str, Any], config: dict[str, Any], layers: int, hidden: int,
        where: str, layer: Callable[[int, str, str], None]) -> list[str]:
    """The multi-token-prediction layers as the hub's `model.layers.{layers + i}`: their norms of the
    embedding and of the hidden state, the projection of both, the inner layer (`layer(index, source, hf)`),
    and the final norm (the hub's shared_head.norm; the embedding and output layer are the model's own);
    what the user should know of them."""
    count = config.get("num_nextn_predict_layers", 0)
    if type(count) is not int or count < 0:
        raise ExportError(f"{where}: num_nextn_predict_layers is {count!r:.40}; a count of layers")
    for i in range(count):
        source, hf = f"mtp.layers.{i}.", f"model.layers.{layers + i}."
        take(f"{hf}enorm.weight", f"{source}enorm.weight", None, (hidden,))
        take(f"{hf}hnorm.weight", f"{source}hnorm.weight", None, (hidden,))
        take(f"{hf}eh_proj.weight", f"{source}eh_proj.weight", None, (hidden, 2 * hidden))
        inner = next((f"{source}{name}." for name in ("transformer_layer", "mtp_model_layer")
                      if any(n.startswith(f"{source}{name}.") for n in shapes)), f"{source}transformer_layer.")
        layer(layers + i, inner, hf)
        take(f"{hf}shared_head.norm.weight", f"{source}final_layernorm.weight", None, (hidden,))
    return [f"the {count} multi-token-prediction layer(s) are model.layers.{layers}... as the hub names them; "
            f"transformers does not build them (it reports their tensors unexpected), engines use them to "
            f"speculate"] if count else []


def _moe_pattern(args: dict[str, Any], layers: int, where: str) -> int:
    """first_k_dense_replace from Megatron's moe_layer_freq: dense layers first, then only MoE ones."""
    freq = args.get("moe_layer_freq", 1)
    pattern = [1 if i % freq == 0 else 0 for i in range(layers)] if type(freq) is int and freq > 0 else freq
    dense = next((i for i, p in enumerate(pattern or []) if p), layers) if isinstance(pattern, list) else -1
    if not isinstance(pattern, list) or pattern != [0] * dense + [1] * (layers - dense):
        raise ExportError(f"{where}: moe_layer_freq is {freq!r:.60}: dense layers after MoE ones (DeepSeek's "
                          f"come first, first_k_dense_replace), which DeepseekV3 cannot express")
    return dense


def _routing(args: dict[str, Any], where: str) -> dict[str, Any]:
    """DeepSeek-V3's router from Megatron's: sigmoid scores, an expert bias choosing, the chosen weights
    renormalised (Megatron does for top k > 1), scaled; groups scored by their top two (Megatron by their top
    topk // group_topk; alike where every group is chosen, which is no limit: one group); a shared expert
    without a gate, as wide as a whole number of experts."""
    topk, ffn = args.get("moe_router_topk", 2), args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size") or 0
    groups, chosen = args.get("moe_router_num_groups") or 1, args.get("moe_router_group_topk") or 0
    shared = args.get("moe_shared_expert_intermediate_size") or 0
    limited = 0 < chosen < groups  # some groups left out
    refused = {"moe_router_score_function": (args.get("moe_router_score_function") == "sigmoid",
                                             "a router scoring other than sigmoid"),
               "moe_router_enable_expert_bias": (bool(args.get("moe_router_enable_expert_bias")),
                                                 "no expert bias (DeepseekV3 adds e_score_correction_bias, which "
                                                 "the checkpoint does not hold)"),
               "moe_router_group_topk": (not limited or topk // chosen == 2,
                                         f"groups scored by their top {topk // (chosen or 1)} experts, not two"),
               "moe_shared_expert_intermediate_size": (shared > 0 and ffn > 0 and shared % ffn == 0,
                                                       "no shared expert, or one not a whole number of experts wide"),
               "moe_shared_expert_gate": (not args.get("moe_shared_expert_gate"), "a gated shared expert"),
               "mtp_use_repeated_layer": (not args.get("mtp_use_repeated_layer"),
                                          "one prediction layer applied repeatedly")}
    for key, (ok, what) in refused.items():
        if not ok:
            raise ExportError(f"{where}: {key} is {args.get(key)!r:.40}: {what}, which DeepseekV3 cannot express")
    return {"n_routed_experts": args.get("num_experts"), "num_experts_per_tok": topk, "moe_intermediate_size": ffn,
            "n_shared_experts": shared // ffn, "n_group": groups if limited else 1,
            "topk_group": chosen if limited else 1,
            "routed_scaling_factor": number(args, "moe_router_topk_scaling_factor", 1.0, where) or 1.0,
            "norm_topk_prob": topk > 1,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _rope(args: dict[str, Any], where: str) -> dict[str, Any]:
    """MLA's rotary embeddings: YaRN unless rope_type says rope (MLA's default is YaRN), with the
    concentration factor Megatron computes; its softmax scale takes mscale_all_dim in either case."""
    factor = number(args, "rotary_scaling_factor", 1.0, where) or 1.0
    mscale, mscale_all_dim = number(args, "mscale", 1.0, where), number(args, "mscale_all_dim", 0.0, where)
    if args.get("rope_type") == "rope":
        if factor > 1 and mscale_all_dim:
            raise ExportError(f"{where}: rotary_scaling_factor is {factor}: a softmax scaled by YaRN's mscale with "
                              f"plain rotary embeddings (rope_type rope), which DeepseekV3 cannot express")
        return {"rope_scaling": None}

    def get_mscale(m: float) -> float:  # megatron-core's _yarn_get_mscale
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return {"rope_scaling": {"rope_type": "yarn", "factor": factor, "mscale": mscale, "mscale_all_dim": mscale_all_dim,
                             "original_max_position_embeddings": args.get("original_max_position_embeddings", 4096),
                             "beta_fast": args.get("beta_fast", 32.0), "beta_slow": args.get("beta_slow", 1.0),
                             "attention_factor": get_mscale(mscale) / get_mscale(mscale_all_dim)}}


def config_from_args(args: dict[str, Any], where: str) -> dict[str, Any]:
    """What a DeepSeek-V3 config.json says beyond the Llama family's, from Megatron-LM's args (the MLA
    fields; a model without experts is all dense layers)."""
    if not args.get("qk_layernorm"):
        raise ExportError(f"{where}: qk_layernorm is {args.get('qk_layernorm')!r:.40}: MLA without norms over its "
                          f"q and kv latents, which DeepseekV3 cannot express")
    layers = args.get("num_layers") or 0
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              "num_key_value_heads": args.get("num_attention_heads"), "q_lora_rank": args.get("q_lora_rank"),
              "kv_lora_rank": args.get("kv_lora_rank"), "qk_nope_head_dim": args.get("qk_head_dim"),
              "qk_rope_head_dim": args.get("qk_pos_emb_head_dim"), "v_head_dim": args.get("v_head_dim"),
              "rope_interleave": True, "attention_bias": False,
              "num_nextn_predict_layers": args.get("mtp_num_layers") or 0, **_rope(args, where)}
    if not args.get("num_experts"):
        return {**config, "first_k_dense_replace": layers}
    return {**config, "first_k_dense_replace": _moe_pattern(args, layers, where), **_routing(args, where)}
