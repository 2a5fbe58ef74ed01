"""torchtitan's CheckpointManager: its step-{N}/ DCP folders (tests/fixtures/data/torchtitan/, two saves
of one run); the newest is the highest step."""

from __future__ import annotations

from pathlib import Path

from tests.trainers.conformance import StepsTests


class TestTorchtitanSteps(StepsTests):
    trainer, taken, name = "torchtitan", "step-4", "step-{step}"
    folder = Path(__file__).parents[1] / "fixtures" / "data" / "torchtitan" / "tt-w4-tp2" / "checkpoint"
