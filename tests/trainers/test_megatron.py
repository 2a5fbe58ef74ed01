"""Megatron-LM's iter_{N:07d}/ folders and latest_checkpointed_iteration.txt (megatron-core 0.16.1's
`save_checkpoint`: tests/fixtures/data/megatron/)."""

from __future__ import annotations

from pathlib import Path

from tests.trainers.conformance import StepsTests


class TestMegatronSteps(StepsTests):
    trainer, taken, name = "megatron", "iter_0000010", "iter_{step:07d}"
    folder = Path(__file__).parents[1] / "fixtures" / "data" / "megatron" / "core0.16.1" / "tp2-pp1"
