"""OLMo-core trainer checkpoints as transformers' `Olmo2ForCausalLM` (or `LlamaForCausalLM`), from the
experiment config OLMo-core's trainer writes into every checkpoint folder (`config.json`, its
`ConfigSaverCallback`).

The names are those of OLMo-core's own converter (olmo_core/nn/hf/convert.py, read backwards): one
OLMo-core tensor to one transformers tensor, no splits. OLMo 2's reordered-norm block puts its norms
after attention and MLP (`post_attention_layernorm`, `post_feedforward_layernorm`) and has q/k norms;
the default block is Llama's pre-norm layout. What transformers cannot express is refused by name: MoE,
normalized transformers, sliding windows (OLMo 3), per-head q/k norms, RoPE scaling, non-RMS norms.
"""

from __future__ import annotations

import re
from typing import Any

from ...errors import ExportError
from .spec import HFModel, HFTensor

WHERE = "config.json"
# OLMo-core name (after blocks.{i}.) -> transformers name (after model.layers.{i}.), per block type.
ATTENTION = {"attention.w_q": "self_attn.q_proj", "attention.w_k": "self_attn.k_proj",
             "attention.w_v": "self_attn.v_proj", "attention.w_out": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj", "feed_forward.w3": "mlp.up_proj"}
BLOCKS = {
    "reordered_norm": {**ATTENTION, "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
                       "attention_norm": "post_attention_layernorm",
                       "feed_forward_norm": "post_feedforward_layernorm"},
    "default": {**ATTENTION, "attention_norm": "input_layernorm", "feed_forward_norm": "post_attention_layernorm"},
}
TOP = {"embeddings": "model.embed_tokens", "lm_head.norm": "model.norm", "lm_head.w_out": "lm_head"}
DEFAULT_CONTEXT = 4096


def is_experiment_config(config: Any) -> bool:
    """Whether a config.json is OLMo-core's experiment config (a `model` section with blocks)."""
    model = config.get("model") if isinstance(config, dict) else None
    return isinstance(model, dict) and "block" in model and "d_model" in model


def _get(section: Any, key: str, where: str) -> Any:
    if not isinstance(section, dict) or section.get(key) is None:
        raise ExportError(f"{WHERE}: {where}.{key} is not set; it is needed for the Hugging Face config")
    return section[key]


def _refuse(what: str) -> ExportError:
    return ExportError(f"{WHERE}: an OLMo-core model with {what} has no transformers class shardstore writes")


def _name(source: str, block: dict[str, str]) -> str | None:
    """The transformers name of an OLMo-core tensor, or None."""
    m = re.fullmatch(r"blocks\.([0-9]+)\.(.+)\.(weight|bias)", source)
    if m and m[2] in block:
        return f"model.layers.{m[1]}.{block[m[2]]}.{m[3]}"
    m = re.fullmatch(r"(.+)\.(weight|bias)", source)
    if m and m[1] in TOP:
        return f"{TOP[m[1]]}.{m[2]}"
    return None


def plan(experiment: dict[str, Any], names: list[str], shapes: dict[str, tuple[int, ...]]) -> HFModel:
    """The transformers model for an OLMo-core checkpoint whose model keys are `names`."""
    model = experiment["model"]
    if model.get("name", "default") not in ("default", "transformer"):
        raise _refuse(f"model type {model.get('name')!r}")
    block = _get(model, "block", "model")
    kind = block.get("name", "default")
    if kind not in BLOCKS:
        raise _refuse(f"{kind!r} blocks")
    attention = block.get("attention") or block.get("sequence_mixer")
    if not isinstance(attention, dict):
        raise ExportError(f"{WHERE}: model.block has no attention section")
    if attention.get("sliding_window"):
        raise _refuse("sliding-window attention (OLMo 3)")
    if attention.get("use_head_qk_norm"):
        raise _refuse("per-head q/k norms")
    if (attention.get("qk_norm") is not None) != (kind == "reordered_norm"):
        raise _refuse("q/k norms " + ("missing from OLMo 2's block" if kind == "reordered_norm" else "in a Llama block"))
    rope = attention.get("rope")
    if not isinstance(rope, dict):
        raise _refuse("no rotary embeddings")
    if rope.get("scaling"):
        raise _refuse("RoPE scaling")
    norm = block.get("layer_norm") or {}
    if norm.get("name", "rms") not in ("rms", "fused_rms"):
        raise _refuse(f"{norm.get('name')!r} norms")
    feed_forward = _get(block, "feed_forward", "model.block")
    if kind == "reordered_norm" and (attention.get("bias") or feed_forward.get("bias")):
        raise _refuse("biases in an OLMo 2 block (Olmo2ForCausalLM has none)")
    heads = _get(attention, "n_heads", "model.block.attention")
    table = BLOCKS[kind]
    tensors = []
    for source in names:
        key = _name(source, table)
        if key is None:
            raise ExportError(f"{source}: the checkpoint has this tensor, which the transformers model has no place "
                              f"for ({WHERE} describes another model?)")
        tensors.append(HFTensor(key, source))
    tied = bool(model.get("tie_word_embeddings", False)) or "lm_head.w_out.weight" not in names
    d, vocab = _get(model, "d_model", "model"), _get(model, "vocab_size", "model")
    if tuple(shapes.get("embeddings.weight", (vocab, d))) != (vocab, d):
        raise ExportError(f"embeddings.weight is {list(shapes['embeddings.weight'])}, but {WHERE} implies {[vocab, d]}")
    tokenizer = (experiment.get("dataset") or {}).get("tokenizer") or {}
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token = tokenizer.get(key)
        if token is not None and not (type(token) is int and 0 <= token < vocab):
            raise ExportError(f"{WHERE}: dataset.tokenizer.{key} {token!r:.20} is outside the model's vocabulary "
                              f"of {vocab}")
    context = ((experiment.get("dataset") or {}).get("sequence_length")
               or (experiment.get("train_module") or {}).get("max_sequence_length") or DEFAULT_CONTEXT)
    theta = float(rope.get("theta", 500_000))
    olmo2 = kind == "reordered_norm"
    config = {
        "architectures": ["Olmo2ForCausalLM" if olmo2 else "LlamaForCausalLM"],
        "model_type": "olmo2" if olmo2 else "llama",
        "vocab_size": vocab, "hidden_size": d, "intermediate_size": _get(feed_forward, "hidden_size", "model.block.feed_forward"),
        "num_hidden_layers": _get(model, "n_layers", "model"), "num_attention_heads": heads,
        "num_key_value_heads": attention.get("n_kv_heads") or heads, "hidden_act": "silu",
        "max_position_embeddings": context, "initializer_range": 0.02, "use_cache": True,
        "attention_bias": bool(attention.get("bias")), "attention_dropout": 0.0,
        "rms_norm_eps": float(norm.get("eps", 1e-5)), "tie_word_embeddings": tied,
        "pad_token_id": tokenizer.get("pad_token_id"), "bos_token_id": tokenizer.get("bos_token_id"),
        "eos_token_id": tokenizer.get("eos_token_id"),
        # both spellings: transformers < 5 reads rope_theta, 5 reads rope_parameters
        "rope_theta": theta, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }
    if not olmo2:
        config["mlp_bias"] = bool(feed_forward.get("bias"))
    generation = {"_from_model_config": True, "bos_token_id": config["bos_token_id"],
                  "eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]}
    notes = [f"tokenizer files not written: OLMo-core names its tokenizer ({tokenizer['identifier']}) but does not "
             f"save it; copy its files beside the weights"] if tokenizer.get("identifier") else []
    return HFModel(config, generation, tensors, {}, notes)
