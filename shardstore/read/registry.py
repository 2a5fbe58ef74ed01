"""Every checkpoint format shardstore reads, in the order a folder is tried against them. A new format is
a module in read/formats/ implementing `contract.Format` (or, for a folder of unit files, the module functions
`folder.FolderFormat` wraps) and one line here."""

from __future__ import annotations

import functools

from .contract import Format
from .folder import FolderFormat
from .formats import (accelerate, dcp, dcp_hf, deepspeed, dtensor, megatron_torch, olmo_core, olmo_local, rankfile, verl,
                      verl_adapters)


@functools.cache
def folder_formats() -> tuple[Format, ...]:
    """The formats a checkpoint folder is recognised by, in order."""
    return (
        # veRL's legacy LoRA adapter files: before DCP, whose actor/dist_ckpt/ beside them holds RNG state only
        FolderFormat(verl_adapters, "veRL Megatron LoRA adapters"),
        dcp.FORMAT,  # a .metadata file: before anything that also holds .pt files (OLMo's train/)
        FolderFormat(olmo_local, "OLMo `local`"),
        FolderFormat(olmo_core, "OLMo-core"),
        FolderFormat(verl, "veRL"),
        FolderFormat(deepspeed, "DeepSpeed ZeRO"),
        FolderFormat(dcp_hf, "Hugging Face safetensors"),
        FolderFormat(megatron_torch, "Megatron-LM torch"),
        FolderFormat(accelerate, "Accelerate per-rank FSDP"),
    )


def fallback() -> rankfile.RankFiles:
    """Per-rank ShardedTensor files: what any other folder of `*rank<N>.pt` files is read as (they may be
    tagged within one folder, so this format finds its own checkpoint: `RankFiles.find`)."""
    return rankfile.FORMAT


def formats() -> tuple[Format, ...]:
    return (*folder_formats(), fallback(), dtensor.FILES)  # per-rank DTensor files: routed by RankFiles


def get(name: str) -> Format:
    for fmt in formats():
        if fmt.name == name:
            return fmt
    raise KeyError(name)
