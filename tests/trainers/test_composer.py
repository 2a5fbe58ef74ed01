"""Composer's conventions: its HSDP per-rank files (tests/corpus/, written by torch 2.13 as Composer's
`save_checkpoint` nests them), and the one checkpoint.pt a monolithic Composer checkpoint is. Composer is
not installed here; its `load_checkpoint` of such a file does `torch.load`, loads `state` into the
State, and gives each rank `rng[global_rank]`: what `resume` checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardstore
from tests.test_corpus import DATA, as_gathered, assert_matches
from tests.trainers.conformance import StepsTests, TrainerTests
import shutil

NAME = "composer-t2.13-hsdp-w4"


class TestComposer(TrainerTests):
    trainer = "composer"
    model = "state/model"

    @pytest.fixture
    def checkpoint(self) -> Path:
        return DATA / NAME

    def described(self, request: pytest.FixtureRequest, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
        """HuggingFaceModel's metadata, inside the checkpoint's state (a gloo world of 2 saves it)."""
        from tests.fixtures.composer_hf import make_composer_hf_checkpoints

        return make_composer_hf_checkpoints({"rank-files": tmp_path / "composer"}, 2)["rank-files"], "llama"

    def resume(self, out: Path, checkpoint: Path, tmp_path: Path) -> None:
        """The model and the optimizer's state bit for bit as the ranks gathered them, and `rng` one entry
        per rank, each that rank's own, in rank order."""
        state = torch.load(out / "checkpoint.pt", weights_only=False)
        assert_matches(NAME, as_gathered("composer", state), "--format torch")
        with shardstore.inspect(checkpoint) as found:
            own = found.store.values("rng/0/torch")  # each rank file's one-element list's torch state
        assert len(state["rng"]) == len(own) == 4
        assert all(torch.equal(rng["torch"], own[rank]) for rank, rng in enumerate(state["rng"]))


class TestComposerSteps(StepsTests):
    """Its ep{E}-ba{B}/ folder of ep{E}-ba{B}-rank{r}.pt files."""

    trainer, folder, taken, name = "composer", DATA / NAME, "ep0-ba1", "ep0-ba{step}"

    def copy(self, run: Path, taken: str, step: int) -> None:
        """Its rank files are named by the step too."""
        (run / self.named(step)).mkdir()
        for f in (run / taken).iterdir():
            shutil.copy(f, run / self.named(step) / f.name.replace(taken, self.named(step)))
