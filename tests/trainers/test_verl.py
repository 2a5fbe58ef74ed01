"""veRL's trainer: its global_step_{N}/ folders and latest_checkpointed_iteration.txt
(tests/fixtures/data/verl/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainers.conformance import StepsTests


class TestVerlSteps(StepsTests):
    trainer = "verl"

    @pytest.fixture
    def run(self) -> tuple[Path, str]:
        return Path(__file__).parents[1] / "fixtures" / "data" / "verl" / "t2.4" / "fsdp1-w3", "global_step_7"

    def named(self, step: int) -> str:
        return f"global_step_{step}"
