"""A Hugging Face model in torchtitan's names: where each transformers tensor goes in the state dict
torchtitan's own `StateDictAdapter.from_hf` gives (its checkpoints hold the model's keys at the top level,
so a DCP folder of them is what `--checkpoint.initial_load_path` loads, resharded to any world size).

Two things are more than a rename, both done as torchtitan does them:
- Llama's q and k: transformers keeps each head's rotary halves apart (the real parts, then the imaginary
  ones), torchtitan's complex rotary embedding takes them in pairs: its row `h*d + 2*i + j` is
  transformers' row `h*d + j*d/2 + i` (`_reverse_permute`). Written as rows picked in that order, so no
  tensor is held whole.
- DeepSeek-V3's routed experts: one [experts, rows, columns] tensor per projection and layer, each expert's
  weight a chunk of it at its index (`_concatenate_expert_weights` stacks them the same way).
Names are torchtitan 0.3's (whose state dict splits its fused qkv into `qkv_linear.wq`, `.wk`, `.wv`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...errors import ExportError
from .megatron_llama import DEEPSEEK_V3, need

Shape = tuple[int, ...]
Rows = tuple[tuple[int, int], ...]
LLAMA = "LlamaForCausalLM"
BUILT = (LLAMA, DEEPSEEK_V3)
VERSIONS = ("torchtitan",)  # the built-in names: torchtitan 0.3's
LAYER = re.compile(r"model\.layers\.([0-9]+)\.(.+)\Z")
EXPERT = re.compile(r"mlp\.experts\.([0-9]+)\.(gate|up|down)_proj\.weight\Z")


@dataclass(frozen=True)
class Chunk:
    """Transformers' tensor `hf` (its rows `rows`, one after another, where given) is the block of
    torchtitan's `target` at `offset` (an expert's index first, where the target stacks them)."""

    hf: str
    target: str
    offset: Shape
    rows: Rows | None = None


@dataclass(frozen=True)
class Renamed:
    """Each torchtitan tensor's global shape, the chunks that make it, and what was left out."""

    shapes: dict[str, Shape]
    chunks: tuple[Chunk, ...]
    notes: tuple[str, ...] = ()


# transformers' per-layer names -> torchtitan's, for both architectures (Llama's attention and MLP)
SHARED = {"self_attn.o_proj.weight": "attention.wo.weight",
          "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight",
          "mlp.down_proj.weight": "feed_forward.w2.weight",
          "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}
LAYER_NAMES = {
    LLAMA: {**SHARED, "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
            "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
            "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight"},
    # torchtitan's multi-latent attention (its wq where the model has no q LoRA), its MoE
    DEEPSEEK_V3: {**SHARED, "self_attn.q_proj.weight": "attention.wq.weight",
                  "self_attn.q_a_proj.weight": "attention.wq_a.weight",
                  "self_attn.q_a_layernorm.weight": "attention.q_norm.weight",
                  "self_attn.q_b_proj.weight": "attention.wq_b.weight",
                  "self_attn.kv_a_proj_with_mqa.weight": "attention.wkv_a.weight",
                  "self_attn.kv_a_layernorm.weight": "attention.kv_norm.weight",
                  "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
                  "mlp.gate.weight": "moe.router.gate.weight", "mlp.gate.e_score_correction_bias": "moe.expert_bias_E",
                  "mlp.shared_experts.gate_proj.weight": "moe.shared_experts.w1.weight",
                  "mlp.shared_experts.up_proj.weight": "moe.shared_experts.w3.weight",
                  "mlp.shared_experts.down_proj.weight": "moe.shared_experts.w2.weight"}}
# what every layer has, whatever its attention's and MLP's form
REQUIRED = {LLAMA: tuple(LAYER_NAMES[LLAMA]),
            DEEPSEEK_V3: ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                          "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight")}
# each routed expert's projection -> the [experts, rows, columns] tensor it is a chunk of
EXPERTS = {"gate": "moe.routed_experts.inner_experts.w1_EFD", "up": "moe.routed_experts.inner_experts.w3_EFD",
           "down": "moe.routed_experts.inner_experts.w2_EDF"}
MODEL_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
               "lm_head.weight": "lm_head.weight"}


def architecture(config: dict[str, Any], where: str) -> str:
    arch = (config.get("architectures") or [None])[0]
    if arch not in BUILT:
        raise ExportError(f"{where}: architecture {arch!r:.60} has no torchtitan names here; one of {', '.join(BUILT)}")
    return str(arch)


