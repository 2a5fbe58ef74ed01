"""Megatron-Core GPT models as transformers' Llama-family classes (LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM, Qwen3ForCausalLM, their MoE forms), or as DeepseekV3ForCausalLM (multi-latent attention:
`deepseek.py`) or GptOssForCausalLM (learnable attention sinks, every layer's experts stacked: `gpt_oss.py`),
named by the Hugging Face config.json the user gives.

Megatron keeps attention's q, k and v in one `linear_qkv` whose rows are grouped by query group: for
each of the `num_key_value_heads` groups, its heads' q rows, then its k rows, then its v rows (a plain
q|k|v split gives wrong logits). Each of q, k and v is therefore a list of row blocks, one per group,
streamed one after another. SwiGLU's `linear_fc1` is [gate; up]. The vocabulary is padded to a multiple
Megatron chose: the embedding's and the output layer's rows past `vocab_size` are dropped. Norms live
inside the next linear layer under Transformer Engine's names (`linear_qkv.layer_norm_weight`), or as
modules of their own (`input_layernorm`, `pre_mlp_layernorm`). A tensor of the checkpoint the table does
not place is refused by name, never dropped silently; `_extra_state` values are Megatron's own.
"""

from __future__ import annotations

from typing import Any

from ...errors import ExportError
from ...patterns import digits
from . import deepseek, gpt_oss, megatron_lora
from .megatron_llama import (DEEPSEEK_V3, EMBEDDING, FINAL_NORM, GPT_OSS, MOE, NORMS, OUTPUT, QWEN2_MOE, QWEN3,
                             QWEN3_MOE, glu, llama_config, need, with_defaults)
from .spec import HFModel, HFTensor

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", QWEN3, MOE, QWEN3_MOE, QWEN2_MOE,
                 DEEPSEEK_V3, GPT_OSS)
# each MoE class's hub names: (the block, its experts' count in the config, the experts' width in the config,
# the names of an expert's gate, up and down projections)
MOE_BLOCKS = {MOE: ("block_sparse_moe.", "num_local_experts", "intermediate_size", ("w1", "w3", "w2")),
              QWEN3_MOE: ("mlp.", "num_experts", "moe_intermediate_size", ("gate_proj", "up_proj", "down_proj")),
              QWEN2_MOE: ("mlp.", "num_experts", "moe_intermediate_size", ("gate_proj", "up_proj", "down_proj"))}
# a config naming only its model type (what `LlamaConfig(...).save_pretrained()` writes): the class transformers'
# Auto classes load for it
BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3": QWEN3, "mixtral": MOE, "qwen3_moe": QWEN3_MOE, "qwen2_moe": QWEN2_MOE,
                 "deepseek_v3": DEEPSEEK_V3, "gpt_oss": GPT_OSS}


def is_megatron(names: list[str]) -> bool:
    """Whether a model's names are Megatron-Core's GPT names (an adapter-only save's: its adapters')."""
    return (EMBEDDING in names or megatron_lora.has_adapters(names)) and any(n.startswith("decoder.layers.")
                                                                           for n in names)


