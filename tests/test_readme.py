"""The README's shell blocks, as written: the quick start runs, line by line, in a fresh folder with this
interpreter's venv standing for `.venv/` (pip lines aside: the test's environment has what they install)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _block(after: str) -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(rf"## {after}\n.*?```bash\n(.*?)```", readme, re.S).group(1)  # type: ignore[union-attr]


def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    """Every line but the pip install, with `.venv/bin/` this interpreter's own; the shell stops at the
    first failure (`set -e`), and what it leaves is a folder transformers loaded."""
    lines = [line for line in _block("Quick start").splitlines() if "pip install" not in line]
    assert lines[0] == "set -e" and any("shardstore unshard" in line for line in lines)
    script = "\n".join(lines).replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "LlamaForCausalLM" in run.stdout and (tmp_path / "demo" / "hf" / "model.safetensors").is_file()
    assert "model/model.embed_tokens.weight" in run.stdout  # ls, then show's slice
    # the fixture script says what it made, and torch's notices about FSDP1's APIs it uses stay out of sight
    assert "wrote demo/ckpt: FSDP ShardedTensor rank files rank0.pt ... rank3.pt (world size 4) of a tiny Llama" \
           in run.stdout and "the model's config: demo/ckpt/hf-config/config.json" in run.stdout
    assert "Warning" not in run.stderr, run.stderr[-3000:]


def test_the_test_command_is_what_ci_runs() -> None:
    """`.ci/run` runs the README's set-up and test commands, unchanged and in order (the type check and
    the docs build start between them)."""
    commands = _block("Development").strip().splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert len(commands) == 2 and all(c in ci for c in commands), commands
    assert ci.index(commands[0]) < ci.index(commands[1])
