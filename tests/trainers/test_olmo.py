"""OLMo's conventions: its trainer's rank files (tests/fixtures/fsdp.py, OLMo's nesting and trainer
state), and the model.pt, optim.pt and train.pt its `FullCheckpointer` restores from, read as OLMo's
`load_state_dict` reads them: `torch.load` (olmo.util needs `datasets`, which the tests do not install)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_bitwise_equal, expected
from tests.fixtures.fsdp import trainer_state
from tests.trainers.conformance import StepsTests, TrainerTests


class TestOLMo(TrainerTests):
    trainer = "olmo"
    model = "model"

    @pytest.fixture
    def checkpoint(self, checkpoints) -> Path:  # type: ignore[no-untyped-def]
        return checkpoints(3)

    def described(self, request: pytest.FixtureRequest, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
        """The run's config.yaml beside the checkpoint (an OLMo 2 model's, saved by the legacy checkpointer)."""
        return request.getfixturevalue("olmo_models")("olmo2", "legacy", 3), "olmo2"

    def resume(self, out: Path, checkpoint: Path, tmp_path: Path) -> None:
        """What `FullCheckpointer.restore_checkpoint` loads: the model and the optimizer bit for bit as the
        ranks gathered them (torch's safe loader reads them), and rank 0's trainer state without the
        per-rank RNG states (as OLMo's unsharder leaves them out)."""
        want = expected(checkpoint)
        assert_bitwise_equal(torch.load(out / "model.pt", weights_only=True), want["model"], "model.pt")
        assert_bitwise_equal(torch.load(out / "optim.pt", weights_only=True), want["optim"], "optim.pt")
        rank0 = trainer_state(0, 3)
        del rank0["rng"]
        assert torch.load(out / "train.pt", weights_only=False) == rank0


class TestOlmoSteps(StepsTests):
    """OLMo-core's trainer's save folder (ai2-olmo-core's own Trainer: tests/fixtures/olmo_core_trainer.py):
    its step{N}/ folders."""

    trainer, taken, name = "olmo", "step1", "step{step}"
    folder = Path(__file__).parents[1] / "fixtures" / "data" / "olmo-core-trainer"
