"""DeepSpeed ZeRO checkpoints: shardstore against DeepSpeed's own `zero_to_fp32.py`, and against the disk.

    python benchmarks/deepspeed_bench.py [--out benchmarks/out] [--ds-python PATH]

Generates once (cached under --out/ckpt), with DeepSpeed's own engine in gloo processes
(tests/fixtures/deepspeed_zero.py, run by `--ds-python`, a Python with deepspeed 0.19.8 installed), a
~125M-parameter Qwen2-shaped model (untied embeddings: `zero_to_fp32.py --safe_serialization` fails on
tied ones) trained in bf16 and saved at W = 4 under ZeRO-2 and ZeRO-3: about 1.7 GB each (bf16 weights,
fp32 masters and two fp32 moments). For each, page cache dropped
before every run (bench.py's `timed`):
- the floor: `cp` + `sync` of the weights' bytes (shardstore's safetensors output, made first and kept:
  the same bytes read once and written once);
- `zero_to_fp32.py --safe_serialization` (the copy DeepSpeed puts in the checkpoint, run by --ds-python);
- `shardstore unshard --format safetensors` (the same output: fp32 weights as safetensors) and
  `--format hf` (plus config and tokenizer);
- `shardstore unshard --format torch` (weights, moments keyed by name, engine state).
Peak memory is both the largest process's (`/usr/bin/time`) and, sampled from /proc every 20 ms, all
the processes of the command together (the coordinator and its workers).
Also the CLI's own start-up (`shardstore --version`, caches warm). shardstore is byte-compiled first, as
an installed copy is. Each contender runs --repeat times (default 5), in turn, and its median is
reported (single runs on this disk vary by ±0.4 s). It prints a
markdown table and writes deepspeed.json to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench import compile_shardstore, timed, timed_tree  # noqa: E402

# untied: `zero_to_fp32.py --safe_serialization` fails on tied embeddings (safetensors refuses shared tensors)
DIMS = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
        "num_attention_heads": 12, "num_key_value_heads": 4, "tie_word_embeddings": False}
WORLD = 4
TAG = "global_step2"


def _generate(ckpt: Path, kind: str, ds_python: str) -> None:
    if (ckpt / "latest").exists():
        return
    code = ("import sys; from tests.fixtures.deepspeed_zero import make_deepspeed_checkpoint as m; "
            f"m(sys.argv[1], {WORLD}, {kind!r}, {DIMS!r})")
    subprocess.run([ds_python, "-c", code, str(ckpt)], check=True, cwd=HERE.parent)


def _startup() -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "shardstore", "--version"], check=True, capture_output=True)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--ds-python", default="/tmp/venvds/bin/python")
    ap.add_argument("--repeat", type=int, default=5)
    run(ap.parse_args())


def run(args: argparse.Namespace) -> None:
    """The DeepSpeed rows (`args`: out, ds_python, repeat); also `bench.py --deepspeed PY`."""
    compile_shardstore()
    report = {"world": WORLD, "startup": _startup(), "stages": {}}
    for kind in ("z2-bf16", "z3-bf16"):
        ckpt = args.out / "ckpt" / f"deepspeed-qwen2-125m-{kind}-w{WORLD}"
        _generate(ckpt, kind, args.ds_python)
        tag = ckpt / TAG
        total = sum(p.stat().st_size for p in tag.iterdir())
        work, kept = args.out / "deepspeed-work", args.out / "deepspeed-weights"
        shardstore = [sys.executable, "-m", "shardstore", "unshard", str(ckpt)]
        shutil.rmtree(kept, ignore_errors=True)
        subprocess.run([*shardstore, str(kept), "-q"], check=True)
        runs = {
            "floor: `cp` + `sync` of the weights' bytes": ["sh", "-c", f"mkdir -p {work}/cp && cp "
                                                                      f"{kept}/model.safetensors {work}/cp/ && sync"],
            "`zero_to_fp32.py --safe_serialization`": [args.ds_python, str(ckpt / "zero_to_fp32.py"), str(ckpt),
                                                       str(work / "z2f"), "--safe_serialization"],
            "shardstore `unshard --format safetensors`": [*shardstore, str(work / "st"), "-q"],
            "shardstore `unshard --format hf`": [*shardstore, str(work / "hf"), "--format", "hf", "-q"],
            "shardstore `unshard --format torch` (weights + moments)": [*shardstore, str(work / "torch"),
                                                                        "--format", "torch", "-q"],
        }
        walls: dict[str, list[float]] = {name: [] for name in runs}
        rsses: dict[str, list[int]] = {name: [] for name in runs}
        trees: dict[str, int] = {}
        for _ in range(args.repeat):
            for name, cmd in runs.items():
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                wall, rss, _ = timed(cmd, env={"DS_ACCELERATOR": "cpu"})
                walls[name].append(wall)
                rsses[name].append(rss)
                print(f"{kind} {name}: {wall:.2f} s, {rss / 2**20:.0f} MB", flush=True)
        for name, cmd in runs.items():  # once more, sampled: every process of the command together
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            trees[name] = timed_tree(cmd, env={"DS_ACCELERATOR": "cpu"})[1]
        results = [{"contender": name, "wall": statistics.median(walls[name]), "walls": walls[name],
                    "peak_rss": max(rsses[name]), "peak_tree_rss": trees[name]} for name in runs]
        shutil.rmtree(work, ignore_errors=True)
        report["stages"][kind] = {"total_bytes": total, "weights_bytes": (kept / "model.safetensors").stat().st_size,
                                  "results": results}
        shutil.rmtree(kept, ignore_errors=True)
    print(f"\nCLI start-up (`shardstore --version`, warm): {report['startup']:.2f} s")
    for kind, stage in report["stages"].items():
        results = stage["results"]
        floor, contender = results[0]["wall"], results[1]["wall"]
        print(f"\n{kind} at W={WORLD}: {stage['total_bytes'] / 1e9:.2f} GB, weights {stage['weights_bytes'] / 1e9:.2f} GB\n")
        print("| contender | wall | vs `zero_to_fp32` | vs floor + start-up | peak RSS | all processes |\n"
              "|---|---:|---:|---:|---:|---:|")
        for r in results:
            print(f"| {r['contender']} | {r['wall']:.2f} s | {contender / r['wall']:.2f}× | "
                  f"{r['wall'] / (floor + report['startup']):.2f}× | {r['peak_rss'] / 2**20:.0f} MB | "
                  f"{r['peak_tree_rss'] / 2**20:.0f} MB |")
    (args.out / "deepspeed.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
