"""`shardstore verify` against the floor: reading the checkpoint and the output once each.

    python benchmarks/verify_bench.py [--d-model 1024] [--layers 8] [--world 8] [--out benchmarks/out]

Generates once (cached under --out/ckpt) an OLMo-like checkpoint of `--world` rank files
(benchmarks/synth.py: fp32 parameters and AdamW moments) and its safetensors export (`shardstore
unshard`), then times, page cache dropped before each, RSS summed over all processes (bench.py's
`timed_tree`):
- `cat` of the rank files and of the export to /dev/null: reading both once, the floor;
- `shardstore verify` of the export against the checkpoint.
Prints a markdown table and writes verify.json to --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench import compile_shardstore, timed_tree  # noqa: E402
from synth import ModelSpec, generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()
    name = f"olmo-d{args.d_model}-l{args.layers}-w{args.world}"
    ckpt = args.out / "ckpt" / name
    if not (ckpt / f"rank{args.world - 1}.pt").exists():
        generate(ckpt, args.world, ModelSpec(args.d_model, args.layers))
    export = args.out / "ckpt" / f"{name}-safetensors"
    if not (export / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "shardstore", "unshard", str(ckpt), str(export), "-q"], check=True)
    compile_shardstore()
    files = sorted(str(p) for p in ckpt.glob("rank*.pt")) + [str(export / "model.safetensors")]
    size = sum(Path(f).stat().st_size for f in files)
    rows = []
    for contender, cmd in [("cat (checkpoint + export) > /dev/null", ["sh", "-c", f"cat {' '.join(files)} > /dev/null"]),
                           ("shardstore verify", [sys.executable, "-m", "shardstore", "verify", str(ckpt), str(export)])]:
        wall, rss = timed_tree(cmd)
        rows.append({"contender": contender, "wall_s": wall, "peak_rss_mb": rss / 2**20, "gb_s": size / wall / 1e9})
    floor = rows[0]["wall_s"]
    print(f"{name}: {size / 1e9:.2f} GB read by each contender\n")
    print("| contender | wall s | GB/s | peak RSS MB | vs reading both once |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['contender']} | {r['wall_s']:.2f} | {r['gb_s']:.2f} | {r['peak_rss_mb']:.0f} | "
              f"{r['wall_s'] / floor:.2f}x |")
    (args.out / "verify.json").write_text(json.dumps({"checkpoint": name, "bytes": size, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
