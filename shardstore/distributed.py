"""Dask, as the runner's remote backend: one task per batch of rank files (ingest) or per output file (export).

The store must be reachable from every worker (object storage, or a shared file system); so must the rank
files. A failed task ends the run with one line naming the rank file and the worker; since committed ranks
are skipped, rerunning the same command retries only what is missing. A worker that dies mid-task is
replaced and its task rerun by Dask: the task's writes are atomic and idempotent, so that is safe.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Callable

from .errors import ShardstoreError
from .locations import service_errors


def _named(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a task; a user-facing error says which worker it happened on."""
    try:
        return fn(*args)
    except ShardstoreError as exc:
        from distributed import get_worker

        raise type(exc)(f"{exc} (on Dask worker {get_worker().address})") from None


def run_tasks(scheduler: str, jobs: int, fn: Callable[..., Any], args: list[tuple], names: list[str],
              on_done: Callable[[Any], None]) -> None:
    """Run fn(*a) for every a in `args` as Dask tasks; `scheduler` is an address or "dask" (a LocalCluster
    of `jobs` worker processes). Results reach `on_done` as they come; the first failure ends the run."""
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise ShardstoreError("--scheduler needs Dask: pip install 'shardstore[dask]'") from None
    with contextlib.ExitStack() as stack:
        if scheduler == "dask":
            cluster = stack.enter_context(LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True,
                                                       host="127.0.0.1", dashboard_address=None))
            client = stack.enter_context(Client(cluster))
        else:
            try:
                client = stack.enter_context(Client(scheduler, timeout="30s"))
            except OSError as exc:
                raise ShardstoreError(f"{scheduler}: cannot reach the Dask scheduler ({exc})") from None
        run = uuid.uuid4().hex[:8]
        futures = {client.submit(_named, fn, *a, pure=False, retries=2, key=f"shardstore-{name}-{run}"): name
                   for a, name in zip(args, names)}
        from distributed import KilledWorker

        for future in as_completed(futures):
            try:
                result = future.result()
            except ShardstoreError:
                raise
            except (KilledWorker, *service_errors()) as exc:  # type: ignore[misc]  # (a tuple built at run time)  # a worker died for good, or lost the network
                raise ShardstoreError(f"{futures[future]}: task failed on Dask ({type(exc).__name__}: {exc})") from None
            on_done(result)
