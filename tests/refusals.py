"""The command line as the refusal tests run it: every `unshard` the real run refuses up front is run again
as `--dry-run`, so that every refusal test of the suite also holds the dry run to the real run's checks.

A dry run must refuse, with the same line, whatever the real run refuses before it reads a unit, and it
never leaves OUT behind. (A refusal up front leaves nothing that the dry run after it could see.) Only
what a unit's own bytes reveal (a pickle's payload, a forged tensor inside a rank file) is the real run's
alone: `AT_INGEST` lists those refusals, by the words of their lines, so that a new up-front check the dry
run misses fails here.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

# The command line's own footprint is ~300 MB of address space (Python, numpy, zarr); every input here is
# a few MB at most, so a ceiling of 512 MB leaves room for what the file justifies and none for what its
# numbers merely claim.
ADDRESS_SPACE = 512 << 20

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
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    return subprocess.run([sys.executable, "-m", "shardstore", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd, preexec_fn=cap if limit else None)


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
    import shutil

    wrong = tmp_path / f"step{step + 1}"
    shutil.copytree(genuine, wrong)
    assert_refused(cli("unshard", wrong, tmp_path / "out", "-q"),
                   f"{wrong / records}: records global_step {step}, but its folder is {wrong.name}")
    assert not (tmp_path / "out").exists()
    shutil.copytree(genuine, tmp_path / f"step{step}")
    assert cli("unshard", tmp_path / f"step{step}", tmp_path / "ok", "-q").returncode == 0
