"""Lightning's and Fabric's sharded checkpoints: shardstore against Lightning's own `consolidate_checkpoint`,
and against the disk.

    python benchmarks/lightning_bench.py --lightning-python PY [--out benchmarks/out]

Generates once (cached under --out/ckpt) a `step-4.ckpt/` folder of a ~200M-parameter Llama saved by
Fabric's `ModelParallelStrategy` (FSDP2) over 2 gloo processes (tests/fixtures/lightning_fsdp.py: DCP of
the model and AdamW's state, and `meta.pt`), `PY` being a Python with lightning and transformers
installed. Then it times, page cache dropped before each, RSS summed over all processes (bench.py's
`timed_tree`):
- `cp -r` + `sync` of the checkpoint folder;
- `python -m lightning.pytorch.utilities.consolidate_checkpoint FOLDER` (DCP loaded whole into memory,
  then one torch.save: what Lightning's docs give for a single-file checkpoint);
- `shardstore unshard --format torch` (the same whole checkpoint) and `--format safetensors` (the model).
It prints a markdown table and writes lightning.json to --out.
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
    ap.add_argument("--lightning-python", required=True)
    args = ap.parse_args()
    run = args.out / "ckpt" / "lightning-llama-200m-fsdp2-w2"
    ckpt = run / "step-4.ckpt"
    if not (ckpt / "meta.pt").exists():
        env = {**os.environ, "SHARDSTORE_LIGHTNING_CONFIG": json.dumps(LLAMA_200M)}
        subprocess.run([args.lightning_python, "-m", "tests.fixtures.lightning_fsdp", str(args.out / "ckpt"), "fabric",
                        "2"], check=True, env=env, cwd=HERE.parent)
        (args.out / "ckpt" / "fabric-w2").rename(run)
        Path(args.out / "ckpt" / "fabric-w2.expected.pt.ref").unlink(missing_ok=True)
    compile_shardstore()  # as pip leaves an installed package
    total = sum(p.stat().st_size for p in ckpt.iterdir())
    work = args.out / "lightning-work"
    shardstore = [sys.executable, "-m", "shardstore", "unshard", str(ckpt)]
    runs = {
        "`cp -r` + `sync` of the checkpoint folder": ["sh", "-c", f"cp -r '{ckpt}' {work}/cp && sync"],
        "Lightning's `consolidate_checkpoint` (torch)": [
            args.lightning_python, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(ckpt),
            "--output_file", str(work / "consolidated.ckpt")],
        "shardstore `unshard --format torch`": [*shardstore, str(work / "torch"), "--format", "torch", "-q"],
        "shardstore `unshard` (safetensors, model)": [*shardstore, str(work / "st"), "-q"],
    }
    results = compare(runs, work)
    print(f"\nFabric FSDP2 W=2: {total / 1e9:.2f} GB (model and optimizer)\n")
    print_table(results, "`cp -r` + `sync`", "peak RSS, all processes")
    summary = {"total_bytes": total, "config": LLAMA_200M, "results": results}
    (args.out / "lightning.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
