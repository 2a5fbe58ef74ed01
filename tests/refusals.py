"""The command line as the refusal tests run it: every `unshard` the real run refuses up front is run again
as `--dry-run`, so that every refusal test of the suite also holds the dry run to the real run's checks.

A dry run must refuse, with the same line, whatever the real run refuses before it reads a unit, and it
never leaves OUT behind. (A refusal up front leaves nothing that the dry run after it could see.) Only
what a unit's own bytes reveal (a pickle's payload, a forged tensor inside a rank file) is the real run's
alone: `AT_INGEST` lists those refusals, by the words of their lines, so that a new up-front check the dry
run misses fails here.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# The command line's own footprint is ~300 MB of address space (Python, numpy, zarr); every input here is
# a few MB at most, so a ceiling of 512 MB leaves room for what the file justifies and none for what its
# numbers merely claim.
ADDRESS_SPACE = 512 << 20
TIMEOUT = 300

# Refusals that only reading a unit can make (the dry run reads what planning needs, not every unit).
AT_INGEST = ("refusing to load global", "refusing getattr",
             "reached by too many paths",  # a unit's values are walked as they are stored
             "a rerun into the same OUT resumes from it")  # units were accepted before this one was refused


def cli(*args: object, limit: bool = False, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m shardstore ARGS` (under an address-space cap with `limit`); an `unshard` refused up
    front runs again as `--dry-run`, its result kept as the returned process's `dry` attribute."""
    argv = [str(a) for a in args]
    proc = _run(argv, limit, cwd)
    proc.dry = None  # type: ignore[attr-defined]
    lines = error_lines(proc)
    if argv[:1] == ["unshard"] and "--dry-run" not in argv and proc.returncode == 1 \
            and not any(words in line for line in lines for words in AT_INGEST):
        out = Path(cwd or ".", argv[2]) if len(argv) > 2 and not argv[2].startswith("-") else None
        existed = out is not None and out.exists()
        proc.dry = _run([*argv, "--dry-run"], limit, cwd)  # type: ignore[attr-defined]
        assert out is None or existed or not out.exists(), f"the dry run left {out} behind"
    return proc


def _run(argv: list[str], limit: bool, cwd: Path | None) -> subprocess.CompletedProcess[str]:
    """`python -m shardstore ARGV`, forked from a warm server (tests/cli_server.py)."""
    return _SERVER.run(argv, ADDRESS_SPACE if limit else 0, Path(cwd or ".").resolve())


def _environment() -> dict[str, str]:
    """The environment a command line would start with, but for the variable the server sets per request."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


class _Server:
    """tests/cli_server.py, started at this process's first command line (one per pytest-xdist worker) and
    again whenever the environment a command would start with is no longer the server's (a fixture set
    a variable)."""

    def __init__(self) -> None:
        self.environment: dict[str, str] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.outputs = Path()
        self.pending = b""

    def run(self, argv: list[str], limit: int, cwd: Path) -> subprocess.CompletedProcess[str]:
        if self.proc is None or self.proc.poll() is not None or self.environment != _environment():
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
            self.environment = _environment()
            if not self.outputs.name:  # the children's output files, removed when this process ends
                self.outputs = Path(tempfile.mkdtemp(prefix="shardstore-cli-"))
                atexit.register(shutil.rmtree, self.outputs, True)
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_server"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, bufsize=0, cwd=Path(__file__).parents[1])
            self.pending = b""
        assert self.proc.stdin
        out, err = self.outputs / "stdout", self.outputs / "stderr"
        out.write_bytes(b""), err.write_bytes(b"")
        request = {"argv": argv, "cwd": str(cwd), "limit": limit, "stdout": str(out), "stderr": str(err),
                   "test": os.environ.get("PYTEST_CURRENT_TEST")}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        pid = self._reply(TIMEOUT)["pid"]
        try:
            status = self._reply(TIMEOUT)["status"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            raise subprocess.TimeoutExpired(["shardstore", *argv], TIMEOUT) from None
        return subprocess.CompletedProcess([sys.executable, "-m", "shardstore", *argv], status,
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))

    def _reply(self, timeout: float) -> dict[str, int]:
        assert self.proc and self.proc.stdout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired("tests.cli_server", timeout)
            chunk = os.read(fd, 4096)
            assert chunk, "tests/cli_server.py ended"
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        reply: dict[str, int] = json.loads(line)
        return reply


_SERVER = _Server()


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip() and "%|" not in line]


def assert_refused(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 1 with exactly one `shardstore: error:` line holding every needle (no traceback, no
    MemoryError); for an `unshard`, the dry run refused it with the same line, or the refusal is one only
    reading a unit can make. The line is returned."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("shardstore: error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "MemoryError" not in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    dry = getattr(proc, "dry", None)
    if dry is not None:
        assert dry.returncode == 1 and error_lines(dry) == lines, \
            f"the real run refused up front, the dry run did not say the same: {dry.returncode} {dry.stderr[-2000:]}"
    return lines[0]


def assert_step_is_checked(genuine: Path, tmp_path: Path, step: int, records: str) -> None:
    """A genuine checkpoint of `step` copied into a folder named for step + 1 is refused in one line naming
    the file that `records` it (a path inside the checkpoint), nothing left; in a folder of its own step
    it unshards."""
    wrong = tmp_path / f"step{step + 1}"
    shutil.copytree(genuine, wrong)
    assert_refused(cli("unshard", wrong, tmp_path / "out", "-q"),
                   f"{wrong / records}: records global_step {step}, but its folder is {wrong.name}")
    assert not (tmp_path / "out").exists()
    shutil.copytree(genuine, tmp_path / f"step{step}")
    assert cli("unshard", tmp_path / f"step{step}", tmp_path / "ok", "-q").returncode == 0
