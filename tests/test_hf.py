"""A tiny Hugging Face model trained one step under FSDP: the safetensors export loads in transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import shardstore
from tests.conftest import expected


def test_safetensors_export_loads_with_from_pretrained(checkpoints, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    src = checkpoints(2, kind="hf")
    out = tmp_path / "hf"
    shardstore.unshard(src, out)
    shutil.copy(src / "hf-config" / "config.json", out / "config.json")

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).eval()
    reference.load_state_dict(expected(src)["model"])  # what torch's FULL_STATE_DICT gather says
    ids = torch.arange(24).reshape(2, 12) % loaded.config.vocab_size
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.equal(got, want)
    assert not torch.equal(want, AutoModelForCausalLM.from_config(loaded.config).eval()(input_ids=ids).logits)
