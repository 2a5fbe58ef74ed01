"""Megatron-LM's iter_{N:07d}/ folders and latest_checkpointed_iteration.txt (megatron-core 0.16.1's
`save_checkpoint`: tests/fixtures/data/megatron/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainers.conformance import StepsTests


class TestMegatronSteps(StepsTests):
    trainer = "megatron"

    @pytest.fixture
    def run(self) -> tuple[Path, str]:
        return Path(__file__).parents[1] / "fixtures" / "data" / "megatron" / "core0.16.1" / "tp2-pp1", "iter_0000010"

    def named(self, step: int) -> str:
        return f"iter_{step:07d}"
