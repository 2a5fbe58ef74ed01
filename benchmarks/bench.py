"""The benchmark harness: shardstore against today's unsharder and against the disk itself.

    python benchmarks/bench.py [--scenarios w8,w256,w1024,w1024-7b,large,dcp] [--out benchmarks/out] [--no-olmo]
                               [--pairs 5] [--repeat N]
                               [--deepspeed PY]

For each scenario it generates an OLMo-like checkpoint once (benchmarks/synth.py; cached under --out),
then runs every contender with the page cache dropped before each run (when root), timing wall clock
and peak RSS of the largest process with /usr/bin/time:

- the physical floor: `cat` of every rank file to /dev/null, `cp -r` of the folder (and `cp -r` + `sync`,
  since shardstore makes its data durable before it calls a rank done);
- `shardstore ingest`, then `shardstore show` of one 4-row slice from that store (wall clock of the
  whole command, and bytes it read), then `shardstore export` to safetensors;
- `shardstore unshard` end to end, to safetensors, to torch, to DCP and (with the run's config.yaml) to `hf`;
- `shardstore ingest` with rank files and store on a local S3 API server (moto), counting the requests
  the server answered (its access log), against a plain copy of the same files on that server through
  s3fs (the floor there: each byte read once and written once through the same client library);
- for `w1024-7b`, a subset of a checkpoint too large for the disk: rank 0 ingested alone (it plans the
  store), then rank 1 alone, then the rest; the difference of the last two is the per-file cost;
- OLMo's `TorchLegacyShardedCheckpointer` (PyPI ai2-olmo, installed with --no-deps plus what it imports),
  thread mode and shared-memory mode, run as its own unshard script does (benchmarks/olmo_baseline.py).

Every local shardstore `ingest`, `export` and `unshard` runs `--pairs` times (5), each run just after its
floor, `cp -r` + `sync` of the same checkpoint (A B A B ...), each prepared the same way (the last output
removed, caches dropped); its row gives the median wall time and the median of the paired ratios (its
wall / the floor's just before it) with their min and max. The S3 ingest is paired the same way with the
fsspec copy on the same server, and the per-file rows of `w1024-7b` with a copy of the same rank files.
On a virtual machine the cost of a cold run moves with the host as well as the disk: this machine's
hypervisor takes back the memory the guest frees (free page reporting), so filling fresh page cache costs
a host page fault per page, and `cp -r` + `sync` of the W=8 checkpoint took 4.5 s in one minute and 13.6 s
in another. A copy timed minutes away from a contender is no floor for it; the one just before it is, and
the median of several such pairs is what a target is stated on. An ingest also starts only once
the inodes the harness freed last are past the window in which this disk's ext4 skips them (`settle`).

It prints a markdown table, writes results.json and a PNG plot to --out, and copies the plot to
docs/img/benchmarks.png. With `--deepspeed PY` (a Python with deepspeed installed) it also runs the ZeRO-2
and ZeRO-3 rows against `zero_to_fp32.py` (benchmarks/deepspeed_bench.py; `--scenarios ""` for those
alone).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from synth import ModelSpec, generate  # noqa: E402

OLMO_PACKAGES = ["omegaconf", "cached-path", "importlib_resources", "datasets"]


@dataclass(frozen=True)
class Scenario:
    name: str
    world: int
    spec: ModelSpec
    olmo: bool = True
    olmo_why: str = "needs ~2.2x the checkpoint in RAM, more than this machine has"  # when olmo is False
    olmo_timeout: float = 3600.0
    show_key: str = "model/transformer.wte.weight"
    s3: bool = False  # also ingest from (and into) a local S3 API server
    format: str = "torch-save"  # or "dcp": a torch.distributed.checkpoint folder, against dcp_to_torch_save
    subset: int | None = None  # only the first this many rank files, each full size: per-file ingest cost
    group: int | None = None  # hybrid sharding: shard groups of this many ranks (each group a whole copy)


SCENARIOS = {
    "w8": Scenario("olmo-d1024-l28-w8", 8, ModelSpec(1024, 28)),
    "w256": Scenario("olmo-d320-l4-w256", 256, ModelSpec(320, 4), s3=True),
    "w1024": Scenario("olmo-d320-l1-w1024", 1024, ModelSpec(320, 1), olmo_timeout=900.0),
    # OLMo-7B's shape (d_model 4096, 32 blocks, 390 ShardedTensors) at world size 1024: 128 MB rank files,
    # 46 MB of which is pickle. All 1024 would take 131 GB; 8 of them, each exactly as it would be, show
    # the per-file cost (OLMo's unsharder needs every rank, so it is not run).
    "w1024-7b": Scenario("olmo7b-w1024 (8 of 1024 ranks)", 1024, ModelSpec(4096, 32, olmo1=True), olmo=False,
                         subset=8, olmo_why="needs every rank file"),
    # OLMo's unsharder needs ~2.2x the checkpoint in RAM: more than this machine's 24 GB.
    "large": Scenario("olmo-d2048-l16-w8", 8, ModelSpec(2048, 16), olmo=False),
    # Hybrid sharding: every replica group's shard lists name its own ranks, so no file's lists are the
    # plan's; OLMo's unsharder refuses such checkpoints (it asserts equal metadata on every rank).
    "hsdp": Scenario("olmo-d256-l8-hsdp-w256 (2 groups of 128)", 256, ModelSpec(256, 8, vocab=4096), olmo=False,
                     group=128, olmo_why="refuses hybrid sharding (it asserts equal shard metadata on every rank)"),
    "dcp": Scenario("olmo-d1024-l10-dcp-w4", 4, ModelSpec(1024, 10), olmo=False, format="dcp",
                    show_key="model/transformer_wte_weight"),
}

# a plain copy of the rank files on the S3 server through s3fs: each read once, written once (8 MB blocks)
FSSPEC_COPY = ("import shutil, sys, s3fs; fs = s3fs.S3FileSystem()\n"
               "for url in sys.argv[1:]:\n"
               "    with fs.open(url, 'rb') as i, fs.open(url.replace('/ckpt/', '/copy/'), 'wb') as o:\n"
               "        shutil.copyfileobj(i, o, 8 << 20)")

# torch's own converter, as people run it: everything into one torch.save file
DCP_TO_TORCH_SAVE = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                     "dcp_to_torch_save(sys.argv[1], sys.argv[2])")


@dataclass
class Result:
    scenario: str
    contender: str
    wall: float | None
    peak_rss: int | None
    note: str = ""
    # paired runs (A B A B ..., docstring): the median of wall / the `cp -r` + `sync` just before it, min, max
    paired: float | None = None
    paired_min: float | None = None
    paired_max: float | None = None
    pairs: int = 0


# The ~200M-parameter Llama (fp32, 0.8 GB) the trainers' benchmarks save through their own code
LLAMA_200M = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4,
              "num_hidden_layers": 12, "vocab_size": 32000, "max_position_embeddings": 256}


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    if os.geteuid() == 0:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def compile_shardstore() -> None:
    """Byte-compile shardstore, as `pip install` leaves an installed package. Where PYTHONDONTWRITEBYTECODE
    is set (it is on the machine these numbers come from) an editable install would otherwise compile
    every module on every run: 0.2 s that no installed copy spends."""
    import compileall

    compileall.compile_dir(str(HERE.parent / "shardstore"), quiet=1)


def _tree_rss(root: int) -> int:
    """Resident bytes of `root` and every process below it, now (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: the parent's pid
        rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # fields[21]: resident pages
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


# This machine's disk is ext4 without a journal. There a new inode skips every inode freed in the last 60 s
# (360 s while its inode-table block is dirty; the kernel's ialloc.c, `recently_deleted`). Creating 2,340
# files took 1.75 s right after 10,000 were deleted and 0.05 s 70 s later (docs/benchmarks.md, session 21).
# A store is thousands of cell files, so an ingest started just after the harness deleted the last store
# paid for the harness's deletion. Each ingest therefore waits until that window has passed.
RECENTLY_FREED_S = 61.0
MANY_FILES = 1000
_freed_at = [0.0]  # time.monotonic() when the harness last deleted MANY_FILES or more


def remove(path: Path) -> None:
    """shutil.rmtree, noting when the tree held many files (see RECENTLY_FREED_S)."""
    if sum(len(names) for _, _, names in os.walk(path)) >= MANY_FILES:
        _freed_at[0] = time.monotonic()
    shutil.rmtree(path, ignore_errors=True)


def settle() -> None:
    """Wait until the inodes the harness freed last are no longer skipped (see RECENTLY_FREED_S)."""
    until = _freed_at[0] + RECENTLY_FREED_S
    if time.monotonic() < until:
        subprocess.run(["sync"], check=True)  # the window is the shorter one once the inode table is written
        time.sleep(max(0.0, until - time.monotonic()))


def timed_tree(cmd: list[str], env: dict[str, str] | None = None, interval: float = 0.02,
               cold: bool = True) -> tuple[float, int]:
    """(wall seconds, peak summed RSS of the whole process tree) of `cmd`, caches dropped first unless not
    `cold`: what `/usr/bin/time` cannot say (it reports the largest single process). Sampled every
    `interval` s."""
    if cold:
        drop_caches()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(interval)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed: {proc.stderr.read().decode()[-300:]}")
    return wall, peak


def timed(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of the largest process, stderr) of `cmd`, caches dropped first."""
    drop_caches()
    proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", *cmd], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    lines = proc.stderr.strip().splitlines()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed: {' | '.join(lines[-3:])}")
    wall, rss = lines[-1].split()
    return float(wall), int(rss) * 1024, proc.stderr


def compare(runs: dict[str, list[str]], work: Path,
            measure: Callable[[list[str]], tuple[float, int]] = timed_tree) -> list[dict[str, Any]]:
    """Each contender run in an empty `work` folder (removed after), timed by `measure` (wall seconds,
    peak RSS bytes; caches dropped first), and printed as it finishes."""
    results = []
    for name, cmd in runs.items():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        wall, rss = measure(cmd)
        results.append({"contender": name, "wall": wall, "peak_rss": rss})
        print(f"{name}: {wall:.2f} s, {rss / 2**20:.0f} MB", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return results


def compare_paired(runs: dict[str, list[str]], work: Path, pairs: int = 5,
                   measure: Callable[[list[str]], tuple[float, int]] = timed_tree) -> list[dict[str, Any]]:
    """The first of `runs` is the floor; every other contender runs `pairs` times, each run just after one of
    the floor (A B A B ...), each in an empty `work`, caches dropped before each (`measure`). A contender's
    ratio is the median of its `pairs` paired ratios (its wall / the floor's just before it), given with
    their min and max: this host's disk speed moves by 2x from minute to minute, and a ratio of runs
    minutes apart measures that, not the contender."""
    (floor_name, floor), *contenders = runs.items()
    floors: list[float] = []
    floor_rss = 0
    results = []

    def once(cmd: list[str]) -> tuple[float, int]:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        return measure(cmd)

    for name, cmd in contenders:
        walls, ratios, peak = [], [], 0
        for _ in range(pairs):
            base, rss = once(floor)
            floor_rss = max(floor_rss, rss)
            wall, rss = once(cmd)
            floors.append(base)
            walls.append(wall)
            ratios.append(wall / base)
            peak = max(peak, rss)
        ratios.sort()
        results.append({"contender": name, "wall": statistics.median(walls), "peak_rss": peak, "pairs": pairs,
                        "ratio": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1]})
        print(f"{name}: {results[-1]['wall']:.2f} s, {results[-1]['ratio']:.2f}x the floor "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f}), {peak / 2**20:.0f} MB", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return [{"contender": floor_name, "wall": statistics.median(floors), "peak_rss": floor_rss, "pairs": len(floors),
             "ratio": 1.0, "ratio_min": 1.0, "ratio_max": 1.0}, *results]


def print_table(results: list[dict[str, Any]], against: str, rss: str) -> None:
    """`compare`'s or `compare_paired`'s results as a markdown table: each wall time also as a ratio to the
    first contender's, the paired ratios' median and spread where they were paired."""
    floor = results[0]["wall"]
    print(f"| contender | wall (median) | vs {against} | {rss} |\n|---|---:|---:|---:|")
    for r in results:
        ratio = (f"{r['ratio']:.2f}× ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}, {r['pairs']} pairs)" if "ratio" in r
                 else f"{r['wall'] / floor:.2f}×")
        print(f"| {r['contender']} | {r['wall']:.2f} s | {ratio} | {r['peak_rss'] / 2**20:.0f} MB |")


def ensure_olmo() -> bool:
    probe = [sys.executable, "-c", "from olmo.checkpoint import TorchLegacyShardedCheckpointer"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return True
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--no-deps", "ai2-olmo==0.6.0"], check=False)
    subprocess.run([*pip, *OLMO_PACKAGES], check=False)
    return subprocess.run(probe, capture_output=True).returncode == 0


def clear_olmo_shared_memory(ckpt: Path) -> None:
    """OLMo names its segments after the checkpoint path; a run that died leaves them behind."""
    prefix = str(ckpt).replace("/", "_")
    for seg in Path("/dev/shm").glob(prefix + "*"):
        seg.unlink(missing_ok=True)


def checkpoint_files(sc: Scenario, ckpt: Path) -> list[Path]:
    if sc.format == "dcp":
        return sorted(ckpt.glob("*.distcp")) + [ckpt / ".metadata"]
    return sorted(ckpt.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))


def run_scenario(sc: Scenario, out: Path, with_olmo: bool, contenders: list[str], pairs: int = 5) -> list[Result]:
    if sc.format == "dcp":
        from synth_dcp import generate as generate_dcp

        ckpt = generate_dcp(out / "ckpt" / sc.name, sc.world, sc.spec)
    else:
        ckpt = generate(out / "ckpt" / sc.name.split(" ")[0], sc.world, sc.spec, ranks=sc.subset, group=sc.group)
    files = checkpoint_files(sc, ckpt)
    work = out / "work"
    shardstore = [sys.executable, "-m", "shardstore.cli"]
    results: list[Result] = []

    def run(name: str, cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None,
            note: str = "", reset: Callable[[], None] | None = None, floor: list[str] | None = None) -> str:
        """Time `cmd` as contender `name` (caches dropped first). With `reset` (what makes the next run start
        as this one did: its output removed), it runs `pairs` times, each just after its floor (`floor`, by
        default a `cp -r` + `sync` of the checkpoint), and its row is the median wall time and the median
        of the paired ratios with their min and max. Returns the last run's stderr."""
        if contenders and not any(c in name for c in contenders):
            return ""
        try:
            if reset is None:
                wall, rss, err = timed(cmd, env, timeout)
                results.append(Result(sc.name, name, wall, rss, note))
                print(f"  {name:<34} {wall:8.2f} s  {rss / 1e6:8.0f} MB", flush=True)
                return err
            walls, ratios, peak = [], [], 0
            for i in range(pairs):
                if i:
                    reset()
                if "ingest" in name:  # it makes thousands of cell files
                    settle()
                before = copy_floor(floor, env)
                wall, rss, err = timed(cmd, env, timeout)
                walls.append(wall)
                ratios.append(wall / before)
                peak = max(peak, rss)
            ratios.sort()
            results.append(Result(sc.name, name, statistics.median(walls), peak, note, statistics.median(ratios),
                                  ratios[0], ratios[-1], pairs))
            print(f"  {name:<34} {results[-1].wall:8.2f} s  {peak / 1e6:8.0f} MB  ({results[-1].paired:.2f}x the copy "
                  f"just before, {ratios[0]:.2f}-{ratios[-1]:.2f} over {pairs} pairs)", flush=True)
            return err
        except subprocess.TimeoutExpired:
            results.append(Result(sc.name, name, None, None, f"timed out after {timeout:.0f} s"))
        except RuntimeError as exc:
            results.append(Result(sc.name, name, None, None, str(exc)[:200]))
        print(f"  {name:<34} {results[-1].note}", flush=True)
        return ""

    def copy_floor(cmd: list[str] | None, env: dict[str, str] | None) -> float:
        """The floor `cmd` (by default `cp -r` + `sync` of the checkpoint into work/pair, removed after) just
        before a contender's run: the floor under its conditions."""
        wall, _, _ = timed(cmd or copy_of([ckpt]), env)
        shutil.rmtree(work / "pair", ignore_errors=True)
        return wall

    def copy_of(paths: list[Path]) -> list[str]:
        """`cp -r` + `sync` of `paths` into work/pair."""
        return ["sh", "-c", f"mkdir -p {work / 'pair'} && cp -r {' '.join(map(str, paths))} {work / 'pair'} && sync"]

    def fresh() -> None:
        remove(work)
        work.mkdir(parents=True)

    print(f"{sc.name}: {sum(f.stat().st_size for f in files) / 1e9:.2f} GB in {len(files)} files", flush=True)
    fresh()
    run("cat > /dev/null", ["sh", "-c", "cat " + " ".join(map(str, files)) + " > /dev/null"])
    run("cp -r", ["cp", "-r", str(ckpt), str(work / "copy")])
    fresh()
    run("cp -r + sync", ["sh", "-c", f"cp -r {ckpt} {work / 'copy'} && sync"])
    fresh()
    if sc.subset:  # the first rank plans the store; the rest show what each further file costs
        store = [*shardstore, "ingest", str(work / "store")]

        def store_of(ranks: int) -> Callable[[], None]:
            """The store holding the first `ranks` rank files again, for the next pair's run."""
            def reset() -> None:
                remove(work / "store")
                subprocess.run([*store, *map(str, files[:ranks]), "-q"], check=True)
            return reset

        run("shardstore ingest (rank 0: plans the store)", [*store, str(files[0]), "-q"],
            reset=lambda: remove(work / "store"), floor=copy_of(files[:1]))
        run("shardstore ingest (1 more rank)", [*store, str(files[1]), "-q"], reset=store_of(1),
            floor=copy_of(files[1:2]))
        run(f"shardstore ingest ({len(files) - 2} more ranks)", [*store, *map(str, files[2:]), "-q"],
            reset=store_of(2), floor=copy_of(files[2:]))
        remove(work)
        return per_file_note(results, sc, len(files))
    if sc.format == "dcp":
        run("dcp_to_torch_save (torch)", [sys.executable, "-c", DCP_TO_TORCH_SAVE, str(ckpt), str(work / "torch.pt")])
        fresh()
        files = files[:-1]  # what shardstore ingests: the .distcp files (their .metadata is found beside them)
    run("shardstore ingest", [*shardstore, "ingest", str(work / "store"), *map(str, files), "-q"],
        reset=lambda: remove(work / "store"))
    show = [sys.executable, str(HERE / "show_io.py"), "show", str(work / "store"), sc.show_key, "--slice", "1000:1004"]
    err = run("shardstore show (4-row slice)", show)
    if err:
        results[-1].note = next((line for line in err.splitlines() if line.startswith("bytes read")), "")
    run("shardstore export safetensors", [*shardstore, "export", str(work / "store"), str(work / "st"), "-q"],
        reset=lambda: remove(work / "st"))
    fresh()
    formats = ["safetensors", "torch", "dcp"] + (["hf"] if (ckpt / "config.yaml").exists() else [])
    for fmt in formats:
        run(f"shardstore unshard {fmt}", [*shardstore, "unshard", str(ckpt), str(work / fmt), "--format", fmt, "-q"],
            reset=fresh)
        fresh()
    if sc.s3:
        run_s3(out / "moto.log", files, run, results)
    if with_olmo and sc.olmo:
        olmo = [sys.executable, str(HERE / "olmo_baseline.py"), str(ckpt), str(work / "olmo")]
        env = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
        run("OLMo unsharder (threads)", olmo, env, sc.olmo_timeout)
        fresh()
        clear_olmo_shared_memory(ckpt)
        run("OLMo unsharder (shared memory)", [*olmo, "--shared-mem"], env, sc.olmo_timeout,
            note="its shared memory (/dev/shm) is not in RSS")
        clear_olmo_shared_memory(ckpt)
        fresh()
    elif not sc.olmo and sc.format != "dcp":
        results.append(Result(sc.name, "OLMo unsharder (threads)", None, None,
                              f"not run: {sc.olmo_why}"))
    remove(work)
    for r in results:
        r.note = r.note or ""
    return results


def run_s3(log_path: Path, files: list[Path], run: Callable[..., str], results: list[Result]) -> None:
    """`shardstore ingest` with rank files and store on a local S3 API server (moto, its own process,
    its access log at `log_path`)."""
    import socket

    try:
        import s3fs  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "s3fs", "moto[server]"], check=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w+")  # its access log: one line per request
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=log)
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    try:
        upload = ("import s3fs, sys; fs = s3fs.S3FileSystem(); fs.mkdir('bench'); "
                  "[fs.put_file(f, 'bench/ckpt/' + f.rsplit('/', 1)[-1]) for f in sys.argv[1:]]")
        time.sleep(2)
        subprocess.run([sys.executable, "-c", upload, *map(str, files)], check=True, env={**os.environ, **env})
        urls = [f"s3://bench/ckpt/{f.name}" for f in files]

        def counted(since: int) -> collections.Counter[str]:
            log.flush()
            return collections.Counter(method for method, _ in _requests(log)[since:])

        # the floor on that server: every rank file read and written once through the same client library
        copy = [sys.executable, "-c", FSSPEC_COPY, *urls]
        log.flush()
        before = len(_requests(log))
        run("fsspec copy (S3 -> S3)", copy, env)
        floor = counted(before)  # the same requests every run: each file's GET(s) and PUT(s)
        ingest = [sys.executable, "-m", "shardstore.cli", "ingest", "s3://bench/store", *urls, "-q"]
        remove_store = [sys.executable, "-c", "import s3fs; fs = s3fs.S3FileSystem(); fs.rm('bench/store', recursive=True)"]
        resets: collections.Counter[str] = collections.Counter()

        def reset() -> None:
            since = len(_requests(log))
            subprocess.run(remove_store, check=True, env={**os.environ, **env})
            resets.update(counted(since))

        before = len(_requests(log))
        run("shardstore ingest (S3 -> S3)", ingest, env, floor=copy, reset=reset)
        r = results[-1]
        if r.contender == "shardstore ingest (S3 -> S3)" and r.wall and r.pairs:
            # the log also holds the pairs' fsspec copies and the resets' deletions
            ours = counted(before) - collections.Counter({m: n * r.pairs for m, n in floor.items()}) - resets
            r.note = (f"moto S3 server on loopback; {sum(ours.values()) / r.pairs / len(files):.1f} requests per rank "
                      f"file ({', '.join(f'{n // r.pairs} {m}' for m, n in ours.most_common())} a run; the copy "
                      f"{sum(floor.values()) / len(files):.1f})")
    finally:
        server.terminate()
        server.wait()
        log.close()


