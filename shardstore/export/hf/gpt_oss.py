"""Megatron-Core GPT-OSS models (Megatron-Bridge's GPT-OSS provider: biases on every linear layer and the
router, learnable attention sinks, clamped quick-GeGLU experts, sliding-window attention on some layers,
YaRN) as transformers' GptOssForCausalLM.

Attention is the Llama family's (q, k and v per query group, with biases) plus o_proj's bias and the sinks
(`core_attention.softmax_offset`, one logit per head that takes part in the softmax and is dropped). The
experts are what Megatron-Bridge's GPTOSSMLPGateUpProjMapping and GPTOSSMLPDownProjMapping export: one
tensor per layer for all experts, each expert's `linear_fc1` ([gate; up], 2I x H) with its gate and up rows
interleaved (gate j -> 2j, up j -> 2j + 1) and transposed into `gate_up_proj` (E, H, 2I), its bias interleaved
into `gate_up_proj_bias` (E, 2I), `linear_fc2` (H x I) transposed into `down_proj` (E, I, H), its bias into
`down_proj_bias` (E, H): transformers 5 loads only these stacked names for GPT-OSS. Megatron's activation
`quick_gelu(min(gate, c)) * (clamp(up, -c, c) + 1)` is GptOss's with `swiglu_limit` c and `swiglu_alpha`
1.702; its router (top k of the biased logits, softmax over those k) is GptOss's.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ...errors import ExportError
from .megatron_llama import GPT_OSS, MOE_REFUSED, Check, count, llama_config, need, number, rope_key

QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu: x * sigmoid(1.702 x)
# what GptOssConfig takes where config.json says nothing: YaRN (the hub's), its rotary base, top k, window
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_THETA, DEFAULT_TOPK, DEFAULT_WINDOW = 150000.0, 4, 128


def layer(take: Callable[..., None], shapes: dict[str, Any], config: dict[str, Any], source: str, hf: str,
          hidden: int, where: str) -> None:
    """One layer's tensors beyond the Llama family's: o_proj's bias, the sinks, the router with its bias,
    and the experts, each of the four stacked from every expert's."""
    heads = need(config, "num_attention_heads", where)
    experts, width = need(config, "num_local_experts", where), need(config, "intermediate_size", where)
    if config.get("attention_bias") is False:
        raise ExportError(f"{where}: attention_bias is false: GptOss without attention biases, but Megatron's "
                          f"add_bias_linear gives q, k, v and its output projection theirs")
    if f"{source}self_attention.linear_qkv.bias" not in shapes:
        raise ExportError(f"{source}self_attention.linear_qkv.bias: not in the checkpoint, but GptOss's q, k and v "
                          f"have biases (add_bias_linear gives them)")
    take(f"{hf}self_attn.o_proj.bias", f"{source}self_attention.linear_proj.bias", None, (hidden,))
    take(f"{hf}self_attn.sinks", f"{source}self_attention.core_attention.softmax_offset", None, (heads,))
    take(f"{hf}mlp.router.weight", f"{source}mlp.router.weight", None, (experts, hidden))
    take(f"{hf}mlp.router.bias", f"{source}mlp.router.bias", None, (experts,))
    each = [f"{source}mlp.experts.local_experts.{e}." for e in range(experts)]
    for name, megatron, shape, interleave, transpose in _stacks(width, hidden):
        take(f"{hf}mlp.experts.{name}", tuple(f"{e}{megatron}" for e in each), None, shape, interleave=interleave,
             transpose=transpose)


def _stacks(width: int, hidden: int) -> tuple[tuple[str, str, tuple[int, ...], int, bool], ...]:
    """Each of GptOss's stacked expert tensors: its name, the Megatron expert's tensor it stacks, that one's
    shape, the ways its rows are dealt out, and whether its axes are swapped."""
    return (("gate_up_proj", "linear_fc1.weight", (2 * width, hidden), 2, True),  # [gate; up] -> gate, up, ...
            ("gate_up_proj_bias", "linear_fc1.bias", (2 * width,), 2, False),
            ("down_proj", "linear_fc2.weight", (hidden, width), 1, True),
            ("down_proj_bias", "linear_fc2.bias", (hidden,), 1, False))


def megatron_shapes(config: dict[str, Any], layer: str, hidden: int, where: str) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s tensors beyond the Llama family's attention, q, k and v biases and norms, as
    megatron-core's GPTModel has them (`layer` run backwards): the output projection's bias, the sinks, the
    router with its bias, and each expert's two linear layers with their biases."""
    heads = need(config, "num_attention_heads", where)
    experts, width = need(config, "num_local_experts", where), need(config, "intermediate_size", where)
    out = {f"{layer}self_attention.linear_proj.bias": (hidden,),
           f"{layer}self_attention.core_attention.softmax_offset": (heads,),
           f"{layer}mlp.router.weight": (experts, hidden), f"{layer}mlp.router.bias": (experts,)}
    for e in range(experts):
        out.update({f"{layer}mlp.experts.local_experts.{e}.{megatron}": shape
                    for _, megatron, shape, _, _ in _stacks(width, hidden)})
    return out


