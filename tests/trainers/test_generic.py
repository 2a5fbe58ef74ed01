"""No trainer's conventions: a plain script's per-rank `torch.save(model.state_dict())` of FSDP2 DTensors
(tests/fixtures/fsdp2_files.py, real FSDP2 in gloo processes, an odd world size). Its torch export is one
checkpoint.pt of the state dict as the script saved it, which the script's own `load_state_dict` takes:
the processes' own gather, key for key in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_bitwise_equal
from tests.trainers.conformance import TrainerTests


class TestGeneric(TrainerTests):
    trainer = "generic"
    model = ""  # the state dict is the model's

    @pytest.fixture
    def checkpoint(self, fsdp2_files) -> Path:  # type: ignore[no-untyped-def]
        return fsdp2_files("fsdp2", 3)

    def resume(self, out: Path, checkpoint: Path, tmp_path: Path) -> None:
        want = dict(torch.load(f"{checkpoint}.expected.pt.ref", weights_only=True))
        assert_bitwise_equal(torch.load(out / "checkpoint.pt", weights_only=True), want, "checkpoint.pt", ordered=True)

    def described(self, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A script's `torch.save` keeps no description of the model."""
        return None
