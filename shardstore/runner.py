"""The one worker pool, for ingestion and export alike: tasks run in this process, in local worker
processes, or on a Dask cluster, and their results come back in completion order.

Local workers start when the pool opens, so their start-up overlaps whatever the caller does before the
first task (planning the store). On Linux, from a process running a single Python thread that has not
loaded torch, they are forked: ready in milliseconds, where a spawned worker spends 0.3 s or more
importing numpy and shardstore (a third of a one-pass unshard of a 0.5 GB model, on a cold cache).
A fork is wrong:
- once this process holds a large parse (`FORK_MOST`), which a forked worker would start with and copy
  page by page as it touches it;
- beside other threads (a notebook kernel, Zarr's event loop, a Dask client, a progress bar's monitor),
  a fork copies those threads' locks but not the threads that would release them;
- once torch is loaded, its OpenMP thread pool may have run, and GNU OpenMP hangs in a forked child
  that uses it again (workers cast dtypes with torch). A worker forked before torch loads imports it
  afresh.
Then, on Linux (Python 3.10 to 3.13), workers come from a fork server of shardstore's own: a small
process started once, the first time a pool needs it, which imports what a worker needs (`PRELOAD`) and
forks each worker from itself (single-threaded, without torch, without the caller's memory). A notebook
or a test process that runs many conversions pays the imports once, not twice per call (0.46 s of CPU a
worker). It is started by the main thread (a pool a thread opens first spawns its workers), and dies with
the process (shardstore/served.py). Elsewhere they are spawned. Either way a worker runs the same
module-level functions on the same arguments, in this process's environment variables and working
directory as they were when the pool opened.

A spawned child normally imports the parent's `__main__` first, which re-runs a script that has no
`if __name__ == "__main__":` guard (and then fails as it starts a pool of its own); so would a fork
server's child. Workers only ever run shardstore's own module-level functions, so they start without it
(`_mainless`): the API works the same from a script, a notebook or `python -c`.
"""

from __future__ import annotations

import io
import itertools
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable

from .distributed import run_tasks

_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")
_LAUNCH = threading.Lock()

# Tasks queued for each local worker beyond the one it runs: one keeps it busy while the coordinator takes
# the last one's result and builds the next.
QUEUED = 1

# what the fork server imports before it forks workers: the modules of the workers' tasks
PRELOAD = ["shardstore.served", "shardstore.ingest", "shardstore.export.safetensors", "shardstore.export.dcp"]

