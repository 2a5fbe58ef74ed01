"""OLMo's nesting: model, optim and the trainer state at the top (OLMo's trainer, and veRL and DeepSpeed
nest theirs so too).

`--format torch` writes model.pt, optim.pt and train.pt exactly as OLMo's own unsharder does (plain
dicts), so they are drop-in. Its legacy unsharder leaves the per-rank RNG states out of train.pt; for
the formats with train/rank{r}.pt files its unsharders write rank 0's file whole.
"""

from __future__ import annotations

from ..tree import Node, node_at
from .contract import ResumeFile, Steps, Trainer, top_keys

# OLMo's and OLMo-core's f"step{global_step}" folders, and OLMo's save_folder/latest link to the newest
STEPS = Steps(r"step([0-9]+)", "latest", "link")


def _files(tree: Node, ranked: bool) -> list[ResumeFile]:
    dropped = ("model", "optim", "rng") if ranked else ("model", "optim")
    return [ResumeFile("model.pt", node_at(tree, "model"), plain_dicts=True),
            ResumeFile("optim.pt", node_at(tree, "optim"), plain_dicts=True),
            ResumeFile("train.pt", tree, dropped, plain_dicts=True)]


TRAINER = Trainer(
    "olmo", "olmo (model, optim and trainer state at the top, as OLMo, veRL and DeepSpeed nest them)", ("model",),
    # a `dcp.save` or per-rank DTensor `torch.save` of any script nests them so too (OLMo's DCP folder,
    # model_and_optim/, is named by its reader; OLMo's rank files hold ShardedTensors)
    lambda tree, reader: {"model", "optim"} <= top_keys(tree) and not (reader is not None and reader.any_script),
    _files, writes=r"(model|optim|train)\.pt", steps=STEPS)
