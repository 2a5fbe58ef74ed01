"""Merging a LoRA into its base, from an FSDP2 checkpoint: shardstore against peft's own merge.

    python benchmarks/peft_bench.py [--out benchmarks/out]

Generates once (cached under --out/ckpt) a DCP checkpoint of a PeftModel sharded by FSDP2 over 2 gloo
processes, as `Accelerator.save_state` saves one (the whole wrapped model: `base_layer` weights and the
adapter, `{"model": get_model_state_dict(model)}`): a Llama of 0.74 B parameters in fp32 (2.9 GB: hidden
2048, 12 layers, MLP 5504, vocabulary 32000) with a LoRA of r=64 on every attention and MLP projection,
its config.json and adapter_config.json beside. Then it times, page cache dropped before each, RSS
summed over all processes (bench.py's `timed_tree`):
- `cp -r` + `sync` of the checkpoint folder;
- peft's way: torch's `dcp_to_torch_save` gathers the checkpoint into one file, which is loaded into the
  PeftModel, merged by `merge_and_unload()` and written by `save_pretrained`;
- shardstore `unshard --format hf --merge-adapter`.
It prints a markdown table and writes peft.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import compare, compile_shardstore, print_table  # noqa: E402

CONFIG = {"hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 12, "num_attention_heads": 16,
          "num_key_value_heads": 16, "vocab_size": 32000, "max_position_embeddings": 2048,
          "tie_word_embeddings": False}
LORA = {"r": 64, "lora_alpha": 128, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                        "down_proj"], "lora_dropout": 0.0}

PEFT_MERGE = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
ckpt, work = sys.argv[1], sys.argv[2]
dcp_to_torch_save(ckpt, f"{work}/gathered.pt")
state = torch.load(f"{work}/gathered.pt", weights_only=True, mmap=True)["model"]
with torch.device("meta"):
    model = get_peft_model(LlamaForCausalLM(LlamaConfig.from_pretrained(ckpt)), LoraConfig.from_pretrained(ckpt))
model.load_state_dict(state, assign=True)
model.merge_and_unload().save_pretrained(f"{work}/merged")
"""


def _save(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**CONFIG)), LoraConfig(**LORA))
    with torch.no_grad():  # a trained adapter: B is not zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=out)
    if rank == 0:
        LlamaConfig(**CONFIG).save_pretrained(out)
        model.peft_config["default"].save_pretrained(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()
    ckpt = args.out / "ckpt" / "peft-llama-740m-r64-fsdp2-w2"
    if not (ckpt / "adapter_config.json").exists():
        mp.spawn(_save, args=(2, str(ckpt)), nprocs=2)
    compile_shardstore()  # as pip leaves an installed package
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    work = args.out / "peft-work"
    runs = {
        "`cp -r` + `sync` of the checkpoint": ["sh", "-c", f"cp -r {ckpt} {work}/cp && sync"],
        "peft: `dcp_to_torch_save`, `merge_and_unload`, `save_pretrained`":
            ["sh", "-c", f"mkdir -p {work}/peft && {sys.executable} -c '{PEFT_MERGE}' {ckpt} {work}/peft"],
        "shardstore `unshard --format hf --merge-adapter`":
            [sys.executable, "-m", "shardstore", "unshard", str(ckpt), str(work / "st"), "--format", "hf",
             "--merge-adapter", "-q"],
    }
    results = compare(runs, work)
    print(f"\nPeftModel under FSDP2, W=2: checkpoint {size / 1e9:.2f} GB\n")
    print_table(results, "`cp -r` + `sync`", "peak RSS, all processes")
    (args.out / "peft.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
