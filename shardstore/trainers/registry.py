"""The trainers (trainers/contract.py), in the order a tree is recognised: a trainer known from its
folder's files first, then by its tree, the catch-alls last; and how every trainer's runs name their
checkpoints (`RUNS`), the pointers to the newest in the order they are believed."""

from __future__ import annotations

from ..tree import Node, node_at
from ..errors import ExportError
from . import accelerate, composer, deepspeed, generic, hf_trainer, lightning, megatron, olmo, torchtitan, verl
from .contract import Reader, Steps, Trainer

TRAINERS: dict[str, Trainer] = {t.name: t for t in (hf_trainer.TRAINER, accelerate.TRAINER, lightning.TRAINER,
                                                    olmo.TRAINER, composer.TRAINER, generic.DCP, generic.GENERIC)}

RUNS: tuple[Steps, ...] = (megatron.STEPS, verl.STEPS, *(t.steps for t in TRAINERS.values() if t.steps is not None),
                           deepspeed.STEPS, torchtitan.STEPS)


def detect(tree: Node, known: str | None = None, reader: Reader | None = None) -> str:
    """Which trainer's nesting `tree` has: `known`, the one whose files the checkpoint's folder showed
    (read/formats/resume.py), else the first that recognises it, read by `reader`."""
    if known in TRAINERS:
        return known
    return next(t.name for t in TRAINERS.values() if t.recognises(tree, reader))


def trainer(name: str) -> Trainer:
    """The trainer a store's manifest names (a store of an older version may name none we know: generic)."""
    return TRAINERS.get(name, generic.GENERIC)


def model_subtree(tree: Node, name: str) -> str:
    """Where the model weights are in `tree`, a checkpoint of trainer `name`: the first of its model
    paths there, else the root."""
    for candidate in trainer(name).model:
        try:
            node_at(tree, candidate)
            return candidate
        except ExportError:
            continue
    return ""


def writes() -> str:
    """A regex of every name any trainer's resume files may have."""
    return "|".join(t.writes for t in TRAINERS.values() if t.writes)
