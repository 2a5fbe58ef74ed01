"""veRL checkpoints: shardstore against veRL's own merge, and against the disk.

    python benchmarks/verl_bench.py [--out benchmarks/out]

Generates once (cached under --out/ckpt) a veRL run of a ~200M-parameter Qwen2-shaped model saved as
veRL's checkpoint manager saves it (FSDP1 over a 1-D device mesh at world size 4, veRL's default, by real
gloo processes: tests/fixtures/verl.py), then times, page cache dropped before each (bench.py's `timed`):
- `cp -r` + `sync` of the four model files (what a model export has to read);
- veRL's merge (benchmarks/verl_merge.py: load every rank, concatenate, cast to bf16, save);
- `shardstore unshard --format hf` (fp32, the checkpoint's dtype) and with `--dtype bfloat16` (veRL's);
- `shardstore unshard --format torch` (model, optimizer and extra state).
It prints a markdown table and writes verl.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench import compare, print_table, timed  # noqa: E402

DIMS = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
        "num_attention_heads": 16, "num_key_value_heads": 4}
WORLD = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()
    ckpt = args.out / "ckpt" / f"verl-qwen2-200m-fsdp1-w{WORLD}"
    if not (ckpt / "latest_checkpointed_iteration.txt").exists():
        from tests.fixtures.verl import make_verl_checkpoint

        make_verl_checkpoint(ckpt, WORLD, "fsdp1", DIMS)
        Path(f"{ckpt}.expected.pt.ref").unlink(missing_ok=True)  # the gather, only the tests need it
    actor = ckpt / "global_step_7" / "actor"
    models = sorted(actor.glob("model_world_size_*"))
    model_bytes = sum(p.stat().st_size for p in models)
    total = sum(p.stat().st_size for p in actor.glob("*_world_size_*"))
    work = args.out / "verl-work"
    shardstore = [sys.executable, "-m", "shardstore", "unshard", str(ckpt)]
    runs = {
        "`cp` + `sync` of the model files": ["sh", "-c", f"mkdir -p {work}/cp && cp {' '.join(map(str, models))} "
                                                         f"{work}/cp/ && sync"],
        "veRL's merge (load all ranks, concatenate, bf16)": [sys.executable, str(HERE / "verl_merge.py"),
                                                               str(actor), str(work / "merge")],
        "shardstore `unshard --format hf` (fp32)": [*shardstore, str(work / "hf"), "--format", "hf", "-q"],
        "shardstore `unshard --format hf --dtype bfloat16`": [*shardstore, str(work / "hf16"), "--format", "hf",
                                                              "--dtype", "bfloat16", "-q"],
        "shardstore `unshard --format torch` (model + optimizer)": [*shardstore, str(work / "torch"), "--format",
                                                                    "torch", "-q"],
    }
    results = compare(runs, work, lambda cmd: timed(cmd)[:2])
    print(f"\nveRL run, FSDP1 W={WORLD}: model files {model_bytes / 1e9:.2f} GB, all rank files {total / 1e9:.2f} GB\n")
    print_table(results, "`cp` + `sync`", "peak RSS")
    (args.out / "verl.json").write_text(json.dumps({"model_bytes": model_bytes, "total_bytes": total,
                                                    "world": WORLD, "results": results}, indent=1))


if __name__ == "__main__":
    main()