def _requests(log: Any) -> list[tuple[str, str]]:
    """(method, path) of every request in a moto server's access log so far."""
    log.seek(0)
    return re.findall(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP/', log.read())


def table(results: list[Result], sizes: dict[str, int]) -> str:
    rows = ["| checkpoint | contender | wall s | GB/s | peak RSS MB | vs today's tool | vs cp -r | vs its floor, "
            "paired: median (min–max, pairs) | note |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for sc in dict.fromkeys(r.scenario for r in results):
        mine = [r for r in results if r.scenario == sc]
        base = {r.contender: r.wall for r in mine}
        for r in mine:
            if r.wall is None:
                rows.append(f"| {sc} | {r.contender} | — | — | — | — | — | — | {r.note} |")
                continue
            # today's tool: OLMo's unsharder in thread mode, or torch's dcp_to_torch_save for DCP
            olmo = None if r.contender.startswith(("cat", "cp")) else (
                base.get("OLMo unsharder (threads)") or base.get("dcp_to_torch_save (torch)"))
            cp = base.get("cp -r")
            rows.append(f"| {sc} | {r.contender} | {r.wall:.2f} | {sizes[sc] / 1e9 / r.wall:.2f} | "
                        f"{r.peak_rss / 1e6:.0f} | {f'{olmo / r.wall:.1f}x faster' if olmo else '—'} | "
                        f"{f'{r.wall / cp:.2f}x' if cp else '—'} | {_paired(r)} | "
                        f"{r.note} |")
    return "\n".join(rows)


def _paired(r: Result) -> str:
    """A row's paired ratio: the median, its min and max, how many pairs."""
    if r.paired is None:
        return "—"
    return f"**{r.paired:.2f}x** ({r.paired_min:.2f}–{r.paired_max:.2f}, {r.pairs})"


def disk_of(path: Path) -> str:
    """The file system `path` is on, its device and mount options, as findmnt says them."""
    found = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "--target", str(path)],
                           capture_output=True, text=True)
    if found.returncode or not found.stdout.split():
        return "disk unknown"
    source, fstype, options = (found.stdout.split() + ["", ""])[:3]
    rotational = Path(f"/sys/block/{Path(source).name}/queue/rotational")
    kind = {"0": "solid-state", "1": "rotational"}.get(rotational.read_text().strip(), "") if rotational.exists() else ""
    return f"{fstype} on {source}{f' ({kind} by the kernel)' if kind else ''}, mounted {options}"


