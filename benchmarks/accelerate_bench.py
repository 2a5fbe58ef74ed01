"""The HF Trainer's and Accelerate's FSDP checkpoints: shardstore against `accelerate merge-weights`, and
against the disk.

    python benchmarks/accelerate_bench.py --accelerate-python PY [--out benchmarks/out]

Generates once (cached under --out/ckpt) a `checkpoint-4/` of a ~200M-parameter Llama saved by
accelerate's own `save_fsdp_model`/`save_fsdp_optimizer` over 2 gloo processes (FSDP2;
tests/fixtures/accelerate_fsdp.py), `PY` being a Python with accelerate and transformers installed. Then
it times, page cache dropped before each, RSS summed over all processes (bench.py's `timed_tree`):
- `cp -r` + `sync` of the model's folder (`pytorch_model_fsdp_0/`);
- `accelerate merge-weights pytorch_model_fsdp_0 OUT` (torch's dcp_to_torch_save into memory, then one
  safetensors file);
- `shardstore unshard --format safetensors` (the model) and `--format torch` (model and optimizer).
It prints a markdown table and writes accelerate.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench import LLAMA_200M, compare, compile_shardstore, print_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--accelerate-python", required=True)
    args = ap.parse_args()
    run = args.out / "ckpt" / "accelerate-llama-200m-fsdp2-w2"
    if not (run / "checkpoint-4" / "optimizer_0" / ".metadata").exists():
        env = {**os.environ, "SHARDSTORE_ACCELERATE_CONFIG": json.dumps(LLAMA_200M)}
        subprocess.run([args.accelerate_python, "-m", "tests.fixtures.accelerate_fsdp", str(args.out / "ckpt"), "2"],
                       check=True, env=env, cwd=HERE.parent)
        (args.out / "ckpt" / "fsdp2-w2").rename(run)
        Path(args.out / "ckpt" / "fsdp2-w2.expected.pt.ref").unlink(missing_ok=True)
    compile_shardstore()  # as pip leaves an installed package
    model_dir = run / "checkpoint-4" / "pytorch_model_fsdp_0"
    model_bytes = sum(p.stat().st_size for p in model_dir.iterdir())
    total = model_bytes + sum(p.stat().st_size for p in (run / "checkpoint-4" / "optimizer_0").iterdir())
    work = args.out / "accelerate-work"
    merge = str(Path(args.accelerate_python).parent / "accelerate")
    shardstore = [sys.executable, "-m", "shardstore", "unshard", str(run / "checkpoint-4")]
    runs = {
        "`cp -r` + `sync` of the model's folder": ["sh", "-c", f"cp -r {model_dir} {work}/cp && sync"],
        "`accelerate merge-weights` (model)": [merge, "merge-weights", str(model_dir), str(work / "merged")],
        "shardstore `unshard` (safetensors, model)": [*shardstore, str(work / "st"), "-q"],
        "shardstore `unshard --format torch` (model + optimizer)": [*shardstore, str(work / "torch"), "--format",
                                                                    "torch", "-q"],
    }
    results = compare(runs, work)
    print(f"\nAccelerate FSDP2 W=2: model folder {model_bytes / 1e9:.2f} GB, with the optimizer {total / 1e9:.2f} GB\n")
    print_table(results, "`cp -r` + `sync`", "peak RSS, all processes")
    (args.out / "accelerate.json").write_text(json.dumps({"model_bytes": model_bytes, "total_bytes": total,
                                                          "config": LLAMA_200M, "results": results}, indent=1))


if __name__ == "__main__":
    main()
