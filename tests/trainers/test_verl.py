"""veRL's trainer: its global_step_{N}/ folders and latest_checkpointed_iteration.txt
(tests/fixtures/data/verl/)."""

from __future__ import annotations

from pathlib import Path

from tests.trainers.conformance import StepsTests


class TestVerlSteps(StepsTests):
    trainer, taken, name = "verl", "global_step_7", "global_step_{step}"
    folder = Path(__file__).parents[1] / "fixtures" / "data" / "verl" / "t2.4" / "fsdp1-w3"
