"""DeepSpeed's engine: its save folder of global_step{N}/ tags and `latest` naming the newest
(tests/fixtures/data/deepspeed/). The file names the newest whatever the tags' names say, and `--step`
takes another tag of the save folder."""

from __future__ import annotations

from pathlib import Path

from tests.trainers.conformance import StepsTests


class TestDeepspeedSteps(StepsTests):
    trainer, taken, name = "deepspeed", "global_step2", "global_step{step}"
    folder = Path(__file__).parents[1] / "fixtures" / "data" / "deepspeed" / "z2-w3"
