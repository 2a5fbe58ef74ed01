"""`shardstore verify` against the floor: reading the checkpoint and the output once each.

    python benchmarks/verify_bench.py [--d-model 1024] [--layers 8] [--world 8] [--out benchmarks/out]

Generates once (cached under --out/ckpt) an OLMo-like checkpoint of `--world` rank files
(benchmarks/synth.py: fp32 parameters and AdamW moments), its safetensors export (`shardstore
unshard`) and a wholly different output of the same names and shapes (the export with every byte's top
bit flipped, so every element differs: what an export of another step or seed is to verify), then
times, page cache dropped before each, RSS summed over all processes (bench.py's `timed_tree`):
- `cat` of the rank files and of the export to /dev/null: reading both once, the floor;
- `shardstore verify` of the export against the checkpoint (equal: exit 0);
- `shardstore verify` of the different output (every element differs: exit 1, one line per tensor).
Prints a markdown table (wall and CPU seconds: on shared cores the CPU time is the steadier measure)
and writes verify.json to --out.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench import compile_shardstore, drop_caches, timed_tree  # noqa: E402
from synth import ModelSpec, generate  # noqa: E402


def _children_cpu() -> float:
    """User + system CPU seconds of every finished child process and what it waited for: a contender's
    work, whatever else shares the machine's cores (its wall time is not)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def flipped(export: Path, out: Path) -> None:
    """`export` (one safetensors file) with every byte of its tensors' data XORed with 0x80, header kept:
    the same names, dtypes and shapes, every element different. Streamed in 16 MiB blocks."""
    out.mkdir(parents=True, exist_ok=True)
    with open(export, "rb") as src, open(out / ".model.safetensors.tmp", "wb") as dst:
        head = src.read(8)
        dst.write(head + src.read(int.from_bytes(head, "little")))
        while block := src.read(16 << 20):
            dst.write(np.bitwise_xor(np.frombuffer(block, dtype=np.uint8), 0x80).tobytes())
    (out / ".model.safetensors.tmp").rename(out / "model.safetensors")


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
    different = args.out / "ckpt" / f"{name}-different"
    if not (different / "model.safetensors").exists():
        flipped(export / "model.safetensors", different)
    compile_shardstore()
    files = sorted(str(p) for p in ckpt.glob("rank*.pt")) + [str(export / "model.safetensors")]
    size = sum(Path(f).stat().st_size for f in files)
    rows = []
    verify = [sys.executable, "-m", "shardstore", "verify", str(ckpt)]
    for contender, cmd in [("cat (checkpoint + export) > /dev/null", ["sh", "-c", f"cat {' '.join(files)} > /dev/null"]),
                           ("shardstore verify (equal export)", verify + [str(export)]),
                           # exit 1 (differences found) is its success: anything else fails the run
                           ("shardstore verify (every element differs)",
                            ["sh", "-c", '"$@"; [ $? -eq 1 ]', "sh", *verify, str(different)])]:
        drop_caches()  # here, so that its `sync` is not counted in the contender's CPU time
        before = _children_cpu()
        wall, rss = timed_tree(cmd, cold=False)
        rows.append({"contender": contender, "wall_s": wall, "cpu_s": _children_cpu() - before,
                     "peak_rss_mb": rss / 2**20, "gb_s": size / wall / 1e9})
    floor = rows[0]["wall_s"]
    print(f"{name}: {size / 1e9:.2f} GB read by each contender\n")
    print("| contender | wall s | CPU s | GB/s | peak RSS MB | vs reading both once |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['contender']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['gb_s']:.2f} | {r['peak_rss_mb']:.0f} | "
              f"{r['wall_s'] / floor:.2f}x |")
    print(f"\nevery element differs / equal export: {rows[2]['wall_s'] / rows[1]['wall_s']:.2f}x wall, "
          f"{rows[2]['cpu_s'] / rows[1]['cpu_s']:.2f}x CPU")
    (args.out / "verify.json").write_text(json.dumps({"checkpoint": name, "bytes": size, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
