"""The tools users have today for a Megatron-Core torch_dist checkpoint, in one process (what slime's and
similar scripts do): torch's own DCP loading of every item into memory (`dcp_to_torch_save`'s reading,
without its intermediate file), then the per-layer Hugging Face mapping (q/k/v per query group, fc1 into
gate and up), one safetensors file.

    python benchmarks/megatron_dcp_to_hf.py ITER_FOLDER OUT_FOLDER HEADS GROUPS
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


def main() -> None:
    src, out, heads, groups = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    hf = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or key.startswith("optimizer."):
            continue
        m = re.fullmatch(r"decoder\.layers\.(.*)", key)
        if not m:
            name = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                    "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}[key]
            hf[name] = value
            continue
        for layer, weight in enumerate(value):  # layers stacked on the leading axis
            pre, rest = f"model.layers.{layer}.", m.group(1)
            if rest == "self_attention.linear_qkv.weight":
                per = weight.reshape(groups, -1, weight.shape[-1])
                head = weight.shape[-1] // heads
                q = per.shape[1] - 2 * head
                hf[pre + "self_attn.q_proj.weight"] = per[:, :q].reshape(-1, weight.shape[-1]).clone()
                hf[pre + "self_attn.k_proj.weight"] = per[:, q:q + head].reshape(-1, weight.shape[-1]).clone()
                hf[pre + "self_attn.v_proj.weight"] = per[:, q + head:].reshape(-1, weight.shape[-1]).clone()
            elif rest == "mlp.linear_fc1.weight":
                gate, up = weight.chunk(2)
                hf[pre + "mlp.gate_proj.weight"], hf[pre + "mlp.up_proj.weight"] = gate.clone(), up.clone()
            else:
                name = {"self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
                        "mlp.linear_fc2.weight": "mlp.down_proj.weight"}[rest]
                hf[pre + name] = weight.clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf, out / "model.safetensors")


if __name__ == "__main__":
    main()
