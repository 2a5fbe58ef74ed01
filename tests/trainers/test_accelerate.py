"""Accelerate's conventions: its `save_state` folder of per-rank files (tests/fixtures/data/accelerate/,
saved by its own code), loaded by `accelerator.load_state` in one CPU process from the torch export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.read.formats.test_trainer_parts import BIN, _tiny_llama, same_optimizer
from tests.trainers.conformance import StepsTests, TrainerTests
import shutil


class TestAccelerate(TrainerTests):
    trainer = "accelerate"
    model = "model"

    @pytest.fixture
    def checkpoint(self) -> Path:
        return BIN

    def described(self, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """`save_state` keeps no description of the model."""
        return None

    def resume(self, out: Path, checkpoint: Path, tmp_path: Path) -> None:
        """`load_state(OUT)` without FSDP: the gathered weights, the optimizer's moments and the
        scheduler's position."""
        from accelerate import Accelerator
        from transformers import get_linear_schedule_with_warmup

        want = torch.load(f"{checkpoint}.expected.pt.ref", weights_only=True)
        accelerator = Accelerator(cpu=True)
        model = _tiny_llama(checkpoint.name)
        named = dict(model.named_parameters())  # the run's groups (the Trainer's: decay, no decay)
        optimizer = torch.optim.AdamW([{"params": [named[n] for n in g["params"]], "weight_decay": g["weight_decay"]}
                                       for g in want["optimizer"]["param_groups"]], lr=1e-2)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer,
                                                          get_linear_schedule_with_warmup(optimizer, 2, 10))
        accelerator.load_state(str(out))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in want["model"].items())
        same_optimizer(optimizer.state_dict(), want["optimizer"])
        assert scheduler.scheduler.last_epoch == 4


class TestAccelerateSteps(StepsTests):
    """ProjectConfiguration(automatic_checkpoint_naming=True) names each save_state folder
    checkpoints/checkpoint_{iteration}: the real save_state folder put there, under that name."""

    trainer, taken, name = "accelerate", "checkpoint_2", "checkpoint_{step}"

    @pytest.fixture
    def run(self, tmp_path: Path) -> tuple[Path, str]:
        shutil.copytree(BIN / "checkpoint-4", tmp_path / "checkpoints" / self.taken)
        return tmp_path / "checkpoints", self.taken