def plan(config: dict[str, Any], names: list[str], shapes: dict[str, tuple[int, ...]], where: str,
         files: dict[str, bytes]) -> HFModel:
    """The HF model a Megatron GPT checkpoint is, under `config` (a config.json's contents); with LoRA
    adapters, under the names peft gives it (`megatron_lora`): of an adapter-only save, its adapted
    modules alone."""
    adapters, names, shapes = megatron_lora.split(names, shapes)
    partial = adapters is not None and adapters.adapter_only
    arch = (config.get("architectures") or [None])[0]
    if arch is None and isinstance(config.get("model_type"), str):
        arch = BY_MODEL_TYPE.get(config["model_type"], f"model_type {config['model_type']}")
    if arch not in ARCHITECTURES:
        raise ExportError(f"{where}: architecture {arch!r:.60}; a Megatron checkpoint is exported as one of "
                          f"{', '.join(ARCHITECTURES)} (or a config of model_type "
                          f"{', '.join(BY_MODEL_TYPE)})")
    config = with_defaults(config, arch)
    hidden, heads = need(config, "hidden_size", where), need(config, "num_attention_heads", where)
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    layers = need(config, "num_hidden_layers", where)
    # (an adapter-only save maps no embedding: the vocabulary is not needed)
    vocab = config.get("vocab_size") if partial and type(config.get("vocab_size")) is int else \
        None if partial else need(config, "vocab_size", where)
    ffn = need(config, "intermediate_size", where)
    if type(groups) is not int or heads % groups or type(head_dim) is not int or head_dim <= 0:
        raise ExportError(f"{where}: {heads} heads in {groups!r:.20} key-value groups of {head_dim!r:.20}")
    have = sorted({int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.") and digits(n.split(".")[2])})
    if have != list(range(layers)) and not (partial and set(have) <= set(range(layers))):
        raise ExportError(f"{where}: num_hidden_layers is {layers}, the checkpoint has layers {have[:8]}"
                          f"{' ...' if len(have) > 8 else ''}")
    q_rows, per_group = heads // groups * head_dim, (heads // groups + 2) * head_dim
    splits = {"q_proj": tuple((g * per_group, g * per_group + q_rows) for g in range(groups)),
              "k_proj": tuple((g * per_group + q_rows, g * per_group + q_rows + head_dim) for g in range(groups)),
              "v_proj": tuple((g * per_group + q_rows + head_dim, (g + 1) * per_group) for g in range(groups))}
    placed: set[str] = set()
    tensors: list[HFTensor] = []

    def take(key: str, source: str | tuple[str, ...], rows: tuple[tuple[int, int], ...] | None = None,
             shape: tuple[int, ...] | None = None, interleave: int = 1, transpose: bool = False) -> None:
        """`key` from `source`, or from several stacked (HFTensor.stacked), each of `shape`; of an
        adapter-only save, only what it adapts."""
        if partial and not all(one in shapes for one in ((source,) if isinstance(source, str) else source)):
            return
        for one in (source,) if isinstance(source, str) else source:
            if one not in shapes:
                raise ExportError(f"{one}: not in the checkpoint, but {key} needs it")
            if shape is not None and tuple(shapes[one][:len(shape)]) != shape:
                raise ExportError(f"{one}: shape {list(shapes[one])}, the config makes it {list(shape)} "
                                  f"(a config of another model?)")
            placed.add(one)
        tensors.append(HFTensor(key, source, rows) if isinstance(source, str) else
                       HFTensor.stacked(key, source, interleave, transpose))

    def vocab_rows(source: str) -> tuple[tuple[int, int], ...] | None:
        padded = shapes[source][0] if source in shapes else vocab
        if padded is None or vocab is None:
            return None
        if padded < vocab:
            raise ExportError(f"{source}: {padded} rows, fewer than vocab_size {vocab}")
        return None if padded == vocab else ((0, vocab),)

    def block(i: int, layer: str, hf: str) -> None:  # layer i's tensors, under Megatron's `layer` and HF's `hf`
        if arch == DEEPSEEK_V3:
            deepseek.attention(take, shapes, config, layer, hf, hidden, where)
            deepseek.mlp(take, config, i, layer, hf, hidden, where)
        else:
            for proj, rows in splits.items():
                take(f"{hf}self_attn.{proj}.weight", f"{layer}self_attention.linear_qkv.weight", rows,
                     (groups * per_group, hidden))
                if f"{layer}self_attention.linear_qkv.bias" in shapes:  # Qwen2's
                    take(f"{hf}self_attn.{proj}.bias", f"{layer}self_attention.linear_qkv.bias", rows)
            take(f"{hf}self_attn.o_proj.weight", f"{layer}self_attention.linear_proj.weight", None,
                 (hidden, heads * head_dim))
        if arch in (QWEN3, QWEN3_MOE):  # one norm over each head's features, shared by the heads (qk_layernorm)
            take(f"{hf}self_attn.q_norm.weight", f"{layer}self_attention.q_layernorm.weight", None, (head_dim,))
            take(f"{hf}self_attn.k_norm.weight", f"{layer}self_attention.k_layernorm.weight", None, (head_dim,))
        if arch == GPT_OSS:  # its sinks, biases and experts (each of its four tensors stacked from every expert's)
            gpt_oss.layer(take, shapes, config, layer, hf, hidden, where)
        elif arch in MOE_BLOCKS:  # the hub's names (what transformers and every engine load)
            prefix, count, width, projections = MOE_BLOCKS[arch]
            experts, moe, expert_ffn = need(config, count, where), f"{hf}{prefix}", need(config, width, where)
            take(f"{moe}gate.weight", f"{layer}mlp.router.weight", None, (experts, hidden))
            for e in range(experts):
                glu(take, f"{moe}experts.{e}.", f"{layer}mlp.experts.local_experts.{e}.", projections, expert_ffn,
                     hidden)
            if arch == QWEN2_MOE:
                shared = need(config, "shared_expert_intermediate_size", where)
                glu(take, f"{moe}shared_expert.", f"{layer}mlp.shared_experts.", ("gate_proj", "up_proj", "down_proj"),
                     shared, hidden)
                take(f"{moe}shared_expert_gate.weight", f"{layer}mlp.shared_experts.gate_weight", None, (1, hidden))
        elif arch != DEEPSEEK_V3:
            glu(take, f"{hf}mlp.", f"{layer}mlp.", ("gate_proj", "up_proj", "down_proj"), ffn, hidden)
        for key, candidates in NORMS.items():
            source = next((f"{layer}{c}" for c in candidates if f"{layer}{c}" in shapes), f"{layer}{candidates[0]}")
            take(f"{hf}{key}", source, None, (hidden,))

    take("model.embed_tokens.weight", EMBEDDING, vocab_rows(EMBEDDING), (shapes.get(EMBEDDING, (0,))[0], hidden))
    for i in range(layers):
        block(i, f"decoder.layers.{i}.", f"model.layers.{i}.")
    if arch == DEEPSEEK_V3:
        notes = deepseek.mtp(take, shapes, config, layers, hidden, where, block)
    take("model.norm.weight", FINAL_NORM, None, (hidden,))
    tied = bool(config.get("tie_word_embeddings", False))
    if OUTPUT in shapes and not tied:
        take("lm_head.weight", OUTPUT, vocab_rows(OUTPUT), (shapes[OUTPUT][0], hidden))
    elif OUTPUT not in shapes and not tied and not partial:
        raise ExportError(f"{where}: tie_word_embeddings is false, but the checkpoint has no {OUTPUT} (its "
                          f"embeddings are tied)")
    # a module's extra state is Megatron's own, not a weight (Transformer Engine's FP8 metadata: in
    # --ckpt-format torch an empty uint8 tensor without FP8)
    stray = sorted(n for n in shapes if n not in placed and not n.endswith("._extra_state"))
    if stray:
        raise ExportError(f"{stray[0]}: a tensor {arch} has no place for (a Megatron feature transformers cannot "
                          f"express, or a config of another model)")
    model = HFModel(config, None, tensors, files, notes if arch == DEEPSEEK_V3 else [])
    return model if adapters is None else megatron_lora.peft_named(model, adapters)


def config_from_args(args: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """A Hugging Face config from Megatron-LM's `args` (its common state), and what the user should know:
    GptOss's for a model with learnable attention sinks, DeepseekV3's for multi-latent attention, else the
    Llama family's."""
    if args.get("softmax_type") == "learnable":
        return gpt_oss.config_from_args(args, where)
    config, notes = llama_config(args, where)
    if args.get("multi_latent_attention"):
        return {**config, **deepseek.config_from_args(args, where)}, notes
    return config, notes


# Megatron-Core's TransformerConfig fields (NeMo 2's context/model.yaml, Megatron-Bridge's run_config.yaml)
# -> Megatron-LM's argument names, which config_from_args reads
CONFIG_ARGS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
             "num_attention_heads": "num_attention_heads", "num_query_groups": "num_query_groups",
             "kv_channels": "kv_channels", "normalization": "normalization", "layernorm_epsilon": "norm_epsilon",
             "add_bias_linear": "add_bias_linear", "add_qkv_bias": "add_qkv_bias",
             "position_embedding_type": "position_embedding_type", "rotary_base": "rotary_base",
             "rotary_percent": "rotary_percent", "seq_length": "max_position_embeddings",
             "qk_layernorm": "qk_layernorm",
             # the MoE's fields and DeepSeek's (multi-latent attention, its YaRN, multi-token prediction)
             **{k: k for k in ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_score_function",
                               "moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_router_num_groups",
                               "moe_router_group_topk", "moe_router_topk_scaling_factor",
                               "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                               "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                               "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale",
                               "mscale_all_dim", "original_max_position_embeddings", "beta_fast", "beta_slow",
                               "mtp_num_layers", "mtp_use_repeated_layer")},
             "num_moe_experts": "num_experts"}


def args_from_yaml(raw: bytes, vocab: int | None, where: str, section: str = "config") -> dict[str, Any]:
    """Megatron-LM's arguments for the model a YAML file's TransformerConfig `section` describes (NeMo 2's
    context/model.yaml's `config`, Megatron-Bridge's run_config.yaml's `model`), read as plain YAML (fiddle's
    and Bridge's callables are `{_target_: name}` mappings, never imported); `vocab` is the embedding's rows."""
    import yaml

    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ExportError(f"{where}: not YAML ({str(exc).splitlines()[0][:80]}); give --hf-config") from None
    config = doc.get(section) if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        raise ExportError(f"{where}: holds no model config (a `{section}:` mapping); give --hf-config")
    args = {name: config[key] for key, name in CONFIG_ARGS.items() if key in config}
    activation = config.get("activation_func")
    target = activation.get("_target_") if isinstance(activation, dict) else activation
    args["swiglu"] = bool(config.get("gated_linear_unit")) and str(target).endswith(".silu")
    args["group_query_attention"] = config.get("num_query_groups") is not None
    args["untie_embeddings_and_output_weights"] = not config.get("share_embeddings_and_output_weights", True)
    dtype = config.get("params_dtype")
    args["params_dtype"] = dtype.get("_target_") if isinstance(dtype, dict) else dtype
    args["padded_vocab_size"] = vocab
    if type(config.get("vocab_size")) is int:  # the tokenizer's (NeMo's importers write it): the rows kept
        args["vocab_size"] = config["vocab_size"]
    return args
