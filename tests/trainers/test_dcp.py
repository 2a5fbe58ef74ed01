"""torch DCP's own nesting, as `dcp.save` leaves it (tests/fixtures/dcp.py, real FSDP2 in gloo processes):
its torch export is one checkpoint.pt, read back as torch's own `dcp_to_torch_save` writes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_bitwise_equal
from tests.trainers.conformance import TrainerTests


class TestDCP(TrainerTests):
    trainer = "dcp"
    model = "model"

    @pytest.fixture
    def checkpoint(self, dcp_checkpoints) -> Path:  # type: ignore[no-untyped-def]
        return dcp_checkpoints("fsdp2")

    def described(self, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """`dcp.save` keeps no description of the model."""
        return None

    def resume(self, out: Path, checkpoint: Path, tmp_path: Path) -> None:
        """`torch.load` of checkpoint.pt gives what torch's `dcp_to_torch_save` of the folder gives."""
        want = torch.load(f"{checkpoint}.expected.pt.ref", weights_only=False)
        assert_bitwise_equal(torch.load(out / "checkpoint.pt", weights_only=False), want, "checkpoint.pt")
