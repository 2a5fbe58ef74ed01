"""What every small conversion pays before and around its bytes: start-up, imports, and whether torch is
loaded at all.

    python benchmarks/startup.py [--repeat 5] [--out benchmarks/out]

Times each command warm (the best of --repeat runs, after one unmeasured run), with the peak RSS of all
its processes (bench.py's `timed_tree`): `shardstore --version`, `shardstore --help`, each command's `--help` (its own start-up: parsing and
the registries its choices name, without its work), `shardstore ls` of a small store, and
`shardstore unshard` of the small OLMo `local` checkpoint kept in tests/corpus (3.5 MB, 2 ranks) in every
output format, in one process (`--jobs 1`) and with the default workers. Then the import cost of each
shardstore module as `python -X importtime` reports it (cumulative, this module and what it imports
first), and whether a one-process unshard ever imports torch. Last, the API called again and again from
one Python process that has loaded torch (a notebook's), whose workers are not forked (runner.py): the
first call and the median of the next --repeat, with workers from the fork server and, for comparison,
spawned (each twice, alternately). Prints markdown tables; writes startup.json to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import timed_tree  # noqa: E402

SMALL = HERE.parent / "tests" / "corpus" / "data" / "olmo-local-t2.0-w2"
FORMATS = ("safetensors", "torch", "dcp")
SHARDSTORE = [sys.executable, "-m", "shardstore"]


def best(cmd: list[str], repeat: int, before: Callable[[], None] | None = None) -> tuple[float, float]:
    """(wall s, peak RSS MB): the fastest of `repeat` warm runs."""
    runs = []
    for i in range(repeat + 1):
        if before:
            before()
        wall, rss = timed_tree(cmd, interval=0.005, cold=False)
        if i:
            runs.append((wall, rss / 2**20))
    return min(runs)


def import_costs() -> list[tuple[str, int]]:
    """Each shardstore module's cumulative import time (µs) when the command line and the API load."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", "import shardstore.cli, shardstore.api"], capture_output=True,
                         text=True, check=True)
    out = []
    for line in run.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|(\s*)(shardstore\S*)$", line)
        if m:
            out.append((m.group(3), int(m.group(1))))
    return sorted(out, key=lambda r: -r[1])


def commands() -> list[str]:
    """Every command of the command line: its --help is the command's own start-up (parsing, the
    registries its choices name) without its work."""
    run = subprocess.run([sys.executable, "-c", "from shardstore.cli import main; print(*main.commands)"],
                         capture_output=True, text=True, check=True)
    return run.stdout.split()


def imports_torch(fmt: str, out: Path) -> bool:
    code = (f"import sys, shardstore; shardstore.unshard({str(SMALL)!r}, {str(out)!r}, format={fmt!r}, jobs=1); "
            f"print('torch' in sys.modules)")
    shutil.rmtree(out, ignore_errors=True)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


# one process, torch loaded, calling unshard again and again: the first call, then each of the next
REPEATED = """
import shutil, sys, tempfile, time
import torch
import shardstore
from shardstore import runner
if sys.argv[2] == "spawn":
    runner.start_method = lambda: "spawn"
for _ in range(int(sys.argv[3]) + 1):
    out = tempfile.mkdtemp()
    shutil.rmtree(out)
    began = time.perf_counter()
    shardstore.unshard(sys.argv[1], out, jobs=2)
    print(time.perf_counter() - began)
    shutil.rmtree(out)
"""


def repeated(how: str, repeat: int) -> tuple[float, float]:
    """(first call, median of the next `repeat`) of `shardstore.unshard` in one process that loaded torch,
    its workers started `how` ("forkserver": as runner.py chooses; "spawn")."""
    run = subprocess.run([sys.executable, "-c", REPEATED, str(SMALL), how, str(repeat)], capture_output=True,
                         text=True, check=True)
    first, *rest = map(float, run.stdout.split())
    return first, sorted(rest)[len(rest) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows.append(("shardstore --version", *best(SHARDSTORE + ["--version"], args.repeat)))
        rows.append(("shardstore --help", *best(SHARDSTORE + ["--help"], args.repeat)))
        for command in commands():
            rows.append((f"shardstore {command} --help", *best(SHARDSTORE + [command, "--help"], args.repeat)))
        subprocess.run(SHARDSTORE + ["ingest", str(work / "s.zarr"), str(SMALL), "-q"], check=True)
        rows.append(("shardstore ls (small store)", *best(SHARDSTORE + ["ls", str(work / "s.zarr")], args.repeat)))
        for fmt in FORMATS:
            for jobs in ("1", None):
                out = work / f"out-{fmt}"
                cmd = SHARDSTORE + ["unshard", str(SMALL), str(out), "--format", fmt, "-q", "--overwrite"]
                cmd += ["--jobs", jobs] if jobs else []
                wall, rss = best(cmd, args.repeat, lambda: shutil.rmtree(out, ignore_errors=True))
                rows.append((f"unshard --format {fmt}" + (" --jobs 1" if jobs else ""), wall, rss))
        torch_loaded = {fmt: imports_torch(fmt, work / "t") for fmt in FORMATS}
        calls = [(how, *repeated(how, args.repeat)) for how in ("spawn", "forkserver") * 2]  # alternately
    costs = import_costs()
    print("| command (3.5 MB checkpoint, warm) | wall s | peak RSS MB |\n|---|---:|---:|")
    for name, wall, rss in rows:
        print(f"| {name} | {wall:.2f} | {rss:.0f} |")
    print("\n| one-process unshard | imports torch |\n|---|---|")
    for fmt, loaded in torch_loaded.items():
        print(f"| --format {fmt} | {'yes' if loaded else 'no'} |")
    print("\n| unshard from a process that loaded torch, workers | first call s | each later call s |\n|---|---:|---:|")
    for how, first, later in calls:
        print(f"| {how} | {first:.2f} | {later:.2f} |")
    print("\n| module (import cost, cumulative) | ms |\n|---|---:|")
    for name, us in costs[:15]:
        print(f"| {name} | {us / 1000:.1f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps({"commands": rows, "imports_torch": torch_loaded,
                                                       "import_us": costs, "repeated_calls": calls}, indent=1))


if __name__ == "__main__":
    main()
