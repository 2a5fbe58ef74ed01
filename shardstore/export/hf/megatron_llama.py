"""What every Megatron-Core GPT model's Hugging Face export shares: Megatron's names, transformers' class
names, a SwiGLU MLP's split, and the Llama family's config.json from Megatron-LM's arguments, which
DeepseekV3 (`deepseek.py`) and GptOss (`gpt_oss.py`) extend. `megatron.py` puts them together.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ...errors import ExportError

EMBEDDING, OUTPUT, FINAL_NORM = "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"
# transformers' per-layer name -> Megatron's names for it (Transformer Engine's first, then the local spec's)
NORMS = {"input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
         "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")}
MOE = "MixtralForCausalLM"  # Megatron's top-k router (softmax over the k chosen) is Mixtral's routing
QWEN3 = "Qwen3ForCausalLM"  # a Llama with a norm over each head's q and k: Megatron's qk_layernorm
# Qwen3-MoE routes as Mixtral (a softmax over all experts, the top k renormalised: a softmax over the k
# chosen), with Qwen3's q and k norms; Qwen2-MoE takes a softmax over every expert and keeps the top k's
# probabilities as they are (Megatron's moe_router_pre_softmax), and adds a shared expert behind a sigmoid gate
QWEN3_MOE, QWEN2_MOE = "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"  # Megatron's multi_latent_attention
GPT_OSS = "GptOssForCausalLM"  # learnable attention sinks, biases, clamped quick-GeGLU experts (gpt_oss.py)


# transformers' class defaults for the fields that size a model's attention, where config.json leaves them out
# (save_pretrained writes every field; a config written by hand may not), which are not the Llama family's
# rules (one key-value group a head, heads of hidden / heads); an explicit null keeps those rules
SIZE_DEFAULTS: dict[str, dict[str, int]] = {
    "MistralForCausalLM": {"num_key_value_heads": 8}, "Qwen2ForCausalLM": {"num_key_value_heads": 32},
    QWEN3: {"num_key_value_heads": 32, "head_dim": 128}, MOE: {"num_key_value_heads": 8},
    QWEN3_MOE: {"num_key_value_heads": 4}, QWEN2_MOE: {"num_key_value_heads": 16},
    GPT_OSS: {"num_key_value_heads": 8, "head_dim": 64}}


def with_defaults(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """`config` with its class's `SIZE_DEFAULTS` where it leaves them out."""
    return {**config, **{k: v for k, v in SIZE_DEFAULTS.get(arch, {}).items() if k not in config}}


def need(config: dict[str, Any], key: str, where: str) -> int:
    """`config[key]`, a positive int, or refused naming it."""
    value = config.get(key)
    if type(value) is not int or value <= 0:
        raise ExportError(f"{where}: {key} is {value!r:.40}; a Megatron checkpoint's mapping needs it")
    return value


def number(mapping: dict[str, Any], key: str, default: float, where: str) -> float:
    """`mapping[key]` (`default` where it is absent or null), a finite number, or refused naming it: a
    config.json is the user's, and its values go into Megatron-LM's arguments as they are."""
    value = mapping.get(key)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ExportError(f"{where}: {key} is {value!r:.40}; a number")
    return float(value)


def rope_key(config: dict[str, Any]) -> str:
    """Which of its two spellings a config holds its rotary embeddings' scaling under (`rope_scaling`,
    transformers < 5; `rope_parameters`, 5)."""
    return "rope_scaling" if config.get("rope_scaling") else "rope_parameters"


def count(mapping: dict[str, Any], key: str, default: int, where: str) -> int:
    """`mapping[key]` (`default` where it is absent or null), a positive int, or refused naming it."""
    value = mapping.get(key)
    if value is None:
        return default
    if type(value) is not int or value <= 0:
        raise ExportError(f"{where}: {key} is {value!r:.40}; a count")
    return value


def glu(take: Callable[..., None], hf: str, megatron: str, names: tuple[str, str, str], width: int,
         hidden: int) -> None:
    """A SwiGLU MLP's three projections from Megatron's two: `linear_fc1` is [gate; up], `linear_fc2` down."""
    gate, up, down = names
    take(f"{hf}{gate}.weight", f"{megatron}linear_fc1.weight", ((0, width),), (2 * width, hidden))
    take(f"{hf}{up}.weight", f"{megatron}linear_fc1.weight", ((width, 2 * width),))
    take(f"{hf}{down}.weight", f"{megatron}linear_fc2.weight", None, (hidden, width))


# Megatron-LM's arguments -> what transformers' config calls them
REFUSED = {"normalization": ("RMSNorm", "LayerNorm norms"), "swiglu": (True, "a non-SwiGLU MLP"),
           "position_embedding_type": ("rope", "position embeddings other than rotary"),
           "rotary_percent": (1.0, "rotary embeddings on part of each head"),
           "add_bias_linear": (False, "biases on the linear layers"),
           # GPT-OSS's blocks (gpt_oss.py takes a model with learnable sinks), elsewhere silently lost
           "softmax_type": ("vanilla", "a softmax with a sink in every head"),
           "window_size": (None, "sliding-window attention")}


