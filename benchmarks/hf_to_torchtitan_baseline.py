"""The path torchtitan's own `scripts/checkpoint_conversion/convert_from_hf.py` takes, in one process: build
torchtitan's model for the Hugging Face config (its parameters allocated, as the script does to have a
state dict to load into), its state dict under transformers' names (`to_hf`), torch's DCP load of the
safetensors through `HuggingFaceStorageReader`, `from_hf`, and `dcp.save` of that state dict.

    PY benchmarks/hf_to_torchtitan_baseline.py HF_FOLDER OUT

PY: a Python with torch 2.13.0, transformers and torchtitan 0.3.0 (tests/fixtures/data/torchtitan/README.md
says what it needs to import); tests/fixtures/torchtitan_cfg.py builds the model's config from config.json
as torchtitan's registry would.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root: tests/fixtures


@torch.inference_mode()
def main(hf: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from transformers import AutoConfig
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from tests.fixtures.torchtitan_cfg import llama3_config_from_hf

    config = AutoConfig.from_pretrained(hf)
    titan = llama3_config_from_hf(config)
    with torch.device("cpu"):
        model = titan.build()
    model.to(getattr(torch, str(config.dtype).removeprefix("torch.")) if config.dtype else torch.bfloat16)
    adapter = Llama3StateDictAdapter(titan, hf)
    state = ModelWrapper(model)._get_state_dict()
    hf_state = adapter.to_hf(state)
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(path=hf))
    dcp.save(adapter.from_hf(hf_state), checkpoint_id=out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
