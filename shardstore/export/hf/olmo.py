"""OLMo 1 and OLMo 2 as transformers' `OlmoForCausalLM` / `Olmo2ForCausalLM`, from OLMo's config.yaml.

Names and splits are those of transformers' own converters (convert_olmo*_weights_to_hf.py): the fused
`att_proj` splits into q, k, v by rows [d_model, head_dim·n_kv_heads, head_dim·n_kv_heads]; `ff_proj`
chunks into (up, gate), in that order (OLMo's SwiGLU takes `x, gate = x.chunk(2, -1)`); `lm_head` is
`transformer.ff_out` unless the embeddings are tied. Every split is a block of whole rows, so it streams
from the store like any other tensor. A checkpoint tensor the table does not place is an error: a bias or
an affine norm that the transformers class has no room for is never dropped silently.
"""

from __future__ import annotations

import re
from typing import Any

from ...errors import ExportError
from .spec import HFModel, HFTensor

# Per layer: transformers name -> (OLMo name, which rows: None, ("qkv", i) or ("ff", i)).
LAYER: dict[str, tuple[str, tuple[str, int] | None]] = {
    "self_attn.q_proj.weight": ("att_proj.weight", ("qkv", 0)),
    "self_attn.k_proj.weight": ("att_proj.weight", ("qkv", 1)),
    "self_attn.v_proj.weight": ("att_proj.weight", ("qkv", 2)),
    "self_attn.o_proj.weight": ("attn_out.weight", None),
    "mlp.up_proj.weight": ("ff_proj.weight", ("ff", 0)),
    "mlp.gate_proj.weight": ("ff_proj.weight", ("ff", 1)),
    "mlp.down_proj.weight": ("ff_out.weight", None),
}
OLMO2_LAYER = {
    **LAYER,
    "self_attn.q_norm.weight": ("q_norm.weight", None),
    "self_attn.k_norm.weight": ("k_norm.weight", None),
    "post_attention_layernorm.weight": ("attn_norm.weight", None),
    "post_feedforward_layernorm.weight": ("ff_norm.weight", None),
}
TOP = {"model.embed_tokens.weight": "transformer.wte.weight"}
OLMO2_TOP = {**TOP, "model.norm.weight": "transformer.ln_f.weight"}
WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
# OLMo's tokenizers put EOS at 50279; an eos_token_id of 0 in old configs was a bug the converters fix.
EOS_FIX = 50279


def normalise(name: str, group_size: int) -> str:
    """Wrapper names removed; `block_groups.{g}.{b}` as `blocks.{g * group_size + b}`."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    m = re.match(r"^transformer\.block_groups\.([0-9]+)\.([0-9]+)\.(.*)$", name)
    if m:
        name = f"transformer.blocks.{int(m.group(1)) * group_size + int(m.group(2))}.{m.group(3)}"
    return name


def _require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ExportError(f"config.yaml: model.{key} is not set; it is needed for the Hugging Face config")
    return cfg[key]


def _refuse_unsupported(cfg: dict[str, Any], olmo2: bool) -> None:
    """Features of OLMo's model that the transformers classes cannot express: refused by name."""
    checks = [
        ("activation_type", cfg.get("activation_type", "swiglu") != "swiglu", "an activation other than swiglu"),
        ("include_bias", bool(cfg.get("include_bias", False)), "biases"),
        ("alibi", bool(cfg.get("alibi", False)), "ALiBi instead of rotary embeddings"),
        ("rope", not cfg.get("rope", True), "no rotary embeddings"),
        ("block_type", cfg.get("block_type", "sequential") != "sequential", f"block_type {cfg.get('block_type')}"),
        ("scale_logits", bool(cfg.get("scale_logits", False)), "scaled logits"),
    ]
    if olmo2:
        checks.append(("clip_qkv", cfg.get("clip_qkv") is not None, "clip_qkv (Olmo2ForCausalLM has none)"))
    else:
        # default, low_precision and amd_compatible are all a LayerNorm (affine weights, if any, are caught
        # as tensors the table has no place for); an RMS norm is another function
        checks.append(("layer_norm_type", cfg.get("layer_norm_type", "default") == "rms",
                       "RMS norms but not OLMo 2's layout (OlmoForCausalLM uses a non-parametric LayerNorm)"))
    for key, bad, what in checks:
        if bad:
            raise ExportError(f"config.yaml: model.{key}: an OLMo model with {what} has no transformers equivalent")