def plot(results: list[Result], path: Path, worlds: dict[str, int]) -> None:
    """Two panels: wall time against world size, one line per contender (how cost grows with W), and each
    run against `cp -r` + `sync` of the same checkpoint: shardstore's paired medians with their spread,
    today's tools (run once) against the one copy row; on a log axis, the value written on each bar."""
    try:
        import matplotlib
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=False)
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.wall is not None]
    scenarios = list(dict.fromkeys(r.scenario for r in done))
    # how cost grows with W: one family of checkpoints (w8, w256, w1024), the end-to-end contenders
    series = {SCENARIOS[k].name for k in ("w8", "w256", "w1024")}
    contenders = [c for c in dict.fromkeys(r.contender for r in done if r.scenario in series)
                  if c.startswith(("cp -r", "OLMo")) or c in ("shardstore ingest", "shardstore unshard safetensors",
                                                            "shardstore unshard torch")]
    bars = sum(1 for r in done if not r.contender.startswith(("cat", "cp")))
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 0.28 * bars + 3))
    for name in contenders:
        points = sorted((worlds[r.scenario], r.wall) for r in done if r.contender == name and r.scenario in series)
        if points:
            left.plot([w for w, _ in points], [t for _, t in points], marker="o", label=name)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("world size (ranks)")
    left.set_ylabel("wall time (s)")
    left.set_title("wall time against world size (OLMo-like, w8 / w256 / w1024)", fontsize=10)
    left.legend(fontsize=7)
    labels, values, spreads, colors = [], [], [], []
    for sc in scenarios:
        floor = next((r.wall for r in done if r.scenario == sc and r.contender == "cp -r + sync"), None)
        for r in done:
            if r.scenario != sc or r.contender.startswith(("cat", "cp")):
                continue
            if r.paired is not None and r.paired_min is not None and r.paired_max is not None:
                value, low, high, color = r.paired, r.paired - r.paired_min, r.paired_max - r.paired, "#1f77b4"
            elif floor and not r.contender.startswith("fsspec"):  # run once: today's tools (red), `show`
                today = r.contender.startswith(("OLMo", "dcp_to"))
                value, low, high, color = r.wall / floor, 0.0, 0.0, "#d62728" if today else "#9e9e9e"
            else:
                continue
            labels.append(f"{sc}: {r.contender}")
            values.append(value)
            spreads.append((low, high))
            colors.append(color)
    bars = right.barh(labels, values, color=colors, xerr=list(zip(*spreads)) if spreads else None,
                      error_kw={"elinewidth": 0.8, "capsize": 2})
    right.bar_label(bars, labels=[f"{v:.2f}x" for v in values], fontsize=7, padding=4)
    right.axvline(1.0, color="#999999", linewidth=1)
    right.set_xscale("log")
    right.invert_yaxis()
    right.set_xlabel("wall time as a multiple of cp -r + sync of the same checkpoint (1 = the copy)")
    right.set_title("against the disk\nshardstore: the median of its paired ratios, whiskers min-max (blue)\n"
                    "run once, against the one copy row: today's tools (red), show (grey)", fontsize=8)
    right.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def per_file_note(results: list[Result], sc: Scenario, files: int) -> list[Result]:
    """A subset scenario's last row noted with the cost of one more file: the difference of the runs of
    files-2 ranks and of 1 leaves out what every command pays once (start-up, workers)."""
    walls = {r.contender: r.wall for r in results}
    one, more = walls.get("shardstore ingest (1 more rank)"), results[-1].wall
    cp, synced = walls.get("cp -r"), walls.get("cp -r + sync")
    if one and more and cp and synced:
        per_file = (more - one) / (files - 3)
        results[-1].note = (f"per file, start-up left out ({files - 2} ranks minus 1): {per_file:.2f} s against "
                            f"cp -r's {cp / files:.2f} s ({per_file * files / cp:.1f}x) and cp -r + sync's "
                            f"{synced / files:.2f} s ({per_file * files / synced:.1f}x); all {sc.world} files: "
                            f"~{per_file * sc.world / 60:.0f} min on this machine")
    return results


