"""What an architecture module gives the Hugging Face export: the config, and each output tensor's source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HFTensor:
    key: str  # the transformers name
    source: str  # the checkpoint's name (normalised), in the model subtree
    # blocks of its rows [first, stop), one after another (a split fused weight; Megatron's q of every
    # query group)
    rows: tuple[tuple[int, int], ...] | None = None
    # a tensor the checkpoint holds as several arrays of one shape (GPT-OSS's experts, one HF tensor per
    # layer): these sources (`source` the first) stacked on a new leading axis, each with its rows first
    # dealt out `interleave` ways (its [gate; up] as gate, up, gate, up... rows) and then `transpose`d
    stack: tuple[str, ...] = ()
    interleave: int = 1
    transpose: bool = False

    @classmethod
    def stacked(cls, key: str, sources: tuple[str, ...], interleave: int = 1, transpose: bool = False) -> HFTensor:
        return cls(key, sources[0], None, sources, interleave, transpose)


@dataclass
class HFModel:
    config: dict[str, Any] | None  # config.json (None: an adapter's folder, which describes no model)
    generation: dict[str, Any] | None  # generation_config.json, where known
    tensors: list[HFTensor]
    files: dict[str, bytes] = field(default_factory=dict)  # tokenizer files and the like, written as they are
    notes: list[str] = field(default_factory=list)  # what was left out, and why
