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
- `shardstore unshard HF OUT --format megatron`, and `--format nemo` (the same tensors, NeMo 2's folder);
- with `--megatron-python PY` (a Python with megatron-core: tests/fixtures/megatron_core.py says how),
  transformers' load of the model and megatron-core's `dist_checkpointing.save` of its tensors under
  Megatron's names in one process (benchmarks/hf_to_megatron_baseline.py);
- `shardstore unshard HF OUT --format dcp --names torchtitan`;
- with `--titan-python PY` (a Python with torchtitan 0.3.0), torchtitan's own convert_from_hf path: its model
  built, loaded through torch's HuggingFaceStorageReader, `from_hf`, `dcp.save`
  (benchmarks/hf_to_torchtitan_baseline.py).
With `--deepseek`, the model is instead DeepSeek-V3's structure in the hub's FP8 form at a tiny width
(`make_deepseek`: 92k tensors in 64 MB), shardstore's two conversions alone: what per-tensor costs add.
With `--gpt-oss`, GPT-OSS-20b's tensors at its real width, 2 of its 24 layers, in the hub's MXFP4 form
(`make_gpt_oss`: 3.2 GB), `--format megatron` alone: what dequantizing its experts costs.
It prints a markdown table (each baseline's speed-up is the ratio of its paired median to shardstore's)
and writes to_megatron.json to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import compare_paired, compile_shardstore, print_table  # noqa: E402

VOCAB = 32000


def _write_hf(out: Path, shards: list[dict[str, Any]], config: dict[str, Any]) -> Path:
    """A Hugging Face folder of these safetensors shards, their index and config.json: written beside `out`
    and renamed into place, so that a folder with a config.json is whole."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, tmp / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(config))
    tmp.rename(out)
    return out


def make_hf(out: Path, hidden: int, layers: int) -> Path:
    """A Llama-shaped model's Hugging Face folder (bfloat16, 1 GB shards), written once."""
    import torch

    if (out / "config.json").exists():
        return out
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
    return _write_hf(out, shards, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
        "num_attention_heads": heads, "num_key_value_heads": groups, "num_hidden_layers": layers, "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu", "dtype": "bfloat16"})


# DeepSeek-V3's structure as its hub checkpoint stores it (config.json: 61 layers, first_k_dense_replace 3,
# 256 routed experts and 1 shared, MLA, one MTP layer as model.layers.61 with the hub's copies of the
# embedding and head, linear weights in FP8 e4m3 with a float32 weight_scale_inv per 128 x 128 block, 163
# safetensors files), at the width of benchmarks/megatron_moe_bench.py's: only the width is small.
DSV3_WIDTH = {"hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 144,
              "moe_intermediate_size": 16, "vocab_size": 1024}