if sys.platform != "win32":
    from multiprocessing import forkserver, popen_forkserver, popen_spawn_posix, reduction, spawn, util
    from multiprocessing.context import set_spawning_popen

    # shardstore's own fork server, not multiprocessing's: the caller's own use of that one (with torch
    # preloaded for its data loaders, say) and shardstore's never start each other's processes
    _SERVER = forkserver.ForkServer()
    _SERVER.set_forkserver_preload(PRELOAD)

    def _mainless(preparation: dict[str, Any]) -> dict[str, Any]:
        """The preparation data a child is sent, without the parent's `__main__` to import."""
        return {k: v for k, v in preparation.items() if k not in _MAIN_KEYS}

    class _MainlessSpawnPopen(popen_spawn_posix.Popen):
        def _launch(self, process_obj: Any) -> None:
            with _LAUNCH:  # the preparation data is made by a module function: swapped for this launch only
                original = spawn.get_preparation_data
                spawn.get_preparation_data = lambda name: _mainless(original(name))
                try:
                    super()._launch(process_obj)  # type: ignore[misc]  # (typeshed leaves the Popen internals out)
                finally:
                    spawn.get_preparation_data = original

    class _ServedPopen(popen_forkserver.Popen):
        """A worker forked by `_SERVER`, not sent `__main__`: multiprocessing's own launch (the same in
        Python 3.10 to 3.13) with the server and the preparation data ours."""

        def _launch(self, process_obj: Any) -> None:
            prep = _mainless(spawn.get_preparation_data(process_obj._name))
            buf = io.BytesIO()
            set_spawning_popen(self)
            try:
                reduction.dump(prep, buf)
                reduction.dump(process_obj, buf)
            finally:
                set_spawning_popen(None)
            self.sentinel, w = _SERVER.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
            parent_w = os.dup(w)  # the child's sentinel of this process
            closing = util.close_fds  # type: ignore[attr-defined]
            self.finalizer = util.Finalize(self, closing, (parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)

    class _MainlessSpawnProcess(multiprocessing.context.SpawnProcess):
        @staticmethod
        def _Popen(process_obj: Any) -> _MainlessSpawnPopen:
            return _MainlessSpawnPopen(process_obj)

    class _ServedProcess(multiprocessing.context.ForkServerProcess):
        @staticmethod
        def _Popen(process_obj: Any) -> _ServedPopen:
            return _ServedPopen(process_obj)

    class _MainlessSpawn(multiprocessing.context.SpawnContext):
        Process = _MainlessSpawnProcess

    class _ServedContext(multiprocessing.context.ForkServerContext):
        Process = _ServedProcess

    SPAWN: multiprocessing.context.BaseContext = _MainlessSpawn()
    FORKSERVER: multiprocessing.context.BaseContext = _ServedContext()
else:  # Windows spawns through its own Popen; there the usual main guard applies
    SPAWN = FORKSERVER = multiprocessing.get_context("spawn")


# Fork only while this process holds less than this: beyond it, planning parsed a large checkpoint (the
# workers are sent their units' shares of it), which a forked worker would start with. DeepSeek-V3's
# structure (a 35 MB .metadata, parsed to 250 MB resident): each forked worker copied 210 MB of its
# parent's pages as it touched them, where a spawned one holds 60 MB.
FORK_MOST = 192 << 20


def start_method() -> str:
    """How local workers would start now: "fork", "forkserver" or "spawn" (see the module's docstring)."""
    if sys.platform != "linux":
        return "spawn"
    if threading.active_count() == 1 and "torch" not in sys.modules and _resident() < FORK_MOST:
        return "fork"
    if sys.version_info < (3, 14) and (threading.current_thread() is threading.main_thread()
                                       or _SERVER._forkserver_pid is not None):  # type: ignore[attr-defined]
        return "forkserver"  # (started by the main thread: it ends with the process, shardstore/served.py)
    return "spawn"  # (_ServedPopen follows multiprocessing's internals as they are in Python 3.10 to 3.13)


def _resident() -> int:
    """This process's resident bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _warm_up() -> None:
    """Runs in a fresh worker: importing this module (to unpickle the call) is the warm-up."""


def _worker_init(parent: int, environment: dict[str, str] | None) -> None:
    """A worker's initializer: it dies with its parent (the coordinator, or the fork server, which dies
    with the coordinator: shardstore/served.py), and keeps what it frees for its next file. A fork
    server's worker starts in the server's environment, and is given the coordinator's."""
    _die_with(parent)
    if environment is not None:
        os.environ.clear()
        os.environ.update(environment)
    _keep_freed_memory()


# glibc's mallopt parameters (malloc.h), and its ceiling on the mmap threshold on 64-bit systems
_M_TOP_PAD, _M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX = -2, -3, 32 << 20
# what the heap keeps at its top when it shrinks: more than one rank file's transient blocks at W=256 (4 MB)
_TOP_PAD = 16 << 20


def _keep_freed_memory() -> None:
    """Keep what a worker frees for its next file. Each rank file needs the same large transient blocks
    (the skimmer's memo columns: 1 MB each at W=256), which glibc maps afresh or hands back to the kernel
    as soon as they are freed: the next file's blocks then come back as fresh zero pages, a page fault
    each. At W=256 that was 1.0 of the skimmer's 1.4 ms a file. Blocks up to 32 MB now come from the heap,
    and the heap keeps 16 MB free when it shrinks, so a worker holds at most that much more between files
    (the same faults are saved as by keeping everything freed, which held up to 512 MB a worker). glibc
    only; elsewhere nothing changes."""
    if sys.platform != "linux":
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        libc.mallopt(_M_TOP_PAD, _TOP_PAD)
    except (OSError, AttributeError):
        pass


