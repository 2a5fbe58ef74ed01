"""Megatron-Core torch_dist checkpoints: shardstore against torch's DCP tools, and against the disk.

    python benchmarks/megatron_bench.py --megatron-python PY [--out benchmarks/out]

Generates once (cached under --out/ckpt) a Megatron-LM run of a ~134M-parameter Llama-shaped GPT model,
TP=2 x PP=2, after two training steps through Megatron's DDP and DistributedOptimizer, saved by
megatron-core's own `dist_checkpointing.save` with its optimizer state (`dp_reshardable`): ~2.1 GB.
`PY` is a Python with megatron-core installed (tests/fixtures/megatron_core.py says how). Then it times,
page cache dropped before each (bench.py's `timed_tree`: the peak RSS of all processes together):
- a copy + `sync` of the model's bytes alone (their byte ranges in the .distcp files, by `.metadata`):
  what a model export has to read and write, the floor;
- `cp -r` + `sync` of the whole checkpoint;
- torch's `dcp_to_torch_save` (model and optimizer into one torch.save file);
- torch's DCP loading in one process plus the per-layer Hugging Face mapping (benchmarks/megatron_dcp_to_hf.py,
  what slime's converter does);
- `shardstore unshard --format hf`, `--format safetensors` and `--format torch` (model and optimizer).
It prints a markdown table and writes megatron.json to --out.
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
from bench import compare, compile_shardstore, print_table  # noqa: E402

from shardstore.read.formats.dcp import read_checkpoint  # noqa: E402

SIZE = {"layers": 12, "hidden": 768, "heads": 12, "groups": 4, "ffn": 2048, "vocab": 32000}
TP, PP = 2, 2

COPY_MODEL = """
import os, sys
from shardstore.read.formats.dcp import read_checkpoint
ckpt = read_checkpoint(sys.argv[1])
with open(sys.argv[2], "wb") as out:
    for item in ckpt.items:
        if ckpt.paths[item.fqn][0] == "model":
            with open(os.path.join(sys.argv[1], item.file), "rb") as f:
                f.seek(item.offset)
                out.write(f.read(item.length))
    out.flush()
    os.fsync(out.fileno())
"""


def generate(ckpt: Path, python: str) -> None:
    env = {**os.environ, "SHARDSTORE_MEGATRON_SIZE": json.dumps(SIZE)}
    subprocess.run([python, "-m", "tests.fixtures.megatron_core", str(ckpt.parent), str(TP), str(PP), "", "1",
                    "dp_reshardable"], check=True, env=env, cwd=HERE.parent)
    made = ckpt.parent / f"tp{TP}-pp{PP}-optim"
    made.rename(ckpt)
    Path(f"{made}.expected.pt.ref").unlink(missing_ok=True)  # the reference, only the tests need it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--megatron-python", default=sys.executable)
    args = ap.parse_args()
    ckpt = args.out / "ckpt" / f"megatron-llama-134m-tp{TP}-pp{PP}"
    if not (ckpt / "latest_checkpointed_iteration.txt").exists():
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        generate(ckpt, args.megatron_python)
    compile_shardstore()  # as pip leaves an installed package
    folder = ckpt / "iter_0000010"
    total = sum(p.stat().st_size for p in folder.iterdir())
    ckpt_items = read_checkpoint(str(folder))  # the model's byte ranges, as the floor's copy takes them
    model_bytes = sum(i.length for i in ckpt_items.items if ckpt_items.paths[i.fqn][0] == "model")
    work = args.out / "megatron-work"
    shardstore = [sys.executable, "-m", "shardstore", "unshard", str(ckpt)]
    runs = {
        "copy + `sync` of the model's bytes (the floor)": [sys.executable, "-c", COPY_MODEL, str(folder),
                                                           str(work / "model.bin")],
        "`cp -r` + `sync` of the whole checkpoint": ["sh", "-c", f"cp -r {folder} {work}/cp && sync"],
        "torch `dcp_to_torch_save` (model + optimizer)": [
            sys.executable, "-c", "import sys; from torch.distributed.checkpoint.format_utils import "
            "dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])", str(folder), str(work / "ckpt.pt")],
        "torch DCP load + per-layer HF mapping, one process (slime's way)": [
            sys.executable, str(HERE / "megatron_dcp_to_hf.py"), str(folder), str(work / "slime"),
            str(SIZE["heads"]), str(SIZE["groups"])],
        "shardstore `unshard --format hf`": [*shardstore, str(work / "hf"), "--format", "hf", "-q"],
        "shardstore `unshard --format safetensors` (model)": [*shardstore, str(work / "st"), "-q"],
        "shardstore `unshard --format torch` (model + optimizer)": [*shardstore, str(work / "torch"), "--format",
                                                                    "torch", "-q"],
    }
    results = compare(runs, work)
    print(f"\nMegatron-Core torch_dist, TP={TP} x PP={PP}: model {model_bytes / 1e9:.2f} GB, "
          f"checkpoint {total / 1e9:.2f} GB\n")
    print_table(results, "the model's copy", "peak RSS, all processes")
    (args.out / "megatron.json").write_text(json.dumps({"model_bytes": model_bytes, "total_bytes": total,
                                                        "size": SIZE, "results": results}, indent=1))


if __name__ == "__main__":
    main()
