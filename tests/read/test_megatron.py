"""Megatron-Core `torch_dist` checkpoints written by megatron-core 0.19.2's own `dist_checkpointing.save`
(tests/fixtures/megatron_core.py; the files are kept in tests/fixtures/data/megatron/), against what
megatron-core's own `dist_checkpointing.load` gives one TP=1, PP=1 process.

A torch_dist folder is DCP underneath: today it is read as a DCP checkpoint, with Megatron's own keys
(layers stacked on a leading axis, Transformer-Engine-style norm names). These tests hold that reading
exact in every tensor- and pipeline-parallel layout; the Megatron layouts themselves (per-layer names,
the common state, the Hugging Face mapping) are issue 33's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.read.source import open_source

DATA = Path(__file__).parent.parent / "fixtures" / "data" / "megatron" / "core0.19.2"
# The local layer spec's module names -> the names its sharded state dict gives them (Transformer
# Engine's, whose norms live inside the next linear layer)
SAVED_AS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _stacked(want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron's per-layer state dict as torch_dist saves it: `decoder.layers.{i}.X` stacked into
    `decoder.layers.X` along a leading axis of layers."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in want.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", key)
        if m is None:
            out[key] = value
        else:
            layers.setdefault(SAVED_AS.get(m.group(2), m.group(2)), {})[int(m.group(1))] = value
    for name, by_layer in layers.items():
        out[f"decoder.layers.{name}"] = torch.stack([by_layer[i] for i in sorted(by_layer)])
    return out


@pytest.mark.parametrize("layout", ["tp1-pp1", "tp2-pp1", "tp1-pp2", "tp2-pp2"])
def test_every_parallel_layout_reads_as_megatron_core_loads_it(layout: str, tmp_path: Path) -> None:
    src = DATA / layout
    assert open_source(src).format == "dcp"
    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=2)
    got = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=True)
    want = _stacked(torch.load(f"{src}.expected.pt.ref", weights_only=True)["model"])
    tensors = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(want)
    for key, value in want.items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key
    # the rest is Megatron's bytes items, as saved: a None extra state per layer and module
    assert all("._extra_state/" in k or k.startswith("common_state/") for k in set(got) - set(tensors))
