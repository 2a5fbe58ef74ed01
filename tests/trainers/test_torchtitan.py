"""torchtitan's CheckpointManager: its step-{N}/ DCP folders (tests/fixtures/data/torchtitan/, two saves
of one run); the newest is the highest step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainers.conformance import StepsTests


class TestTorchtitanSteps(StepsTests):
    trainer = "torchtitan"

    @pytest.fixture
    def run(self) -> tuple[Path, str]:
        return Path(__file__).parents[1] / "fixtures" / "data" / "torchtitan" / "tt-w4-tp2" / "checkpoint", "step-4"

    def named(self, step: int) -> str:
        return f"step-{step}"