# an argument's check: (whether its value can be expressed, what it is when it cannot)
Check = tuple[Callable[[Any], bool], str]
# Megatron-LM's MoE arguments Mixtral's routing cannot follow
MOE_REFUSED: dict[str, Check] = {"moe_router_pre_softmax": (lambda v: not v, "a softmax over every expert before the top k"),
               "moe_router_score_function": (lambda v: v in (None, "softmax"), "a router scoring other than softmax"),
               "moe_shared_expert_intermediate_size": (lambda v: not v, "shared experts"),
               "moe_router_enable_expert_bias": (lambda v: not v, "expert biases in the router"),
               "moe_router_num_groups": (lambda v: not v, "group-limited routing"),
               "moe_router_topk_scaling_factor": (lambda v: v in (None, 1, 1.0), "scaled routing weights"),
               "add_qkv_bias": (lambda v: not v, "q, k and v biases"),
               "qk_layernorm": (lambda v: not v, "a norm over q and k (Qwen3-MoE's)")}
# ... and what each other MoE class asks instead
MOE_TARGETS: dict[str, dict[str, Check]] = {QWEN3_MOE: {"qk_layernorm": (bool, "no norm over q and k")},
               QWEN2_MOE: {"moe_shared_expert_intermediate_size": (bool, "no shared expert"),
                           "moe_shared_expert_gate": (bool, "a shared expert without its gate"),
                           "moe_router_pre_softmax": (bool, "a softmax over the k chosen experts only"),
                           "add_qkv_bias": (bool, "no q, k and v biases")}}


def _moe_class(args: dict[str, Any], where: str) -> str:
    """The transformers class a Megatron MoE model is, by the blocks it has (a shared expert: Qwen2-MoE's;
    q and k norms: Qwen3-MoE's; else Mixtral), its routing refused by name where that class routes otherwise."""
    target = QWEN2_MOE if args.get("moe_shared_expert_intermediate_size") else \
        QWEN3_MOE if args.get("qk_layernorm") else MOE
    for key, (ok, what) in {**MOE_REFUSED, **MOE_TARGETS.get(target, {})}.items():
        if not ok(args.get(key)):
            raise ExportError(f"{where}: {key} is {args.get(key)!r:.40}: {what}, which "
                              f"{target.removesuffix('ForCausalLM')} cannot express")
    return target


def llama_config(args: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """The Llama family's config.json from Megatron-LM's `args` (its common state), and what the user should
    know; of a model with multi-latent attention, the fields DeepseekV3 shares with it."""
    for key, (want, what) in REFUSED.items():
        if key in args and args[key] != want and not (key == "rotary_percent" and args[key] in (1, None)):
            raise ExportError(f"{where}: {key} is {args[key]!r:.40}: {what}, which the Llama-family classes of "
                              f"transformers cannot express")
    experts, mla = args.get("num_experts"), bool(args.get("multi_latent_attention"))
    moe = _moe_class(args, where) if experts and not mla else None
    heads = args.get("num_attention_heads")
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    # the tokenizer's size where the run says it (NeMo's model.yaml, Megatron-LM's --vocab-size), else the
    # padded rows
    known = type(args.get("vocab_size")) is int
    vocab = args["vocab_size"] if known else args.get("padded_vocab_size")
    bias = bool(args.get("add_qkv_bias"))
    qk_norm = bool(args.get("qk_layernorm"))
    if qk_norm and bias and not moe:
        raise ExportError(f"{where}: qk_layernorm with add_qkv_bias: q, k and v biases beside a norm over q and k, "
                          f"which neither Qwen2 nor Qwen3 in transformers express")
    dtype = str(args.get("params_dtype") or "float32").removeprefix("torch.")
    head_dim = args.get("kv_channels") or args.get("hidden_size", 0) // (heads or 1)  # Qwen3's default is not that
    config = {"architectures": ["Qwen2ForCausalLM" if bias else "LlamaForCausalLM"],
              "model_type": "qwen2" if bias else "llama", "hidden_size": args.get("hidden_size"),
              "intermediate_size": args.get("ffn_hidden_size"), "num_attention_heads": heads,
              "num_key_value_heads": groups, "head_dim": args.get("kv_channels"),
              "num_hidden_layers": args.get("num_layers"), "vocab_size": vocab,
              "rms_norm_eps": args.get("norm_epsilon", 1e-5), "rope_theta": number(args, "rotary_base", 10000, where),
              "max_position_embeddings": args.get("max_position_embeddings"),
              "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
              "hidden_act": "silu", "torch_dtype": dtype}
    notes = [] if known else [
        f"the vocabulary is Megatron's padded one ({vocab} rows; the checkpoint does not say the tokenizer's "
        f"size): give --hf-config with the tokenizer's vocab_size to drop the padding rows"]
    if mla:  # DeepSeek's multi-latent attention: heads of their own widths
        config.pop("head_dim")
        return config, notes
    expert_ffn = args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")
    if moe == MOE:
        config.update(architectures=[MOE], model_type="mixtral", num_local_experts=experts,
                      num_experts_per_tok=args.get("moe_router_topk", 2), intermediate_size=expert_ffn)
    elif moe is not None:  # Qwen3-MoE's and Qwen2-MoE's: every layer sparse
        config.update(architectures=[moe], model_type="qwen3_moe" if moe == QWEN3_MOE else "qwen2_moe",
                      num_experts=experts, num_experts_per_tok=args.get("moe_router_topk", 2),
                      moe_intermediate_size=expert_ffn, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=moe == QWEN3_MOE)
        if moe == QWEN3_MOE:
            config.update(attention_bias=False, head_dim=head_dim)
        else:
            config.update(shared_expert_intermediate_size=args.get("moe_shared_expert_intermediate_size"))
    elif qk_norm:
        config.update(architectures=[QWEN3], model_type="qwen3", attention_bias=False, head_dim=head_dim)
    elif not bias:
        config.update(attention_bias=False, mlp_bias=False)
    return config, notes
