"""`shardstore follow` beside a run: the lag from a checkpoint's last file written to its folder published,
and the follower's peak memory, at a realistic size.

A trainer is played by copying a checkpoint into RUN as its trainer writes one. `--kind dcp`: a DCP
checkpoint saved by gloo processes (synth_dcp.py: an OLMo-shaped model and its AdamW state, `.metadata`
plus one .distcp per rank) into RUN/step-N/ as dcp.save writes one: every rank's file, then `.metadata`
last. `--kind rankfiles`: OLMo-shaped ShardedTensor rank files (synth.py) into RUN/stepN/, one rank's
file every `--gap` seconds (ranks finishing their saves one after another), then the `latest` link moved
to the step, as OLMo's legacy checkpointer does once every rank is done: the follower takes each rank's
file as it lands, so a step's lag is its last rank's file and the finish. The follower (`shardstore follow RUN OUT --format safetensors --poll P
--json`) publishes each step; its JSON lines give each step's lag; its resident memory, summed over it and
its worker processes, is sampled every 20 ms (bench.py's `_tree_rss`). The copy of the
model's bytes alone (`cp` of the files, then reading them back) is the floor.

    python benchmarks/follow_bench.py [--out benchmarks/out] [--d-model 1024] [--layers 24] [--steps 3] [--poll 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import _tree_rss  # noqa: E402
import synth  # noqa: E402
import synth_dcp  # noqa: E402
from synth import ModelSpec  # noqa: E402


def _write_dcp_step(ckpt: Path, run: Path, step: int, gap: float) -> str:
    """The checkpoint copied into RUN/step-N/ as dcp.save writes it (.metadata last)."""
    target = run / f"step-{step}"
    target.mkdir(parents=True)
    for f in sorted(ckpt.glob("*.distcp")):
        shutil.copyfile(f, target / f.name)
    shutil.copyfile(ckpt / ".metadata", target / ".metadata")
    return target.name


def _write_rank_step(ckpt: Path, run: Path, step: int, gap: float) -> str:
    """The rank files copied into RUN/stepN/ one every `gap` seconds, config.yaml first, then the latest
    link moved to it."""
    target = run / f"step{step}"
    target.mkdir(parents=True)
    shutil.copyfile(ckpt / "config.yaml", target / "config.yaml")
    for f in sorted(ckpt.glob("rank*.pt"), key=lambda p: int(p.stem[4:])):
        time.sleep(gap)
        shutil.copyfile(f, target / f.name)
    os.symlink(target.name, run / ".latest")
    os.replace(run / ".latest", run / "latest")
    return target.name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--kind", choices=("dcp", "rankfiles"), default="dcp")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between two ranks' files (rankfiles)")
    args = ap.parse_args()
    out = Path(args.out)
    spec = ModelSpec(args.d_model, args.layers)
    name = f"follow-{args.kind}-d{args.d_model}-l{args.layers}-w{args.world}"
    ckpt = synth_dcp.generate(out / "ckpt" / name, args.world, spec) if args.kind == "dcp" else \
        synth.generate(out / "ckpt" / name, args.world, spec)
    write_step = _write_dcp_step if args.kind == "dcp" else _write_rank_step
    work = out / "follow"
    shutil.rmtree(work, ignore_errors=True)
    run, published = work / "run", work / "published"
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "shardstore", "follow", str(run), str(published),
           "--poll", str(args.poll), "--json", "--jobs", str(os.cpu_count() or 1)]
    follower = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, sampling = [0], threading.Event()

    def sample() -> None:
        while not sampling.wait(0.02):
            peak[0] = max(peak[0], _tree_rss(follower.pid))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lags, seconds, early = [], [], []
    try:
        for step in range(1, args.steps + 1):
            last = write_step(ckpt, run, step, args.gap)
            assert follower.stdout is not None
            while True:
                line = follower.stdout.readline()
                if not line:
                    raise SystemExit(f"the follower ended: {follower.stderr.read() if follower.stderr else ''}")
                event = json.loads(line)
                if event["event"] == "published":
                    lags.append(event["lag"])
                    seconds.append(event["seconds"])
                    early.append(event["early"])
                    break
    finally:
        sampling.set()
        follower.send_signal(signal.SIGINT)
        follower.communicate(timeout=60)
    model_bytes = sum(f.stat().st_size for f in (published / last).glob("*.safetensors"))
    files = sorted(f for f in ckpt.iterdir() if f.suffix in (".distcp", ".pt"))
    started = time.perf_counter()
    for f in files:
        shutil.copyfile(f, work / f.name)
    copy = time.perf_counter() - started
    result = {"kind": args.kind, "checkpoint_bytes": sum(f.stat().st_size for f in files), "model_bytes": model_bytes,
              "lag_s": lags, "unshard_s": seconds, "units_taken_early": early, "poll_s": args.poll,
              "gap_s": args.gap if args.kind == "rankfiles" else None,
              "peak_rss_mb": round(peak[0] / 2**20), "copy_all_files_s": copy}
    print(json.dumps(result, indent=1))
    (out / f"follow-{args.kind}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