def megatron_args(config: dict[str, Any], scaling: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """Megatron-LM's arguments for GptOss's blocks (Megatron-Bridge's GPT-OSS provider's; `config_from_args`
    reads them back): biases everywhere, learnable sinks, the clamped quick-GeGLU experts, the windows of
    its `layer_types`, its rotary embeddings' `scaling` (None: plain ones; GptOss's YaRN where the config
    says nothing of them); what Megatron cannot say refused naming the field."""
    alpha = config.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise ExportError(f"{where}: swiglu_alpha is {alpha!r:.20}; Megatron's quick_gelu is x * sigmoid("
                          f"{QUICK_GELU_ALPHA} x)")
    layers, experts = need(config, "num_hidden_layers", where), need(config, "num_local_experts", where)
    width, limit = need(config, "intermediate_size", where), number(config, "swiglu_limit", 7.0, where)
    if not limit > 0 or "swiglu_limit" in config and config["swiglu_limit"] is None:  # (null: GptOss's None)
        raise ExportError(f"{where}: swiglu_limit is {config.get('swiglu_limit')!r:.20}; Megatron clamps the GLU's "
                          f"halves at a positive value")
    if not (config.get("rope_scaling") or config.get("rope_parameters")):
        scaling = DEFAULT_ROPE
    rope = f"{where}: {rope_key(config)}"
    return dict(add_bias_linear=True, add_qkv_bias=True, swiglu=False, quick_geglu=True, softmax_type="learnable",
                activation_func_clamp_value=limit, glu_linear_offset=1.0, num_experts=experts,
                moe_ffn_hidden_size=width, moe_router_topk=count(config, "num_experts_per_tok", DEFAULT_TOPK, where),
                **_windows(config, layers, where), **_yarn(scaling, rope))


def _windows(config: dict[str, Any], layers: int, where: str) -> dict[str, Any]:
    """Megatron's window_size and window_attn_skip_freq for GptOss's `layer_types` (its default: every
    other layer windowed, the first one so) and `sliding_window` (a window of w tokens is Megatron's
    (w - 1, 0)): the inverse of `_layer_type`."""
    types = config.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            not all(t in ("sliding_attention", "full_attention") for t in types):
        raise ExportError(f"{where}: layer_types is {types!r:.80}; one of sliding_attention, full_attention for "
                          f"each of {layers} layers")
    windowed = [t == "sliding_attention" for t in types]
    if not any(windowed):
        return {"window_size": None, "window_attn_skip_freq": None}
    window = config.get("sliding_window", DEFAULT_WINDOW)
    if type(window) is not int or window < 1:
        raise ExportError(f"{where}: sliding_window is {window!r:.20}; layers are windowed, in a count of tokens")
    skip: int | list[int] | None = None if all(windowed) else \
        next((n for n in range(2, layers + 1) if windowed == [bool((i + 1) % n) for i in range(layers)]),
             None) or [int(w) for w in windowed]
    return {"window_size": (window - 1, 0), "window_attn_skip_freq": skip}


def _yarn(scaling: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """Megatron-LM's YaRN arguments for GptOss's rope scaling (`_rope` run backwards): its attention factor
    must be the one megatron-core computes from mscale and mscale_all_dim."""
    if scaling is None:
        return {"position_embedding_type": "rope"}
    if scaling["rope_type"] != "yarn":
        raise ExportError(f"{where}: rotary embeddings scaled as {scaling['rope_type']!r:.40}; Megatron's GPT-OSS "
                          f"takes YaRN or none")
    factor = number(scaling, "factor", 1.0, where)
    mscale, mscale_all_dim = number(scaling, "mscale", 0.0, where), number(scaling, "mscale_all_dim", 0.0, where)
    if not (mscale and mscale_all_dim):  # transformers' default: the mscale of the factor alone
        mscale, mscale_all_dim = 1.0, 0.0
    made = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    if not math.isclose(number(scaling, "attention_factor", made, where), made, rel_tol=1e-12):  # (absent: made)
        raise ExportError(f"{where}: YaRN's attention_factor is {scaling['attention_factor']!r:.20}; megatron-core "
                          f"computes it from mscale {mscale} and mscale_all_dim {mscale_all_dim}: {made}")
    return {"position_embedding_type": "yarn", "rotary_scaling_factor": factor,
            "yarn_original_max_position_embeddings": count(scaling, "original_max_position_embeddings", 4096, where),
            "yarn_beta_fast": number(scaling, "beta_fast", 32.0, where),
            "yarn_beta_slow": number(scaling, "beta_slow", 1.0, where),
            "yarn_correction_range_round_to_int": bool(scaling.get("truncate", True)), "mscale": mscale,
            "mscale_all_dim": mscale_all_dim}


def _mscale(factor: float, m: float) -> float:
    """megatron-core's _yarn_get_mscale (transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


# Megatron-LM's arguments GptOss needs as they are, and what any other value would be
REQUIRED: dict[str, Check] = {"num_experts": (bool, "a dense MLP"),
            "add_bias_linear": (bool, "linear layers without biases (GptOss's experts and router have them)"),
            "quick_geglu": (bool, "an activation other than quick-GeGLU"),
            "glu_linear_offset": (lambda v: v == 1.0, "an offset other than 1 on the GLU's linear half"),
            "activation_func_clamp_value": (lambda v: isinstance(v, (int, float)) and v > 0,
                                            "no clamp on the GLU's halves"),
            "rotary_interleaved": (lambda v: not v, "interleaved rotary embeddings"),
            "position_embedding_type": (lambda v: v in ("rope", "yarn"), "position embeddings other than rotary"),
            "window_size": (lambda v: v is None or isinstance(v, (list, tuple)) and len(v) == 2 and v[1] == 0
                            and type(v[0]) is int and v[0] >= 0, "a window that looks ahead, or not a window"),
            **{k: v for k, v in MOE_REFUSED.items() if k != "add_qkv_bias"}}


def config_from_args(args: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """A GptOss config.json from Megatron-LM's args (a model with learnable attention sinks): the Llama
    family's fields, then GptOss's experts, windows and rotary embeddings; what GptOss cannot express refused
    naming the argument."""
    for key, (ok, what) in REQUIRED.items():
        if not ok(args.get(key)):
            raise ExportError(f"{where}: {key} is {args.get(key)!r:.40}: {what}, which GptOss cannot express")
    layers, window, skip = args.get("num_layers") or 0, args.get("window_size"), args.get("window_attn_skip_freq")
    if not (skip is None or type(skip) is int and skip > 0 or isinstance(skip, list) and len(skip) == layers):
        raise ExportError(f"{where}: window_attn_skip_freq is {skip!r:.40}: not a frequency nor one flag per layer "
                          f"of {layers}")
    config, notes = llama_config({**args, "swiglu": True, "add_bias_linear": False, "add_qkv_bias": False,  # the
                                  "num_experts": None, "position_embedding_type": "rope",  # Llama family's fields
                                  "softmax_type": "vanilla", "window_size": None}, where)
    for key in ("mlp_bias", "hidden_act"):
        config.pop(key, None)
    config.update(architectures=[GPT_OSS], model_type="gpt_oss", attention_bias=True,
                  num_local_experts=args["num_experts"], num_experts_per_tok=args.get("moe_router_topk", 2),
                  intermediate_size=args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size"),
                  swiglu_limit=float(args["activation_func_clamp_value"]), swiglu_alpha=QUICK_GELU_ALPHA,
                  sliding_window=window[0] + 1 if window else None,
                  layer_types=[_layer_type(args, i) for i in range(layers)], rope_scaling=_rope(args, where))
    return config, notes


def _layer_type(args: dict[str, Any], i: int) -> str:
    """Megatron's is_layer_window_attention for 0-based layer i: every layer windowed without a skip
    frequency, all but each N-th with an int N, the ones a list marks."""
    skip = args.get("window_attn_skip_freq")
    windowed = bool(args.get("window_size")) and (skip is None or
                                                  (skip[i] if isinstance(skip, list) else (i + 1) % skip))
    return "sliding_attention" if windowed else "full_attention"


def _rope(args: dict[str, Any], where: str) -> dict[str, Any]:
    """GptOss's rope_scaling as the hub's config.json writes it (beside rope_theta; transformers 5 reads it into
    rope_parameters): Megatron's plain rotary embeddings said so (GptOss takes YaRN when it says nothing), or
    its YaRN as Megatron-LM's _apply_yarn_config_from_args fills it in, with the concentration factor
    megatron-core applies."""
    if args.get("position_embedding_type") != "yarn":
        return {"rope_type": "default"}
    factor = number(args, "rotary_scaling_factor", 1.0, where) or 1.0
    # (None: as Megatron-LM fills them in)
    mscale, mscale_all_dim = number(args, "mscale", 1.0, where), number(args, "mscale_all_dim", 0.0, where)

    round_to_int = args.get("yarn_correction_range_round_to_int")
    return {"rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": count(args, "yarn_original_max_position_embeddings", 4096, where),
            "beta_fast": number(args, "yarn_beta_fast", 32.0, where) or 32.0,
            "beta_slow": number(args, "yarn_beta_slow", 1.0, where) or 1.0,
            "truncate": True if round_to_int is None else bool(round_to_int),
            "attention_factor": _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)}
