"""Composer's nesting: state/model, state/optimizers, and each rank's RNG state in `rng`.

Its rank files each hold a one-element `rng` list; a whole checkpoint's `rng` lists every rank's state in
rank order, as Composer's own monolithic checkpoints do (`rng_per_rank`). Composer >= 0.16's DCP keeps
every rank's state in global rank 0's list already.

It names a checkpoint by its timestamp, f"ep{epoch}-ba{batch}" (a folder, or the prefix of its rank files),
and links latest-rank{r}.pt to the newest.
"""

from __future__ import annotations

import re

from ..tree import Node
from .contract import Reader, Steps, Trainer, one_file

STEPS = Steps(r"ep[0-9]+-ba([0-9]+)", "latest-rank0.pt", "link")
# The epoch and the batch a checkpoint's name says: its folder's, or its rank files' f"...-rank{rank}.pt"
EPOCH = re.compile(r"\Aep([0-9]+)-ba[0-9]+(?:-rank[0-9]+\.pt)?\Z")
BATCH = re.compile(rf"\A(?:{STEPS.name})(?:-rank[0-9]+\.pt)?\Z")


def _recognises(tree: Node, reader: Reader | None) -> bool:
    state = next((c for _, c in tree.children if c.path == "state"), None)
    return state is not None and any(c.path == "state/model" for _, c in state.children)


TRAINER = Trainer("composer", "composer (Composer's nesting: state/model, state/optimizers)", ("state/model",),
                  _recognises, one_file, rng_per_rank=True, steps=STEPS)
