"""Composer's nesting: state/model, state/optimizers, and each rank's RNG state in `rng`.

Its rank files each hold a one-element `rng` list; a whole checkpoint's `rng` lists every rank's state in
rank order, as Composer's own monolithic checkpoints do (`rng_per_rank`). Composer >= 0.16's DCP keeps
every rank's state in global rank 0's list already.
"""

from __future__ import annotations

from ..tree import Node
from .contract import Reader, Trainer, one_file


def _recognises(tree: Node, reader: Reader | None) -> bool:
    state = next((c for _, c in tree.children if c.path == "state"), None)
    return state is not None and any(c.path == "state/model" for _, c in state.children)


TRAINER = Trainer("composer", "composer (Composer's nesting: state/model, state/optimizers)", ("state/model",),
                  _recognises, one_file, rng_per_rank=True)