def rotary_rows(heads: int, head_dim: int) -> Rows:
    """transformers' rows of a q (k) weight of `heads` heads in the order torchtitan keeps them."""
    half = head_dim // 2
    return tuple((h * head_dim + j * half + i, h * head_dim + j * half + i + 1)
                 for h in range(heads) for i in range(half) for j in range(2))


def renamed(config: dict[str, Any], hf_shapes: dict[str, Shape], where: str) -> Renamed:
    """Where each of the transformers model's tensors (`hf_shapes`) goes among torchtitan's: a tensor
    torchtitan's adapter has no name for, or one its model needs and the files lack, refused by name; a
    multi-token-prediction layer (past `num_hidden_layers`: torchtitan's model is built without it) left
    out and said; an old save's rotary `inv_freq` buffers dropped, as torchtitan's adapter drops them."""
    arch = architecture(config, where)
    names = LAYER_NAMES[arch]
    layers = need(config, "num_hidden_layers", where)
    heads = need(config, "num_attention_heads", where)
    head_dim = config.get("head_dim") or need(config, "hidden_size", where) // heads
    groups = config.get("num_key_value_heads") or heads
    if head_dim % 2:
        raise ExportError(f"{where}: heads of {head_dim} dimensions; rotary embeddings pair them")
    shapes: dict[str, Shape] = {}
    chunks: list[Chunk] = []
    left_out: set[int] = set()
    experts: dict[str, list[int]] = {}

    def put(hf: str, target: str, rows: Rows | None = None) -> None:
        shapes[target] = hf_shapes[hf]
        chunks.append(Chunk(hf, target, (0,) * len(hf_shapes[hf]), rows))

    for key in sorted(hf_shapes):
        layer = LAYER.match(key)
        if layer is None:
            if key not in MODEL_NAMES:
                raise ExportError(f"{key}: torchtitan's {arch} has no tensor for it")
            put(key, MODEL_NAMES[key])
            continue
        index, rest = int(layer[1]), layer[2]
        if rest == "self_attn.rotary_emb.inv_freq":
            continue
        if index >= layers:
            left_out.add(index)
            continue
        expert = EXPERT.match(rest) if arch == DEEPSEEK_V3 else None
        if expert is not None:
            target = f"layers.{index}.{EXPERTS[expert[2]]}"
            shape = hf_shapes[key]
            experts.setdefault(target, []).append(int(expert[1]))
            if shapes.setdefault(target, (0, *shape))[1:] != shape:
                raise ExportError(f"{key}: shape {list(shape)}, unlike the layer's other experts")
            chunks.append(Chunk(key, target, (int(expert[1]), 0, 0)))
            continue
        if rest not in names:
            raise ExportError(f"{key}: torchtitan's {arch} has no tensor for it (a bias, or a module it does not "
                              f"build)")
        rows = None
        if arch == LLAMA and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            count = heads if "q_proj" in rest else groups
            if hf_shapes[key][0] != count * head_dim:
                raise ExportError(f"{key}: {hf_shapes[key][0]} rows, the config makes {count} heads of {head_dim}")
            rows = rotary_rows(count, head_dim)
        put(key, f"layers.{index}.{names[rest]}", rows)
    count = config.get("n_routed_experts")
    for target, found in experts.items():
        if sorted(found) != list(range(count or 0)):
            raise ExportError(f"{target}: experts {sorted(found)[:8]}{'...' if len(found) > 8 else ''} in the files, "
                              f"but n_routed_experts is {count!r:.20}")
        shapes[target] = (len(found), *shapes[target][1:])
    needed = ["model.embed_tokens.weight", "model.norm.weight"] + [f"model.layers.{i}.{name}" for i in range(layers) for name in REQUIRED[arch]]
    missing = next((key for key in needed if key not in hf_shapes), None)
    if missing is not None:
        raise ExportError(f"{missing}: not in the files, and torchtitan's {arch} loads it (a folder missing a file?)")
        shapes[target] = (len(found), *shapes[target][1:])
    if "lm_head.weight" not in hf_shapes:  # tied: torchtitan's state dict names the embedding under both
        put("model.embed_tokens.weight", MODEL_NAMES["lm_head.weight"])
    notes = (f"layers {sorted(left_out)} (past num_hidden_layers {layers}: multi-token prediction) left out; "
             f"torchtitan's model is built without them",) if left_out else ()
    return Renamed(shapes, tuple(chunks), notes)
