"""The tools users have today for a Megatron-Core DeepSeek-V3-style torch_dist checkpoint, in one process:
torch's own DCP loading of every item into memory (what `dcp_to_torch_save` reads, without its
intermediate file), then the Hugging Face DeepseekV3 mapping Megatron-Bridge uses (deepseek/common.py:
MLA renamed, each fc1 split into gate and up, the stacked experts split per expert, the router's
expert_bias as e_score_correction_bias, the MTP layer as model.layers.{N}), one safetensors file.

    python benchmarks/megatron_moe_dcp_to_hf.py ITER_FOLDER OUT_FOLDER NUM_LAYERS
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "decoder.final_layernorm.weight": "model.norm.weight",
       "output_layer.weight": "lm_head.weight"}
LAYER = {"input_layernorm.weight": "input_layernorm.weight", "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
         "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
         "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
         "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
         "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
         "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
         "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
         "self_attention.linear_proj.weight": "self_attn.o_proj.weight", "mlp.router.weight": "mlp.gate.weight",
         "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias", "mlp.linear_fc2.weight": "mlp.down_proj.weight",
         "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight"}
MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "final_layernorm.weight": "shared_head.norm.weight"}


def layer(pre: str, rest: str, value: torch.Tensor, hf: dict[str, torch.Tensor]) -> None:
    """One decoder (or MTP transformer) layer's tensor under its Hugging Face names."""
    if rest in LAYER:
        hf[pre + LAYER[rest]] = value
    elif rest in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
        gate, up = value.chunk(2)  # torch_dist's fc1 is [gate of every TP rank; up of every TP rank]
        mlp = pre + rest.removesuffix("linear_fc1.weight")
        hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"] = gate.clone(), up.clone()
    elif rest == "mlp.experts.experts.linear_fc1.weight":  # (experts, 2F, H)
        for e, weight in enumerate(value):
            gate, up = weight.chunk(2)
            hf[f"{pre}mlp.experts.{e}.gate_proj.weight"], hf[f"{pre}mlp.experts.{e}.up_proj.weight"] = gate.clone(), up.clone()
    elif rest == "mlp.experts.experts.linear_fc2.weight":
        for e, weight in enumerate(value):
            hf[f"{pre}mlp.experts.{e}.down_proj.weight"] = weight.clone()
    else:
        raise KeyError(pre + rest)


def main() -> None:
    src, out, layers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    hf: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key in TOP:
            hf[TOP[key]] = value
        elif m := re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", key):
            layer(f"model.layers.{m.group(1)}.", m.group(2), value, hf)
        elif m := re.fullmatch(r"mtp\.layers\.(\d+)\.transformer_layer\.(.*)", key):
            layer(f"model.layers.{layers + int(m.group(1))}.", m.group(2), value, hf)
        elif m := re.fullmatch(r"mtp\.layers\.(\d+)\.(.*)", key):
            hf[f"model.layers.{layers + int(m.group(1))}.{MTP[m.group(2)]}"] = value
        else:
            raise KeyError(key)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf, out / "model.safetensors")


if __name__ == "__main__":
    main()
