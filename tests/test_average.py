"""`average CKPT... OUT`: the weighted mean of checkpoints of one run, each read through the readers
(different world sizes here), bit for bit against torch computing the documented order from the
unsharded checkpoints; refusals in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.errors import ExportError
from tests.conftest import assert_bitwise_equal, expected


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
    with pytest.raises(ExportError, match="unknown format 'zarr'"):
        shardstore.average([a, a], tmp_path / "t", format="zarr")
    with pytest.raises(ExportError, match="--include-optimizer: a safetensors output holds the model only"):
        shardstore.average([a, a], tmp_path / "t", include_optimizer=True)
    with pytest.raises(ExportError, match="--format torch writes the last checkpoint as it is: --dtype"):
        shardstore.average([a, a], tmp_path / "t", format="torch", dtype="bf16")
    other = checkpoints(3, dtype="bfloat16")
    with pytest.raises(ExportError, match=rf"{other}: model/\S+ is bfloat16\[.*\] here but float32\[.*\] in {a}"):
        shardstore.average([other, a], tmp_path / "mixed")
    run = subprocess.run([sys.executable, "-m", "shardstore.cli", "average", str(a), str(tmp_path / "x")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "give two checkpoints or more, then OUT" in run.stderr


def _loaded(folder: Path) -> dict[str, Any]:
    """Every torch file of an output, by file stem."""
    return {f.stem: torch.load(f, weights_only=False) for f in sorted(folder.glob("*.pt"))}  # (ours: a PosixPath value)


@pytest.mark.parametrize("include_optimizer", [False, True])
def test_a_torch_output_is_the_last_checkpoint_with_its_means(checkpoints, tmp_path: Path,
                                                               include_optimizer: bool) -> None:
    """--format torch: the last checkpoint's files as unshard writes them, the model's tensors (and with
    --include-optimizer the optimizer's moments) the mean, bit for bit against torch; step counters,
    param_groups and the trainer's values the last checkpoint's."""
    a, b = checkpoints(2), checkpoints(3)
    shardstore.unshard(b, tmp_path / "last", format="torch")
    want = _loaded(tmp_path / "last")
    result = shardstore.average([a, b], tmp_path / "avg", format="torch", weights=[1, 3],
                                include_optimizer=include_optimizer)
    got = _loaded(tmp_path / "avg")
    assert [f.name for f in result.files] == sorted(f.name for f in (tmp_path / "last").glob("*.pt"))
    states = [expected(a), expected(b)]
    means = _torch_mean([s["model"] for s in states], [1, 3])
    model = _only(want, means.keys())  # where the model's tensors sit in the files
    for name, tensor in means.items():
        _set(want, model[name], tensor)
    moments = {f"{p}/{m}": s["optim"]["state"][p][m] for s in states[-1:] for p in s["optim"]["state"]
               for m in ("exp_avg", "exp_avg_sq")}
    if include_optimizer:  # each moment is the mean; `step` (a small tensor) stays the last's
        avg = _torch_mean([{f"{p}/{m}": s["optim"]["state"][p][m] for p in s["optim"]["state"]
                            for m in ("exp_avg", "exp_avg_sq")} for s in states], [1, 3])
        for path, where in _only(want, moments.keys(), moments=True).items():
            _set(want, where, avg[path])
    assert_bitwise_equal(got, want)
    assert result.averaged == len(means) + (len(moments) if include_optimizer else 0)
    assert result.values > 0 and (not include_optimizer or all("exp_avg" not in k for k in result.kept))
    if include_optimizer:
        return
    run = subprocess.run([sys.executable, "-m", "shardstore.cli", "average", str(a), str(b), str(tmp_path / "cli"),
                          "--format", "torch"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "tensor(s) not averaged (not floating, or outside the model), taken from the last checkpoint" in run.stderr
    assert "other value(s) (counters, RNG states, ...) taken from the last checkpoint" in run.stderr
    quiet = subprocess.run([sys.executable, "-m", "shardstore.cli", "average", str(a), str(b), str(tmp_path / "q"),
                            "--format", "torch", "-q"], capture_output=True, text=True)
    assert quiet.returncode == 0 and not quiet.stdout and not quiet.stderr, quiet.stderr
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == sorted(p.name for p in (tmp_path / "cli").iterdir())


def _dcp_state(folder: Path, tmp_path: Path) -> dict[str, Any]:
    """A DCP folder as torch's own `dcp_to_torch_save` gathers it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    target = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(folder, target)
    return torch.load(target, weights_only=False)


def test_a_dcp_output_is_the_last_checkpoint_with_its_means(checkpoints, tmp_path: Path) -> None:
    """--format dcp: torch's own DCP loader reads the last checkpoint as unshard's DCP export holds it, the
    model's tensors the mean (each one chunk), bit for bit against torch's mean."""
    a, b = checkpoints(2), checkpoints(3)
    shardstore.unshard(b, tmp_path / "last", format="dcp")
    want = _dcp_state(tmp_path / "last", tmp_path)
    result = shardstore.average([a, b], tmp_path / "avg", format="dcp", weights=[1, 3])
    assert sorted(f.name for f in result.files) == sorted(f.name for f in (tmp_path / "avg").iterdir())
    got = _dcp_state(tmp_path / "avg", tmp_path)
    means = _torch_mean([expected(a)["model"], expected(b)["model"]], [1, 3])
    where = _only(want, means.keys())
    assert any(not torch.equal(means[name], _get(want, at)) for name, at in where.items())  # not the last's
    for name, at in where.items():
        _set(want, at, means[name])
    assert_bitwise_equal(got, want)
    assert result.averaged == len(means) and result.values > 0


def _get(tree: Any, keys: tuple[Any, ...]) -> Any:
    for k in keys:
        tree = tree[k]
    return tree


def _only(tree: Any, names: Any, moments: bool = False) -> dict[str, tuple[Any, ...]]:
    """Where each of `names` (model names, or "param/exp_avg") is in the loaded files: a key path."""
    found: dict[str, tuple[Any, ...]] = {}

    def walk(node: Any, keys: tuple[Any, ...]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, keys + (k,))
        elif isinstance(node, torch.Tensor):
            name = f"{keys[-2]}/{keys[-1]}" if moments and len(keys) > 1 else keys[-1]
            if name in names and (moments or "state" not in keys):
                found[name] = keys

    walk(tree, ())
    assert found.keys() == set(names)
    return found


def _set(tree: Any, keys: tuple[Any, ...], value: torch.Tensor) -> None:
    for k in keys[:-1]:
        tree = tree[k]
    tree[keys[-1]] = value