def is_olmo2(cfg: dict[str, Any]) -> bool:
    """OLMo 2: RMS norms after attention and MLP, and q/k norms (what the OLMo 2 converter requires)."""
    return bool(cfg.get("norm_after")) and bool(cfg.get("attention_layer_norm"))


def plan(cfg: dict[str, Any], names: list[str], shapes: dict[str, tuple[int, ...]]) -> HFModel:
    """The transformers model for an OLMo checkpoint whose model keys are `names` (normalised)."""
    olmo2 = is_olmo2(cfg)
    _refuse_unsupported(cfg, olmo2)
    d, heads, layers = _require(cfg, "d_model"), _require(cfg, "n_heads"), _require(cfg, "n_layers")
    kv = cfg.get("n_kv_heads") or (1 if cfg.get("multi_query_attention") else heads)
    head_dim = d // heads
    fused = [d, head_dim * kv, head_dim * kv]
    vocab = cfg.get("embedding_size") or _require(cfg, "vocab_size")
    intermediate = (cfg["mlp_hidden_size"] if cfg.get("mlp_hidden_size") else d * _require(cfg, "mlp_ratio")) // 2
    tied = bool(cfg.get("weight_tying", not olmo2))
    tensors: list[HFTensor] = []
    for hf, olmo in (OLMO2_TOP if olmo2 else TOP).items():
        tensors.append(HFTensor(hf, olmo))
    layer_table = OLMO2_LAYER if olmo2 else LAYER
    for i in range(layers):
        for hf, (olmo, part) in layer_table.items():
            source = f"transformer.blocks.{i}.{olmo}"
            rows = None
            if part is not None:
                kind, index = part
                sizes = fused if kind == "qkv" else [intermediate, intermediate]
                rows = ((sum(sizes[:index]), sum(sizes[:index + 1])),)
            tensors.append(HFTensor(f"model.layers.{i}.{hf}", source, rows))
    if not tied:
        tensors.append(HFTensor("lm_head.weight", "transformer.ff_out.weight"))
    _check_shapes(tensors, shapes, {"transformer.wte.weight": (vocab, d),
                                    **{f"transformer.blocks.{i}.att_proj.weight": (sum(fused), d) for i in range(layers)},
                                    **{f"transformer.blocks.{i}.ff_proj.weight": (2 * intermediate, d)
                                       for i in range(layers)}})
    placed = {t.source for t in tensors}
    left = [n for n in names if n not in placed]
    if left:
        raise ExportError(f"{left[0]}: the checkpoint has this tensor, which {'Olmo2' if olmo2 else 'Olmo'}ForCausalLM "
                          f"has no place for (config.yaml describes another model?)")
    eos, pad = cfg.get("eos_token_id"), cfg.get("pad_token_id")
    if eos == 0 and vocab > EOS_FIX:
        eos = EOS_FIX
    rope_theta = float(cfg.get("rope_theta", 10000.0))
    config = {
        "architectures": ["Olmo2ForCausalLM" if olmo2 else "OlmoForCausalLM"],
        "model_type": "olmo2" if olmo2 else "olmo",
        "vocab_size": vocab, "hidden_size": d, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "hidden_act": "silu",
        "max_position_embeddings": _require(cfg, "max_sequence_length"), "initializer_range": 0.02,
        "use_cache": True, "pad_token_id": pad, "bos_token_id": None, "eos_token_id": eos,
        "tie_word_embeddings": tied, "attention_bias": False, "attention_dropout": 0.0,
        # both spellings: transformers < 5 reads rope_theta, 5 reads rope_parameters
        "rope_theta": rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
    }
    if olmo2:
        config["rms_norm_eps"] = float(cfg.get("layer_norm_eps", 1e-5))
    else:
        config["clip_qkv"] = cfg.get("clip_qkv")
    generation = {"_from_model_config": True, "bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad}
    return HFModel(config, generation, tensors)


def _check_shapes(tensors: list[HFTensor], shapes: dict[str, tuple[int, ...]],
                  expected: dict[str, tuple[int, ...]]) -> None:
    for t in tensors:
        if t.source not in shapes:
            raise ExportError(f"the checkpoint has no {t.source} (needed for {t.key}); config.yaml describes "
                              f"another model, or this is not an OLMo checkpoint")
    for name, want in expected.items():
        if name in shapes and tuple(shapes[name]) != want:
            raise ExportError(f"{name} is {list(shapes[name])}, but config.yaml implies {list(want)}")