def medians(runs: list[list[Result]]) -> list[Result]:
    """One row per contender over repeated runs of a scenario: the median wall time (this disk's speed
    varies by 2x from minute to minute), the largest peak RSS, the first run's note."""
    rows: dict[str, list[Result]] = {}
    for run in runs:
        for r in run:
            rows.setdefault(r.contender, []).append(r)
    merged = []
    for contender, rs in rows.items():
        walls = sorted(r.wall for r in rs if r.wall is not None)
        rss = [r.peak_rss for r in rs if r.peak_rss is not None]
        paired = [(r.paired, r.paired_min, r.paired_max, r.pairs) for r in rs
                  if r.paired is not None and r.paired_min is not None and r.paired_max is not None]
        note = rs[0].note + (f" (median of {len(walls)})" if len(walls) > 1 else "")
        merged.append(Result(rs[0].scenario, contender, walls[len(walls) // 2] if walls else None,
                             max(rss) if rss else None, note.strip(),
                             statistics.median(p[0] for p in paired) if paired else None,
                             min((p[1] for p in paired), default=None), max((p[2] for p in paired), default=None),
                             sum(p[3] for p in paired)))
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description="shardstore benchmark harness")
    ap.add_argument("--scenarios", default="w8,w256,w1024,w1024-7b,large,hsdp,dcp")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--no-olmo", action="store_true", help="skip OLMo's unsharder")
    ap.add_argument("--repeat", type=int, default=1, help="run each scenario this many times and report each "
                    "contender's median wall time (OLMo's unsharder, minutes a run, only in the first)")
    ap.add_argument("--pairs", type=int, default=5, help="runs of each shardstore contender, each just after its "
                    "floor (A B A B ...): its row gives the median of the paired ratios, min and max")
    ap.add_argument("--contenders", default="", help="only contenders whose name contains one of these (comma "
                    "separated), replacing just their rows in results.json")
    ap.add_argument("--deepspeed", metavar="PY", help="also the DeepSpeed ZeRO rows, generated and timed "
                    "against zero_to_fp32.py with this Python (it needs deepspeed)")
    args = ap.parse_args()
    compile_shardstore()
    if args.deepspeed:
        from deepspeed_bench import run as run_deepspeed

        run_deepspeed(argparse.Namespace(out=args.out, ds_python=args.deepspeed, repeat=5))
        if not args.scenarios:
            return
    with_olmo = not args.no_olmo and ensure_olmo()
    if not args.no_olmo and not with_olmo:
        print("warning: could not import OLMo's unsharder; its rows are skipped", file=sys.stderr)
    contenders = [c for c in args.contenders.split(",") if c]
    results: list[Result] = []
    sizes: dict[str, int] = {}
    previous = args.out / "results.json"
    if previous.exists():  # other scenarios' rows stay; a scenario run again replaces its own
        old = json.loads(previous.read_text())
        results, sizes = [Result(**r) for r in old["results"]], old["sizes"]
    for key in args.scenarios.split(","):
        sc = SCENARIOS[key]
        new = medians([run_scenario(sc, args.out, with_olmo and i == 0, contenders, args.pairs)
                       for i in range(args.repeat)])
        if sc.subset:
            new = per_file_note(new, sc, len(checkpoint_files(sc, args.out / "ckpt" / sc.name.split(" ")[0])))
        replaced = {(r.scenario, r.contender) for r in new}
        results = [r for r in results if (r.scenario, r.contender) not in replaced
                   and (contenders or r.scenario != sc.name)] + new
        sizes[sc.name] = sum(f.stat().st_size for f in checkpoint_files(sc, args.out / "ckpt" / sc.name.split(" ")[0]))
    order = {name: i for i, name in enumerate(s.name for s in SCENARIOS.values())}
    # the disk first, then shardstore, then today's tool, whatever order merged runs left them in
    rank = (lambda c: 0 if c.startswith(("cat", "cp")) else 2 if c.startswith(("OLMo", "dcp_to")) else 1)
    results.sort(key=lambda r: (order.get(r.scenario, 99), rank(r.contender)))
    machine = (f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
               f"{platform.python_implementation()} {platform.python_version()}, {disk_of(args.out)}, "
               f"{time.strftime('%Y-%m-%d')}")
    text = table(results, sizes)
    print(f"\n{machine}\n\n{text}")
    (args.out / "results.json").write_text(json.dumps({"machine": machine, "sizes": sizes,
                                                       "results": [asdict(r) for r in results]}, indent=1))
    plot(results, args.out / "bench.png", {sc.name: sc.world for sc in SCENARIOS.values()})
    shutil.copy(args.out / "bench.png", HERE.parent / "docs" / "img" / "benchmarks.png")  # the docs show it


if __name__ == "__main__":
    main()
