"""`follow` (shardstore/follow.py) beside a live training run: tests/fixtures/training_run.py trains with
FSDP2 in gloo processes, saves with `dcp.save` every few steps as torchtitan does and rotates its step
folders; what its ranks gathered at each save is the reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.follow import LATEST, STAGING, Published, Skipped
from tests.conftest import assert_bitwise_equal

ROOT = Path(__file__).parents[1]


def _published(out: Path) -> list[str]:
    """The folders a reader of OUT sees (its hidden staging aside), each whole."""
    seen = sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith("."))
    for name in seen:
        assert (out / name / "model.safetensors").is_file(), name
        assert not list((out / name).glob(".shardstore-scratch*")), name
    return seen


def test_a_live_run_is_followed_and_every_published_step_is_what_its_ranks_saved(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run, refs, out = tmp_path / "run", tmp_path / "refs", tmp_path / "out"
    trainer = subprocess.Popen([sys.executable, "-m", "tests.fixtures.training_run", str(run), str(refs), "12", "2",
                                "2", "0.3"], cwd=ROOT)
    events: list[object] = []
    try:
        while trainer.poll() is None:
            if run.is_dir():
                events += shardstore.follow(run, out, once=True, keep=3, jobs=1)
                seen = _published(out)
                if seen:  # latest names a whole folder, the newest
                    assert (out / LATEST).read_text() == max(seen, key=lambda n: int(n.split("-")[1]))
    finally:
        trainer.wait(timeout=300)
    assert trainer.returncode == 0
    events += shardstore.follow(run, out, once=True, keep=3, jobs=1)
    published = [e for e in events if isinstance(e, Published)]
    assert published and published[-1].name == "step-12"
    assert not [e for e in events if isinstance(e, Skipped) and not e.removed]
    for event in published:  # every step published is what the ranks held when it was saved
        if (out / event.name).is_dir():
            want = torch.load(refs / f"{event.name}.pt", weights_only=True)
            assert_bitwise_equal(load_file(out / event.name / "model.safetensors"), want, event.name)
    by_step = sorted({e.name for e in published}, key=lambda n: int(n.split("-")[1]))
    assert sorted(_published(out)) == sorted(by_step[-3:])  # --keep 3: the newest three
    assert len(by_step) >= 3, events
    assert (out / LATEST).read_text() == "step-12"
    assert not [p for p in (out / STAGING).iterdir()]


def test_a_checkpoint_is_published_only_once_its_trainer_finished_it(tmp_path: Path) -> None:
    """A step folder without its .metadata (dcp.save writes it last) is not read; once it is there, the
    folder is published; a second look publishes nothing again."""
    from tests.fixtures.training_run import train

    run, refs, out = tmp_path / "run", tmp_path / "refs", tmp_path / "out"
    train(run, refs, 2, 2, 1, pause=0)
    metadata = run / "step-2" / ".metadata"
    held = metadata.rename(tmp_path / "metadata")
    assert shardstore.follow(run, out, once=True, jobs=1) == []
    assert not (out / "step-2").exists() and not (out / LATEST).exists()
    held.rename(metadata)
    published = shardstore.follow(run, out, once=True, jobs=1)
    assert [e.name for e in published if isinstance(e, Published)] == ["step-2"]
    assert shardstore.follow(run, out, once=True, jobs=1) == []
    assert (out / LATEST).read_text() == "step-2"


def test_follow_options_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    with pytest.raises(shardstore.ExportError, match="keep and every"):
        shardstore.follow(tmp_path, tmp_path / "out", keep=0, once=True)
    with pytest.raises(TypeError, match="'step' is not an option"):
        shardstore.follow(tmp_path, tmp_path / "out", step=3, once=True)
    with pytest.raises(shardstore.ExportError, match="--adapter applies"):
        shardstore.follow(tmp_path, tmp_path / "out", adapter=True, once=True)
