"""veRL's Megatron actor's LoRA adapters as it saved them from 2025-11 to 2026-03 (volcengine/verl
`verl/utils/megatron_peft_utils.py: save_adapter_checkpoint`): `global_step_N/actor/adapter_checkpoint/
mp_rank_TT[_PPP][_EEE]_adapter.pt`, files named as Megatron-LM names its rank folders (the pipeline rank
only when PP > 1, the expert rank only when EP > 1), each `torch.save({"adapter_state_dict": {name: this
rank's part}})` of the first model chunk's adapter parameters under stage-local layer numbers. Beside
them, `actor/dist_ckpt/` holds the RNG state only (no model), and `actor/huggingface/config.json` the
model's Hugging Face config.

The files keep no Megatron-LM args: the grid is read from their names (TP, then PP; a third number, an
expert rank) and the layer count from the Hugging Face config; megatron_torch.py merges them as it merges
Megatron-LM's own files (each adapter split as its linear's input and output).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ... import jsonin
from ...errors import CheckpointError
from ...hf_files import hf_model_file
from ...locations import StorageOptions, folder_of, join, listing, name_of
from ...tree import KeyEncoder
from ..contract import CheckpointSpec
from ..primitives.container import read_small
from ..source import JSON_CONFIG
from ..unit import FileUnit
from . import megatron_torch

FORMAT = "verl-megatron-adapters"
FOLDER, ACTOR, HF = "adapter_checkpoint", "actor", "huggingface"
UNIT_FOLDERS = (FOLDER,)
MAX_CONFIG = 1 << 20


def _actor(folder: str) -> str:
    """The actor folder a path given for the checkpoint names (global_step_N/, actor/ or adapter_checkpoint/)."""
    if name_of(folder) == FOLDER:
        return folder_of(folder)
    return folder if name_of(folder) == ACTOR else join(folder, ACTOR)


def _files(folder: str, storage_options: StorageOptions | None) -> list[str]:
    return [p for p in listing(join(_actor(folder), FOLDER), storage_options)
            if megatron_torch.ADAPTER_FILE.match(name_of(p))]


def detect(folder: str, storage_options: StorageOptions | None = None) -> bool:
    return bool(_files(folder, storage_options))


def run_of(unit: str) -> str:
    return folder_of(folder_of(unit))  # the actor folder


def units(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Every rank's file, pipeline stage by stage, tensor rank by tensor rank."""
    found = {megatron_torch._numbers(megatron_torch._rank_name(p)): p for p in _files(folder, storage_options)}
    return [found[n] for n in sorted(found, key=lambda n: n[1:] + n[:1])]


def side_files(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """The model's Hugging Face files veRL keeps in actor/huggingface/ (its config describes the model)."""
    return [p for p in listing(join(_actor(folder), HF), storage_options) if hf_model_file(name_of(p))]


def _args(folder: str, unit_paths: list[str], storage_options: StorageOptions | None) -> dict[str, Any]:
    """Megatron-LM's args for the grid: TP and PP (or EP) from the files' names, the layers and whether the
    MLP is SwiGLU from the Hugging Face config beside them."""
    where = join(join(_actor(folder), HF), JSON_CONFIG)
    if where not in listing(join(_actor(folder), HF), storage_options):
        raise CheckpointError(f"{where}: not there; veRL's adapter files keep no model config of their own")
    config = jsonin.loads(read_small(where, storage_options, MAX_CONFIG, "a Hugging Face config"), where,
                          "Hugging Face config", CheckpointError)
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: not a Hugging Face config (a JSON object)")
    numbers = [megatron_torch._numbers(megatron_torch._rank_name(p)) for p in unit_paths]
    sizes = [max(n[i] for n in numbers) + 1 for i in range(len(numbers[0]))]
    experts = config.get("num_local_experts") or config.get("num_experts")
    if len(sizes) == 2 and experts:
        raise CheckpointError(f"{folder}: mp_rank_TT_NNN files of an MoE model: NNN is a pipeline or an expert rank, "
                              f"which veRL's adapter files do not say")
    return {"tensor_model_parallel_size": sizes[0], "pipeline_model_parallel_size": sizes[1] if len(sizes) > 1 else 1,
            "expert_model_parallel_size": sizes[2] if len(sizes) > 2 else 1, "num_layers": config.get("num_hidden_layers"),
            "num_experts": experts or None, "swiglu": config.get("hidden_act") in ("silu", "swiglu")}


def spec(folder: str, unit_paths: list[str], encode_key: KeyEncoder, strict: bool,
         storage_options: StorageOptions | None) -> CheckpointSpec:
    planned = megatron_torch.spec(folder, unit_paths, encode_key, strict, storage_options,
                                  _args(folder, unit_paths, storage_options))
    return replace(planned, format=FORMAT)


def open_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
              facts: dict[str, Any]) -> FileUnit:
    return megatron_torch.open_unit(path, storage_options, strict, encode_key, facts)
