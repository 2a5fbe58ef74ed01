"""`average CKPT... OUT`: the weighted mean of checkpoints of one run, each read through the readers
(different world sizes here), bit for bit against torch computing the documented order from the
unsharded checkpoints; refusals in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.errors import ExportError
from tests.conftest import expected


def _torch_mean(states: list[dict[str, torch.Tensor]], weights: list[float], out: torch.dtype | None = None):
    """The documented order: acc = w0*x0; acc = acc + w1*x1 ...; float64 accumulator for float32, float32
    for the rest; rounded to nearest even into the output dtype (through float32 for bfloat16)."""
    total = sum(weights)
    mean = {}
    for name, first in states[-1].items():
        acc_type = torch.float64 if first.dtype in (torch.float32, torch.float64) else torch.float32
        acc = None
        for w, state in zip(weights, states):
            term = torch.tensor(w / total, dtype=torch.float64).to(acc_type) * state[name].to(acc_type)
            acc = term if acc is None else acc + term
        target = out or first.dtype
        mean[name] = acc.float().to(target) if target == torch.bfloat16 else acc.to(target)
    return mean


def test_the_mean_of_checkpoints_of_two_world_sizes_is_torchs_bit_for_bit(checkpoints, tmp_path: Path) -> None:
    a, b = checkpoints(2), checkpoints(3)
    states = [expected(a)["model"], expected(b)["model"]]
    assert any(not torch.equal(states[0][n], states[1][n]) for n in states[0])  # they do differ
    result = shardstore.average([a, b], tmp_path / "eq")
    got = load_file(tmp_path / "eq" / "model.safetensors")
    want = _torch_mean(states, [1.0, 1.0])
    assert result.averaged == len(want) and result.kept == []
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name].view(torch.uint8),
                                                                    want[name].view(torch.uint8)), name
    shardstore.average([a, b, a], tmp_path / "w", weights=[3, 1, 0.5], dtype="bf16")
    got = load_file(tmp_path / "w" / "model.safetensors")
    want = _torch_mean(states + [states[0]], [3, 1, 0.5], torch.bfloat16)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


def test_average_refuses_in_one_line(checkpoints, tmp_path: Path) -> None:
    a = checkpoints(2)
    with pytest.raises(ExportError, match="average takes two checkpoints or more"):
        shardstore.average([a], tmp_path / "one")
    with pytest.raises(ExportError, match="--weights: 2 non-negative numbers"):
        shardstore.average([a, a], tmp_path / "w", weights=[1, -1])
    with pytest.raises(ExportError, match="average writes safetensors and hf outputs, not torch"):
        shardstore.average([a, a], tmp_path / "t", format="torch")
    other = checkpoints(3, dtype="bfloat16")
    with pytest.raises(ExportError, match=rf"{other}: model/\S+ is bfloat16\[.*\] here but float32\[.*\] in {a}"):
        shardstore.average([other, a], tmp_path / "mixed")
    run = subprocess.run([sys.executable, "-m", "shardstore.cli", "average", str(a), str(tmp_path / "x")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "give two checkpoints or more, then OUT" in run.stderr
