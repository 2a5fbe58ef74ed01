"""What an output holds as the checkpoint had it rather than as a user would expect it, said once."""

from __future__ import annotations

import re
from typing import Iterable

# Megatron's DistributedOptimizer state in its default `dp_reshardable` form: one flat tensor per bucket
# (an MoE model's ChainedOptimizer: the dense and the expert optimizer's, under chained_0. and chained_1.)
FLAT_BUCKET = re.compile(r"(?:.*/)?((?:chained_[0-9]+\.)?optimizer\.distributed\.dp_group_idx_[0-9]+)\..*"
                         r"\.bucket_idx_[0-9]+\.[^./]+")


def flat_buckets(names: Iterable[str]) -> list[str]:
    """A note when `names` (the output's tensors) hold Megatron's optimizer state as flat buckets: which
    elements belong to which parameter is Megatron's in-memory layout, not written in the checkpoint, so
    they are exported as saved rather than guessed."""
    groups = sorted({m.group(1) for m in map(FLAT_BUCKET.fullmatch, names) if m})
    if not groups:
        return []
    return [f"Megatron's distributed optimizer state is kept as its flat buckets ({groups[0]}.…bucket_idx_N."
            f"{{param,exp_avg,exp_avg_sq}}, {len(groups)} group{'s' if len(groups) > 1 else ''}): the checkpoint "
            f"(dp_reshardable) does not record which elements belong to which parameter; Megatron-LM's "
            f"--dist-ckpt-optim-fully-reshardable saves it per parameter, and shardstore exports that per parameter"]
