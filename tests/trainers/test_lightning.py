"""Lightning's conventions: its Trainer's sharded `epoch=E-step=N.ckpt/` (tests/fixtures/data/lightning/,
saved by its own code), resumed by `Trainer.fit(ckpt_path=...)` on one CPU from the torch export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.read.formats.test_lightning import DATA, _module, _want
from tests.read.formats.test_trainer_parts import same_optimizer
from tests.trainers.conformance import StepsTests, TrainerTests


class TestLightning(TrainerTests):
    trainer = "lightning"
    model = "state_dict"

    @pytest.fixture
    def checkpoint(self) -> Path:
        return DATA / "trainer-w3" / "checkpoints"

    def described(self, request: pytest.FixtureRequest, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
        """hparams.yaml's `model_name_or_path`, its config.json in the local Hugging Face cache."""
        from transformers import LlamaConfig

        from tests.fixtures.lightning_fsdp import CONFIG, MODEL_NAME

        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        repo = tmp_path / "hub" / f"models--{MODEL_NAME.replace('/', '--')}"
        LlamaConfig(**CONFIG).save_pretrained(repo / "snapshots" / "0123abcd")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")
        return DATA / "trainer-w3" / "checkpoints", "llama"

    def resume(self, out: Path, checkpoint: Path, tmp_path: Path) -> None:
        """`Trainer.fit(model, ckpt_path=OUT/checkpoint.ckpt)` with no distributed strategy: it starts at the
        saved step and epoch with the gathered weights and the optimizer's moments, and trains on."""
        import lightning as L

        from tests.fixtures.lightning_fsdp import _batches

        want = _want("trainer-w3")
        module = _module()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(module, _batches(), ckpt_path=str(out / "checkpoint.ckpt"))
        assert module.seen["step"] == 4 and module.seen["epoch"] == 1 and trainer.global_step == 6
        assert all(torch.equal(module.seen["model"][k], v) for k, v in want["model"].items())
        same_optimizer(module.seen["optimizer"], want["optimizer"])


class TestLightningSteps(StepsTests):
    """ModelCheckpoint's epoch=E-step=N.ckpt/ folders and save_last's last.ckpt link to the newest."""

    trainer, taken, name = "lightning", "epoch=1-step=4.ckpt", "epoch=1-step={step}.ckpt"
    folder = DATA / "trainer-w3" / "checkpoints"
