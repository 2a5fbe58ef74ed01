"""A Hugging Face model into a Megatron-Core torch_dist checkpoint, and into torchtitan's DCP: shardstore
against the disk, and against the paths the tools users have take (load the model with transformers, map
its tensors, `dist_checkpointing.save` in one process; torchtitan's convert_from_hf) where they install.

    python benchmarks/to_megatron_bench.py [--out benchmarks/out] [--hidden 2048] [--layers 22] [--pairs 5]
        [--megatron-python PY] [--titan-python PY]

Generates once (cached under --out/ckpt) a Llama-shaped Hugging Face folder in bfloat16 (random weights,
safetensors shards of 1 GB, config.json), 2.25 GB at the defaults. Then it runs each contender `--pairs`
times, each run just after a `cp -r` + `sync` of the folder (bench.py's `compare_paired`: page cache dropped
before each run, the peak RSS of all processes together), and reports the median of the paired ratios:
- `cp -r` + `sync` of the folder: the floor (every byte read once and written once);
- `shardstore unshard HF OUT --format megatron`;
- with `--megatron-python PY` (a Python with megatron-core: tests/fixtures/megatron_core.py says how),
  transformers' load of the model and megatron-core's `dist_checkpointing.save` of its tensors under
  Megatron's names in one process (benchmarks/hf_to_megatron_baseline.py);
- `shardstore unshard HF OUT --format dcp --names torchtitan`;
- with `--titan-python PY` (a Python with torchtitan 0.3.0), torchtitan's own convert_from_hf path: its model
  built, loaded through torch's HuggingFaceStorageReader, `from_hf`, `dcp.save`
  (benchmarks/hf_to_torchtitan_baseline.py).
It prints a markdown table (each baseline's speed-up is the ratio of its paired median to shardstore's)
and writes to_megatron.json to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import compare_paired, compile_shardstore, print_table  # noqa: E402

VOCAB = 32000


def make_hf(out: Path, hidden: int, layers: int) -> Path:
    """A Llama-shaped model's Hugging Face folder (bfloat16, 1 GB shards), written once."""
    import torch
    from safetensors.torch import save_file

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    heads, groups, ffn = hidden // 128, max(1, hidden // 512), hidden * 11 // 4
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (VOCAB, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({f"{p}self_attn.q_proj.weight": (hidden, hidden), f"{p}self_attn.k_proj.weight": (groups * 128, hidden),
                       f"{p}self_attn.v_proj.weight": (groups * 128, hidden), f"{p}self_attn.o_proj.weight": (hidden, hidden),
                       f"{p}mlp.gate_proj.weight": (ffn, hidden), f"{p}mlp.up_proj.weight": (ffn, hidden),
                       f"{p}mlp.down_proj.weight": (hidden, ffn), f"{p}input_layernorm.weight": (hidden,),
                       f"{p}post_attention_layernorm.weight": (hidden,)})
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if size + t.numel() * 2 > 1 << 30 and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, tmp / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
        "num_attention_heads": heads, "num_key_value_heads": groups, "num_hidden_layers": layers, "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu", "dtype": "bfloat16"}))
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--pairs", type=int, default=5, help="runs of each contender, each after one of the floor")
    ap.add_argument("--megatron-python", default=None)
    ap.add_argument("--titan-python", default=None)
    args = ap.parse_args()
    compile_shardstore()
    out = Path(args.out)
    hf = make_hf(out / "ckpt" / f"hf-llama-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    work = out / "to-megatron"
    size = sum(f.stat().st_size for f in hf.iterdir())
    runs = {"cp -r + sync": ["cp", "-r", str(hf), str(work / "copy")],
            "shardstore --format megatron": [sys.executable, "-m", "shardstore", "unshard", str(hf), str(work / "meg"),
                                             "--format", "megatron", "--quiet"]}
    if args.megatron_python:
        runs["transformers load + dist_checkpointing.save"] = [args.megatron_python, str(HERE / "hf_to_megatron_baseline.py"),
                                                               str(hf), str(work / "baseline")]
    runs["shardstore --format dcp --names torchtitan"] = [sys.executable, "-m", "shardstore", "unshard", str(hf),
                                                          str(work / "titan"), "--format", "dcp", "--names",
                                                          "torchtitan", "--quiet"]
    if args.titan_python:
        runs["torchtitan convert_from_hf"] = [args.titan_python, str(HERE / "hf_to_torchtitan_baseline.py"), str(hf),
                                              str(work / "titan-baseline")]
    results = compare_paired({name: ["sh", "-c", " ".join(cmd) + " && sync"] for name, cmd in runs.items()}, work,
                             args.pairs)
    print_table(results, "`cp -r` + `sync` (paired)", "peak RSS, all processes")
    ratio = {r["contender"]: r["ratio"] for r in results}
    for ours, theirs in (("shardstore --format megatron", "transformers load + dist_checkpointing.save"),
                         ("shardstore --format dcp --names torchtitan", "torchtitan convert_from_hf")):
        if theirs in ratio:
            print(f"{ours}: {ratio[theirs] / ratio[ours]:.1f}x faster than {theirs}")
    (out / "to_megatron.json").write_text(json.dumps({"bytes": size, "results": results}, indent=1))


if __name__ == "__main__":
    main()