def make_deepseek(out: Path, files: int = 163) -> Path:
    """A DeepSeek-V3-structured Hugging Face folder in the hub's FP8 form (random weights), written once."""
    import torch

    if (out / "config.json").exists():
        return out
    w = DSV3_WIDTH
    h, heads, layers = w["hidden_size"], w["num_attention_heads"], 61
    qk = w["qk_nope_head_dim"] + w["qk_rope_head_dim"]
    gen = torch.Generator().manual_seed(0)

    def fp8(rows: int, cols: int) -> dict[str, torch.Tensor]:
        raw = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0  # e4m3fn's NaNs
        scales = torch.rand((-(-rows // 128), -(-cols // 128)), generator=gen) * 1e-3
        return {"weight": raw.view(torch.float8_e4m3fn), "weight_scale_inv": scales}

    def linear(prefix: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{k}": v for k, v in fp8(rows, cols).items()}

    def bf16(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    def mlp(prefix: str, ffn: int) -> dict[str, torch.Tensor]:
        return {**linear(f"{prefix}.gate_proj", ffn, h), **linear(f"{prefix}.up_proj", ffn, h),
                **linear(f"{prefix}.down_proj", h, ffn)}

    def layer(i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": bf16(h), p + "post_attention_layernorm.weight": bf16(h),
             p + "self_attn.q_a_layernorm.weight": bf16(w["q_lora_rank"]),
             p + "self_attn.kv_a_layernorm.weight": bf16(w["kv_lora_rank"]),
             **linear(p + "self_attn.q_a_proj", w["q_lora_rank"], h),
             **linear(p + "self_attn.q_b_proj", heads * qk, w["q_lora_rank"]),
             **linear(p + "self_attn.kv_a_proj_with_mqa", w["kv_lora_rank"] + w["qk_rope_head_dim"], h),
             **linear(p + "self_attn.kv_b_proj", heads * (w["qk_nope_head_dim"] + w["v_head_dim"]), w["kv_lora_rank"]),
             **linear(p + "self_attn.o_proj", h, heads * w["v_head_dim"])}
        if i < 3:
            return {**t, **mlp(p + "mlp", w["intermediate_size"])}
        t.update({p + "mlp.gate.weight": bf16(256, h),
                  p + "mlp.gate.e_score_correction_bias": torch.randn(256, generator=gen),
                  **mlp(p + "mlp.shared_experts", w["moe_intermediate_size"])})
        for e in range(256):
            t.update(mlp(f"{p}mlp.experts.{e}", w["moe_intermediate_size"]))
        return t

    mtp = {**layer(layers), f"model.layers.{layers}.enorm.weight": bf16(h), f"model.layers.{layers}.hnorm.weight": bf16(h),
           f"model.layers.{layers}.eh_proj.weight": bf16(h, 2 * h),
           f"model.layers.{layers}.shared_head.norm.weight": bf16(h),
           f"model.layers.{layers}.shared_head.head.weight": bf16(w["vocab_size"], h),
           f"model.layers.{layers}.embed_tokens.weight": bf16(w["vocab_size"], h)}
    groups = [{"model.embed_tokens.weight": bf16(w["vocab_size"], h)}, *(layer(i) for i in range(layers)),
              mtp, {"model.norm.weight": bf16(h), "lm_head.weight": bf16(w["vocab_size"], h)}]
    per_file = -(-len(groups) // files)
    chunked = [{k: v for g in groups[i:i + per_file] for k, v in g.items()} for i in range(0, len(groups), per_file)]
    return _write_hf(out, chunked, {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **w, "num_hidden_layers": layers,
        "num_key_value_heads": heads, "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "rope_theta": 10000, "hidden_act": "silu",
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]}})


# GPT-OSS-20b's widths (the hub's config.json), and the layers of them written
GPT_OSS = {"hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088}
GPT_OSS_LAYERS = 2


def make_gpt_oss(out: Path, layers: int = GPT_OSS_LAYERS) -> Path:
    """GPT-OSS-20b's tensors at its real width, `layers` of its 24, in the hub's form (random values): each
    layer's experts MXFP4 blocks and scales (uint8), the rest bfloat16; a file per layer, written once."""
    import torch

    if (out / "config.json").exists():
        return out
    w = GPT_OSS
    h, heads, groups, d = w["hidden_size"], w["num_attention_heads"], w["num_key_value_heads"], w["head_dim"]
    experts, ffn = w["num_local_experts"], w["intermediate_size"]
    gen = torch.Generator().manual_seed(0)

    def bf16(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    def mxfp4(prefix: str, rows: int, columns: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}_blocks": torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=gen,
                                                  dtype=torch.uint8),
                f"{prefix}_scales": torch.randint(118, 126, (experts, rows, columns // 32), generator=gen,
                                                  dtype=torch.uint8)}

    def layer(i: int) -> dict[str, torch.Tensor]:
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        return {p + "input_layernorm.weight": bf16(h), p + "post_attention_layernorm.weight": bf16(h),
                a + "q_proj.weight": bf16(heads * d, h), a + "q_proj.bias": bf16(heads * d),
                a + "k_proj.weight": bf16(groups * d, h), a + "k_proj.bias": bf16(groups * d),
                a + "v_proj.weight": bf16(groups * d, h), a + "v_proj.bias": bf16(groups * d),
                a + "o_proj.weight": bf16(h, heads * d), a + "o_proj.bias": bf16(h), a + "sinks": bf16(heads),
                m + "router.weight": bf16(experts, h), m + "router.bias": bf16(experts),
                **mxfp4(m + "experts.gate_up_proj", 2 * ffn, h), m + "experts.gate_up_proj_bias": bf16(experts, 2 * ffn),
                **mxfp4(m + "experts.down_proj", h, ffn), m + "experts.down_proj_bias": bf16(experts, h)}

    shards = [{"model.embed_tokens.weight": bf16(w["vocab_size"], h)}, *(layer(i) for i in range(layers)),
              {"model.norm.weight": bf16(h), "lm_head.weight": bf16(w["vocab_size"], h)}]
    return _write_hf(out, shards, {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **w, "num_hidden_layers": layers,
        "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        "sliding_window": 128, "attention_bias": True, "rms_norm_eps": 1e-05, "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "max_position_embeddings": 131072, "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--pairs", type=int, default=5, help="runs of each contender, each after one of the floor")
    ap.add_argument("--megatron-python", default=None)
    ap.add_argument("--titan-python", default=None)
    ap.add_argument("--deepseek", action="store_true", help="instead: DeepSeek-V3's structure in the hub's FP8 form "
                    "(make_deepseek) into Megatron, and into torchtitan's DCP")
    ap.add_argument("--gpt-oss", action="store_true", help="instead: GPT-OSS-20b's tensors at its real width in the "
                    "hub's MXFP4 form (make_gpt_oss, 2 layers) into Megatron")
    args = ap.parse_args()
    compile_shardstore()
    out = Path(args.out)
    hf = make_deepseek(out / "ckpt" / "hf-dsv3-structure-fp8") if args.deepseek else \
        make_gpt_oss(out / "ckpt" / "hf-gpt-oss-20b-mxfp4-l2") if args.gpt_oss else \
        make_hf(out / "ckpt" / f"hf-llama-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    only_megatron = args.deepseek or args.gpt_oss  # (NeMo has no class for either written here; nor torchtitan
    # names for GPT-OSS)
    work = out / "to-megatron"
    size = sum(f.stat().st_size for f in hf.iterdir())
    runs = {"cp -r + sync": ["cp", "-r", str(hf), str(work / "copy")],
            "shardstore --format megatron": [sys.executable, "-m", "shardstore", "unshard", str(hf), str(work / "meg"),
                                             "--format", "megatron", "--quiet"]}
    if not only_megatron:
        runs["shardstore --format nemo"] = [sys.executable, "-m", "shardstore", "unshard", str(hf), str(work / "nemo"),
                                            "--format", "nemo", "--quiet"]
    if args.megatron_python and not only_megatron:
        runs["transformers load + dist_checkpointing.save"] = [args.megatron_python, str(HERE / "hf_to_megatron_baseline.py"),
                                                               str(hf), str(work / "baseline")]
    if not args.gpt_oss:
        runs["shardstore --format dcp --names torchtitan"] = [sys.executable, "-m", "shardstore", "unshard", str(hf),
                                                              str(work / "titan"), "--format", "dcp", "--names",
                                                              "torchtitan", "--quiet"]
    if args.titan_python and not only_megatron:
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
    name = "to_megatron_deepseek.json" if args.deepseek else "to_megatron_gpt_oss.json" if args.gpt_oss else \
        "to_megatron.json"
    (out / name).write_text(json.dumps({"bytes": size, "results": results}, indent=1))


if __name__ == "__main__":
    main()
