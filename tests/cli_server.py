"""A warm start for the command line, which the suite runs about a thousand times (tests/refusals.py).

`python -m shardstore` spends most of a refused run importing the package (~0.5 s of ~0.6 s here, three
times that on a busy machine). This server imports the package (its command line and every stage a
command imports when it runs; not torch, whose presence changes how the runner starts its workers), then,
for each request, forks: the child takes the request's folder, address-space cap and output files,
returns out of the loop and runs `shardstore/__main__.py` at the top level, so that its exit (SystemExit,
a traceback, threads joined, atexit's work, the streams flushed) is the interpreter's own, exactly as in
a process started for it. The server is single-threaded (checked) and has run nothing of the package's
but its imports, so a child is the fresh process minus the start-up.

What a forked child cannot be: a process started with another environment (the client starts a real
process where the environment differs from the server's) or with its own hash seed (the children share
the server's).

Protocol, one JSON line each way: {"argv", "cwd", "limit", "stdout", "stderr", "test"} in (`test`:
pytest's PYTEST_CURRENT_TEST, the one variable that changes as the suite runs); {"pid"} as soon as
the child exists, then {"status"} (as `subprocess` reports it: the exit code, or minus the signal).
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys
import threading
from typing import Any

for _module in ("shardstore.cli", "shardstore.export", "shardstore.ingest"):
    importlib.import_module(_module)

assert threading.active_count() == 1 and "torch" not in sys.modules, "tests/cli_server.py cannot fork safely"


def _child(request: dict[str, Any]) -> None:
    """Become the command's process: its folder, its cap, its streams (stdin empty, as a captured run's)."""
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # `-m` puts the working folder first
    if request["limit"]:
        resource.setrlimit(resource.RLIMIT_AS, (request["limit"], request["limit"]))
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = ["shardstore", *request["argv"]]
    os.environ.pop("PYTEST_CURRENT_TEST", None)
    if request["test"] is not None:
        os.environ["PYTEST_CURRENT_TEST"] = request["test"]


def serve() -> bool:
    """Answer requests until stdin ends (False); True in a child, which then runs the command."""
    requests, replies = sys.stdin.buffer, sys.stdout
    for line in requests:
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
            return True
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()
    return False


if __name__ == "__main__" and serve():
    import runpy

    runpy.run_module("shardstore", run_name="__main__", alter_sys=True)