def _die_with(parent: int) -> None:
    """The worker ends when the process that started it does. A coordinator killed
    outright (SIGKILL, the OOM killer) never shuts its pool down, and its idle workers would wait on the
    task queue for ever (every worker holds that pipe open, so none sees it close). Linux sends the worker
    SIGKILL when its parent goes (PR_SET_PDEATHSIG); elsewhere, and against a parent that went before the
    call took effect, a thread watches for the worker being handed to another parent."""
    if sys.platform == "linux":
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="shardstore-parent-watch", daemon=True).start()


class Pool:
    """`jobs` workers: inline when 1 (unless `processes`), local processes when more, Dask tasks with
    `scheduler` (an address, or "dask" for a local cluster of `jobs` worker processes)."""

    def __init__(self, jobs: int, scheduler: str | None = None, processes: bool = False):
        self.jobs, self.scheduler = max(1, jobs), scheduler
        self._executor: ProcessPoolExecutor | None = None
        self.start_method: str | None = None  # local workers' (start_method())
        if scheduler is None and (self.jobs > 1 or processes):
            self.start_method = start_method()
            context, parent, environment = SPAWN, os.getpid(), None
            if self.start_method == "fork":
                context = multiprocessing.get_context("fork")
            elif self.start_method == "forkserver":  # the server's child, in the server's environment
                _SERVER.ensure_running()
                parent = _SERVER._forkserver_pid  # type: ignore[attr-defined]
                context, environment = FORKSERVER, dict(os.environ)
            self._executor = ProcessPoolExecutor(max_workers=self.jobs, mp_context=context, initializer=_worker_init,
                                                 initargs=(parent, environment))
            for _ in range(self.jobs):
                self._executor.submit(_warm_up)

    @property
    def inline(self) -> bool:
        """Tasks run in this process (so `fn` may be any callable, holding objects of this process)."""
        return self.scheduler is None and self._executor is None

    def run(self, fn: Callable[..., Any], args: Iterable[tuple], names: list[str], on_done: Callable[[Any], None],
            here: Callable[[], Any] | None = None) -> None:
        """fn(*a) for every a in `args`; each result goes to `on_done` as it comes; the first failure ends the
        run (and what has not started is cancelled). `names` name the tasks on Dask. `here` is one more task
        that must run in this process (it holds an open file), on a thread beside the workers; the run
        returns or fails only once it has ended, so nothing is left writing.

        Local workers are given at most `QUEUED` tasks each beyond the one they run, and `args` is taken
        only as far as that: a task (a unit's share of a parsed .metadata, its part of the manifest) is
        built when a worker is about to need it, so the tasks of a W=4096 run are not all held at once."""
        if self.scheduler is not None:
            assert here is None, "a Dask run has no task of its own"
            run_tasks(self.scheduler, self.jobs, fn, list(args), names, on_done)
        elif self._executor is None:
            if here is not None:
                on_done(here())
            for a in args:
                on_done(fn(*a))
        else:
            executor, waiting, most = self._executor, iter(args), self.jobs * (1 + QUEUED) + (here is not None)
            with ThreadPoolExecutor(1) as thread:
                pending: set[Future[Any]] = set() if here is None else {thread.submit(here)}
                try:
                    while True:
                        pending.update(executor.submit(fn, *a) for a in itertools.islice(waiting, most - len(pending)))
                        if not pending:
                            break
                        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                        for fut in finished:
                            on_done(fut.result())
                except BaseException:
                    for fut in pending:
                        fut.cancel()
                    raise

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """One task on a local worker, for callers that poll (watch)."""
        assert self._executor is not None, "submit needs local worker processes"
        return self._executor.submit(fn, *args)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
