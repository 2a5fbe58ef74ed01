"""The worker pool: how local workers start, and that it makes no difference to what they write."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardstore import runner
from tests.conftest import assert_bitwise_equal, expected

# Run in a fresh interpreter: this test process may be running other threads (a Dask cluster's, Zarr's).
# With "thread", a thread that waits is started first, as a notebook kernel or a Dask client would.
UNSHARD = """
import hashlib, json, pathlib, sys, threading
import shardstore
from shardstore import runner

methods = []
original = runner.Pool.__init__
def spy(self, *args, **kwargs):
    original(self, *args, **kwargs)
    methods.append(self.start_method)
runner.Pool.__init__ = spy

stop = threading.Event()
if sys.argv[3] == "thread":
    threading.Thread(target=stop.wait).start()
try:
    shardstore.unshard(sys.argv[1], sys.argv[2], jobs=2, dtype="bfloat16")  # workers cast with torch
finally:
    stop.set()
digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in pathlib.Path(sys.argv[2]).iterdir()}
print(json.dumps({"methods": methods, "digests": digests}))
"""


def _unshard(src: Path, out: Path, threads: str) -> dict:
    run = subprocess.run([sys.executable, "-c", UNSHARD, str(src), str(out), threads], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_forked_and_served_workers_write_the_same_bytes(checkpoints, tmp_path: Path) -> None:
    """A single-threaded process that has not loaded torch forks its workers (ready at once); beside
    another thread they come from the fork server. The output is the same, byte for byte, cast by torch in
    the workers."""
    src = checkpoints(4)
    forked = _unshard(src, tmp_path / "forked", "none")
    spawned = _unshard(src, tmp_path / "spawned", "thread")
    assert forked["methods"] == ["fork"] and spawned["methods"] == ["forkserver"]
    assert forked["digests"] and forked["digests"] == spawned["digests"]
    want = {k: v.to(torch.bfloat16) for k, v in expected(src)["model"].items()}
    assert_bitwise_equal(load_file(tmp_path / "forked" / "model.safetensors"), want, "bf16")


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_served_workers_read_dcp_files_from_their_shares(dcp_checkpoints, tmp_path: Path) -> None:
    """A fork server's worker holds none of the .metadata its coordinator parsed: it reads each .distcp file
    from the share its task brought, and writes into the store through its task's part of the manifest.
    The output is the same, byte for byte, as forked workers' and torch's own load."""
    src = dcp_checkpoints("hsdp")
    forked = _unshard(src, tmp_path / "forked", "none")
    spawned = _unshard(src, tmp_path / "spawned", "thread")
    assert forked["methods"] == ["fork"] and spawned["methods"] == ["forkserver"]
    assert forked["digests"] and forked["digests"] == spawned["digests"]
    want = {k: v.to(torch.bfloat16) for k, v in torch.load(f"{src}.expected.pt.ref", weights_only=False)["model"].items()}
    assert_bitwise_equal(load_file(tmp_path / "spawned" / "model.safetensors"), want, "bf16")


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_a_process_holding_a_large_parse_does_not_fork() -> None:
    """A forked worker would start with the coordinator's parse of a large checkpoint, and copy it page by
    page as it touched it."""
    probe = "from shardstore import runner; held = b'x' * {}; print(runner.start_method())"
    methods = [subprocess.run([sys.executable, "-c", probe.format(size)], capture_output=True, text=True,
                              check=True).stdout.strip() for size in (1, runner.FORK_MOST)]
    assert methods == ["fork", "forkserver"]


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_a_process_that_loaded_torch_does_not_fork() -> None:
    """A forked worker casting with torch could hang in the OpenMP pool the parent's torch ran."""
    probe = "import sys; {}from shardstore import runner; print(runner.start_method())"
    methods = [subprocess.run([sys.executable, "-c", probe.format(first)], capture_output=True, text=True,
                              check=True).stdout.strip() for first in ("", "import torch; ")]
    assert methods == ["fork", "forkserver"]


