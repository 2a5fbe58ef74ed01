"""How cost grows: checkpoint size at a fixed world size, and world size at a fixed model.

    python benchmarks/sweep.py [--sizes 1,2,5,10,20] [--worlds 8,64,256,1024] [--out benchmarks/out] [--keep]

Two series of OLMo-like checkpoints (benchmarks/synth.py):
- size: W=8, models chosen so the rank files hold about 1, 2, 5, 10 and 20 GB (fp32 parameters and
  AdamW moments, 12 bytes per parameter);
- world size: one small model (d_model 320, 1 block: 0.21 GB of tensors) saved at each world size. Every
  rank file lists every rank's shard of every tensor, so the files grow with W (to 2 GB at W=1024) while
  the tensors do not: the point of this series is the cost of that metadata.

At each point, page cache dropped before each run (when root), it times `cp -r` + `sync` (the floor for a
durable copy) and `shardstore unshard` to torch (every tensor and value, one file) and to safetensors (the
model only), with the peak RSS summed over every process of the run (bench.timed_tree). It writes
sweep.json to --out, the plot to docs/img/sweep.png, and prints a markdown table. Checkpoints are deleted
after their point unless --keep (20 GB and its copy do not fit beside the rest).
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
from bench import compile_shardstore, timed_tree  # noqa: E402
from synth import ModelSpec, generate  # noqa: E402

# about 1, 2, 5, 10 and 20 GB of rank files at W=8 (12 bytes per parameter)
SIZES = {1: ModelSpec(1024, 2), 2: ModelSpec(1024, 9), 5: ModelSpec(1536, 12), 10: ModelSpec(2048, 15),
         20: ModelSpec(2048, 31)}
SMALL = ModelSpec(320, 1)


def contenders(ckpt: Path, work: Path) -> dict[str, list[str]]:
    shardstore = [sys.executable, "-m", "shardstore.cli", "unshard", str(ckpt)]
    return {"cp -r + sync": ["sh", "-c", f"cp -r {ckpt} {work / 'copy'} && sync"],
            "unshard torch": [*shardstore, str(work / "pt"), "--format", "torch", "-q"],
            "unshard safetensors": [*shardstore, str(work / "st"), "-q"]}


def point(series: str, x: int, world: int, spec: ModelSpec, out: Path, keep: bool) -> list[dict[str, Any]]:
    ckpt = generate(out / "ckpt" / f"sweep-d{spec.d_model}-l{spec.layers}-w{world}", world, spec)
    files = sum(p.stat().st_size for p in ckpt.glob("rank*.pt"))
    print(f"{series} {x}: W={world}, {files / 1e9:.2f} GB of rank files, {spec.params * 12 / 1e9:.2f} GB of "
          "tensors", flush=True)
    rows = []
    work = out / "work"
    for name, cmd in contenders(ckpt, work).items():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        wall, rss = timed_tree(cmd)
        rows.append({"series": series, "x": x, "world": world, "file_bytes": files, "tensor_bytes": spec.params * 12,
                     "contender": name, "wall": wall, "peak_rss": rss})
        print(f"  {name:<22} {wall:8.2f} s  {files / wall / 1e9:6.2f} GB/s  {rss / 2**20:6.0f} MiB", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if not keep:
        shutil.rmtree(ckpt)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| series | W | rank files GB | contender | wall s | GB/s | vs cp -r + sync | peak RSS MiB (all processes) |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        cp = next(c["wall"] for c in rows if c["series"] == r["series"] and c["x"] == r["x"]
                  and c["contender"] == "cp -r + sync")
        lines.append(f"| {r['series']} | {r['world']} | {r['file_bytes'] / 1e9:.2f} | {r['contender']} | "
                     f"{r['wall']:.2f} | {r['file_bytes'] / r['wall'] / 1e9:.2f} | {r['wall'] / cp:.2f}x | "
                     f"{r['peak_rss'] / 2**20:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Three panels: wall time against rank-file bytes (W=8), wall time against W (fixed model), and the
    peak RSS of every run against its rank-file bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["contender"] for r in rows))
    fig, (size, world, rss) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name in names:
        for ax, series, key in ((size, "size", "file_bytes"), (world, "world", "world")):
            pts = sorted((r[key], r["wall"]) for r in rows if r["contender"] == name and r["series"] == series)
            if pts:
                ax.plot([x / 1e9 if key == "file_bytes" else x for x, _ in pts], [t for _, t in pts], marker="o",
                        label=name)
        pts = sorted((r["file_bytes"], r["peak_rss"]) for r in rows if r["contender"] == name)
        rss.plot([x / 1e9 for x, _ in pts], [m / 2**20 for _, m in pts], marker="o", linestyle="none", label=name)
    size.set(xlabel="rank files (GB), W=8", ylabel="wall time (s)", title="time against checkpoint size")
    world.set(xlabel="world size (ranks), d_model 320, 1 block", ylabel="wall time (s)", xscale="log",
              title="time against world size (same model)")
    world.set_xscale("log", base=2)
    rss.set(xlabel="rank files (GB), both series", ylabel="peak RSS of all processes (MiB)", ylim=(0, None),
            title="memory against checkpoint size")
    for ax in (size, world, rss):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description="shardstore's cost against checkpoint size and world size")
    ap.add_argument("--sizes", default="1,2,5,10,20", help="GB of rank files at W=8 (of: 1,2,5,10,20)")
    ap.add_argument("--worlds", default="8,64,256,1024", help="world sizes for the fixed small model")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = ap.parse_args()
    compile_shardstore()
    rows: list[dict[str, Any]] = []
    for gb in (int(s) for s in args.sizes.split(",") if s):
        rows += point("size", gb, 8, SIZES[gb], args.out, args.keep)
    for world in (int(w) for w in args.worlds.split(",") if w):
        rows += point("world", world, world, SMALL, args.out, args.keep)
    print(table(rows))
    (args.out / "sweep.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "sweep.png")
    shutil.copy(args.out / "sweep.png", HERE.parent / "docs" / "img" / "sweep.png")


if __name__ == "__main__":
    main()
