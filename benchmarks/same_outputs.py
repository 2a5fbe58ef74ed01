"""Do two versions of shardstore write the same bytes? `python benchmarks/same_outputs.py BEFORE [AFTER]`
(commits; AFTER defaults to HEAD) unshards every checkpoint kept in the repository (tests/fixtures/data/*,
tests/corpus/data) with each version, in every output format (safetensors, torch, torch --single-file,
dcp, hf, safetensors --dtype bf16), and compares every file written, by SHA-256, and every refusal's line.

A refactoring must leave them all the same. torch zips carry a random `.data/serialization_id` (as
`torch.save` writes one), so both versions run with it fixed (a `sitecustomize` on their path); the
refusals' temporary paths are left out of the comparison. Each version runs from a git worktree of its
commit, with this checkout's built C extension copied in (its results equal the pure-Python ones).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = [["--format", "safetensors"], ["--format", "torch"], ["--format", "torch", "--single-file"],
           ["--format", "dcp"], ["--format", "hf"], ["--format", "safetensors", "--dtype", "bf16"]]
FIXED_ID = "import secrets\nsecrets.token_hex = lambda n=32: '0' * (2 * n)\n"


def checkpoints() -> list[Path]:
    roots = [p for p in sorted((ROOT / "tests" / "fixtures" / "data").iterdir()) if p.is_dir()]
    roots.append(ROOT / "tests" / "corpus" / "data")
    return [c for r in roots for c in sorted(r.iterdir())
            if c.is_dir() and not c.name.startswith(".") and not c.name.endswith((".merged", ".zero_to_fp32"))]


def outputs(code: Path, site: Path, work: Path) -> dict[str, object]:
    """Every run's files by SHA-256, or its refusal's last line."""
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{site}"}
    got: dict[str, object] = {}
    for ckpt in checkpoints():
        for fmt in FORMATS:
            out = Path(tempfile.mkdtemp(dir=work)) / "out"
            proc = subprocess.run([sys.executable, "-m", "shardstore", "unshard", str(ckpt), str(out), "-q", *fmt],
                                  capture_output=True, text=True, env=env, cwd=work)
            key = f"{ckpt.relative_to(ROOT)} {' '.join(fmt)}"
            if proc.returncode:
                got[key] = re.sub(re.escape(str(work)) + r"\S*", "TMP", (proc.stderr.strip().splitlines() or [""])[-1])
            else:
                got[key] = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
                            for p in sorted(out.rglob("*")) if p.is_file() and not p.name.startswith(".shardstore")}
            shutil.rmtree(out.parent, ignore_errors=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after", nargs="?", default="HEAD")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="same-outputs-"))
    try:
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(FIXED_ID)
        runs = []
        for name, commit in (("before", args.before), ("after", args.after)):
            tree = work / name
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), commit],
                           check=True, capture_output=True)
            for built in (ROOT / "shardstore" / "read" / "primitives").glob("_pickle_scan*.so"):
                shutil.copy(built, tree / "shardstore" / "read" / "primitives")
            runs.append(outputs(tree, work / "site", work))
        before, after = runs
        differ = sorted(k for k in before if before[k] != after.get(k))
        written = [files for files in before.values() if isinstance(files, dict)]
        print(f"{len(written)} outputs ({sum(map(len, written))} files) and {len(before) - len(written)} refusals "
              f"compared: {len(differ)} differ")
        for key in differ:
            print(f"  {key}:\n    before {before[key]}\n    after  {after.get(key)}")
        sys.exit(1 if differ else 0)
    finally:
        for name in ("before", "after"):
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / name)],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
