"""The HF Trainer's conventions: its FSDP checkpoint-N/ (tests/fixtures/data/accelerate/, saved by its own
code), resumed by transformers' Trainer in one CPU process from the torch export."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.read.formats.test_trainer_parts import DATA, _tiny_llama, _want, same_optimizer
from tests.trainers.conformance import StepsTests, TrainerTests


class TestHFTrainer(TrainerTests):
    trainer = "hf-trainer"
    model = "model"

    @pytest.fixture
    def checkpoint(self) -> Path:
        return DATA / "fsdp2-w2"

    def described(self, request: pytest.FixtureRequest, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
        """The config.json its final `save_model` leaves in output_dir, above the checkpoint-N/ folders."""
        run = tmp_path / "output_dir"
        shutil.copytree(DATA / "fsdp2-w2" / "checkpoint-4", run / "checkpoint-4")
        (run / "config.json").write_text(json.dumps(_want("fsdp2-w2")["config"]))
        return run / "checkpoint-4", "llama"

    def resume(self, out: Path, checkpoint: Path, tmp_path: Path) -> None:
        """`train(resume_from_checkpoint=OUT)` without FSDP: it starts at step 4 with the gathered weights,
        the optimizer's moments and the schedule's position, and trains on."""
        from transformers import Trainer, TrainerCallback, TrainingArguments

        want = _want(checkpoint.name)
        seen: dict = {}

        class Look(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):  # type: ignore[no-untyped-def]
                seen.update(step=state.global_step, model={k: v.clone() for k, v in model.state_dict().items()},
                            optimizer=copy.deepcopy(optimizer.state_dict()), epoch=lr_scheduler.last_epoch)

        data = [{"input_ids": torch.arange(8) % 100, "labels": torch.arange(8) % 100} for _ in range(16)]
        args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=6, per_device_train_batch_size=2,
                                 report_to="none", use_cpu=True, save_strategy="no", learning_rate=1e-2)
        trainer = Trainer(model=_tiny_llama(checkpoint.name), args=args, train_dataset=data, callbacks=[Look()])
        trainer.train(resume_from_checkpoint=str(out))
        assert seen["step"] == 4 and seen["epoch"] == 4 and trainer.state.global_step == 6
        assert all(torch.equal(seen["model"][k], v) for k, v in want["model"].items())
        same_optimizer(seen["optimizer"], want["optimizer"])


class TestHfTrainerSteps(StepsTests):
    """Its output_dir of checkpoint-N/ folders; the newest is the highest N (get_last_checkpoint)."""

    trainer, folder, taken, name = "hf_trainer", DATA / "fsdp2-w2", "checkpoint-4", "checkpoint-{step}"

    def copy(self, run: Path, taken: str, step: int) -> None:
        """Its trainer_state.json records the step its folder is named by."""
        super().copy(run, taken, step)
        state = run / self.named(step) / "trainer_state.json"
        state.write_text(json.dumps({**json.loads(state.read_text()), "global_step": step}))