# A script with no main guard, torch loaded (workers come from the fork server), that opens two pools and
# asks their workers for an environment variable and the working directory, changed between the pools.
SERVED = """
import json, os
import torch
from shardstore import runner

print("script started", flush=True)

def seen():
    answers = []
    with runner.Pool(2) as pool:
        assert pool.start_method == "forkserver"
        pool.run(os.getenv, [("SHARDSTORE_PROBE",)] * 4, ["env"] * 4, answers.append)
        pool.run(os.getcwd, [()] * 4, ["cwd"] * 4, answers.append)
    return sorted(answers, key=str)

first = seen()
os.environ["SHARDSTORE_PROBE"] = "set later"
os.mkdir("inner")
os.chdir("inner")
print(json.dumps([first, seen()]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is used on Linux")
def test_fork_server_workers_run_in_the_coordinators_environment_and_folder(tmp_path: Path) -> None:
    """The server started with the first pool; the second pool's workers, forked from it, still see the
    environment variables and working directory the coordinator has when that pool opens, and neither
    pool's workers re-run the script."""
    (tmp_path / "script.py").write_text(SERVED)
    run = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("script started") == 1, run.stdout
    first, second = json.loads(run.stdout.splitlines()[-1])
    real = str(tmp_path.resolve())
    assert first == [real] * 4 + [None] * 4
    assert second == [str(Path(real) / "inner")] * 4 + ["set later"] * 4


def test_an_inline_or_dask_pool_starts_no_local_workers() -> None:
    assert runner.Pool(1).start_method is None
    assert runner.Pool(2, scheduler="tcp://127.0.0.1:1").start_method is None  # no connection until run


# A coordinator that starts its workers, says who they are (a fork server's are the server's children),
# and waits to be killed.
WAITS = """
import os, sys, time
from shardstore import runner
pool = runner.Pool(2)
pool.run(os.getpid, [()] * 8, ["pid"] * 8, lambda pid: None)  # every worker has started
parent = runner._SERVER._forkserver_pid if pool.start_method == "forkserver" else os.getpid()
children = open(f"/proc/{parent}/task/{parent}/children").read().split()
print(pool.start_method, parent, " ".join(children), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_workers_end_when_their_coordinator_is_killed(method: str) -> None:
    import signal
    import time

    code = WAITS if method == "fork" else "import torch\n" + WAITS  # torch loaded: the fork server's workers
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    started, parent, *pids = proc.stdout.readline().split()
    workers = [int(p) for p in pids] + ([int(parent)] if method == "forkserver" else [])  # the server too
    assert started == method and len(pids) >= 2 and all(Path(f"/proc/{w}").exists() for w in workers)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL  # the coordinator died, and did not shut its pool down

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 20
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers), [w for w in workers if alive(w)]


# Four 1 MB blocks made, touched and freed, round after round, as a worker's skimmer does for each rank
# file; the page faults of the later rounds, in a fresh interpreter (malloc's settings are per process).
ROUNDS = """
import resource, sys
import numpy as np
from shardstore import runner

if sys.argv[1] == "keep":
    runner._keep_freed_memory()
def round_():
    blocks = [np.ones(1 << 18, dtype=np.float32) for _ in range(4)]
    del blocks
round_(); round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_worker_keeps_the_memory_it_frees_for_the_next_file() -> None:
    """Without it, glibc returns the freed blocks to the kernel and every round faults them in again
    (8 rounds of 4 MB: ~8000 faults); a worker keeps them."""
    faults = {how: int(subprocess.run([sys.executable, "-c", ROUNDS, how], check=True, capture_output=True,
                                      text=True).stdout) for how in ("default", "keep")}
    assert faults["default"] > 4000  # the rounds fault as a worker's files did
    assert faults["keep"] < faults["default"] / 10


def test_tasks_are_taken_from_their_generator_only_as_workers_need_them() -> None:
    """A W=4096 run's tasks (each a unit's share of the parsed .metadata) are built as workers come free,
    never all at once: at most jobs x (1 + QUEUED) are taken beyond those whose results came back."""
    taken, done, ahead = [0], [0], []

    def tasks():  # type: ignore[no-untyped-def]
        for i in range(40):
            taken[0] += 1
            ahead.append(taken[0] - done[0])
            yield (f"SHARDSTORE_NO_SUCH_{i}",)

    def finished(result: object) -> None:
        assert result is None
        done[0] += 1

    with runner.Pool(2) as pool:
        assert pool.start_method is not None
        pool.run(os.getenv, tasks(), ["t"] * 40, finished)
    assert done[0] == taken[0] == 40
    assert max(ahead) == 2 * (1 + runner.QUEUED), ahead
