"""The Megatron mapping run backwards (export/hf/megatron_inverse.py), against megatron-core's own files:
a Hugging Face export of each checkpoint megatron-core saved (tests/fixtures/data/megatron/), placed back
into Megatron's names, is the model megatron-core's own `dist_checkpointing.load` gave back, bit for bit;
and the torch_dist keys built from the config alone are the keys, with the global shapes, that
megatron-core wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.export.hf.megatron_inverse import layers_stacked, placements, shapes, stacked
from tests.conftest import assert_bitwise_equal

DATA = Path(__file__).parents[1] / "fixtures" / "data" / "megatron" / "core0.19.2"
# dense (local spec; TE names in the files), GQA with biases (Qwen2), q and k norms (Qwen3), tied embeddings,
# Mixtral's, Qwen3-MoE's and Qwen2-MoE's (shared expert) SequentialMLP experts
LAYOUTS = ["tp1-pp1", "tp2-pp2", "tp2-pp1-qwen2", "tp2-pp1-qwen3", "tp2-pp1-tied", "tp1-pp1-dp2-moe",
           "tp1-pp1-dp2-qwen3moe", "tp1-pp1-dp2-qwen2moe", "tp1-pp1-dp2-dsv3"]
# GPT-OSS's: sinks, biases, each layer's experts one stacked transformers tensor (at TP 1 and 2)
GPT_OSS = ["tp1-pp1-dp2-gptoss", "tp2-pp1-dp2-gptoss"]


def _exported(layout: str, out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    shardstore.unshard(DATA / layout, out, format="hf", jobs=1)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return json.loads((out / "config.json").read_text()), tensors


@pytest.mark.parametrize("layout", LAYOUTS + GPT_OSS)
def test_a_hugging_face_model_placed_backwards_is_megatron_cores_own(layout: str, tmp_path: Path) -> None:
    config, hf = _exported(layout, tmp_path / "hf")
    placed = placements(config, {k: tuple(v.shape) for k, v in hf.items()}, layout, te_norms=False)
    dtype = next(iter(hf.values())).dtype
    built = {name: torch.full(shape, float("nan"), dtype=dtype) for name, shape in placed.shapes.items()}
    for p in placed.placements:
        piece = hf[p.hf] if p.rows is None else hf[p.hf][p.rows[0]:p.rows[1]]
        if p.member is not None:  # one of a stack: its axes swapped back, its rows gathered from `interleave` ways
            piece = hf[p.hf][p.member].T if p.transpose else hf[p.hf][p.member]
            piece = torch.cat([piece[way::p.interleave] for way in range(p.interleave)])
        built[p.target][p.at:p.at + piece.shape[0]] = piece
    assert placed.padding == {}  # (the fixtures' vocabulary is unpadded)
    want = torch.load(DATA / f"{layout}.expected.pt.ref", weights_only=False)["model"]
    # (an MTP layer's inner layer is the module attribute mtp_model_layer, saved as transformer_layer)
    assert_bitwise_equal(built, {k.replace(".mtp_model_layer.", ".transformer_layer."): v for k, v in want.items()
                                 if not k.endswith("._extra_state")}, layout)


@pytest.mark.parametrize("layout", LAYOUTS + GPT_OSS)
def test_the_torch_dist_keys_built_from_a_config_are_those_megatron_core_wrote(layout: str, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    config, _ = _exported(layout, tmp_path / "hf")
    written = FileSystemReader(str(next(DATA.glob(f"{layout}/iter_*")))).read_metadata().state_dict_metadata
    theirs = {k: tuple(v.size) for k, v in written.items() if hasattr(v, "size") and not k.startswith("optimizer.")}
    local = shapes(config, layout, impl="local")  # (megatron-core saved them with its local layer spec)
    assert {k: shape for k, (shape, _) in stacked(local, layers_stacked(config)).items()} == theirs


def test_what_is_not_written_backwards_is_refused_by_name(tmp_path: Path) -> None:
    config, hf = _exported("tp1-pp1", tmp_path / "hf")
    hf_shapes = {k: tuple(v.shape) for k, v in hf.items()}
    with pytest.raises(shardstore.ExportError, match="model.layers.0.self_attn.extra.weight has no place"):
        placements(config, {**hf_shapes, "model.layers.0.self_attn.extra.weight": (4, 4)}, "hf")
    with pytest.raises(shardstore.ExportError, match="model.norm.weight, which"):
        placements(config, {k: v for k, v in hf_shapes.items() if k != "model.norm.weight"}, "hf")
    with pytest.raises(shardstore.ExportError, match=r"model.embed_tokens.weight has shape \[100, 16\], the config makes it \[100, 32\]"):
        placements({**config, "hidden_size": 32}, hf_shapes, "hf")
    with pytest.raises(shardstore.ExportError, match="num_local_experts is None"):  # a Llama's config called GptOss
        shapes({**config, "architectures": ["GptOssForCausalLM"]}, "hf")
    with pytest.raises(shardstore.ExportError, match="kv_lora_rank is None"):  # a Llama's config called DeepSeek-V3
        shapes({**config, "architectures": ["DeepseekV3ForCausalLM"]}, "hf")
    with pytest.raises(shardstore.ExportError, match="'GPT2LMHeadModel' has no Megatron-Core GPT equivalent"):
        shapes({**config, "architectures": ["GPT2LMHeadModel"]}, "hf")


def test_a_padded_vocabulary_leaves_its_padding_rows_named(tmp_path: Path) -> None:
    """Megatron's vocabulary padded to 128 rows: the 100 of transformers' embedding and output layer land
    in the first rows, and the rest are named as padding for the writer to fill."""
    config, hf = _exported("tp1-pp1", tmp_path / "hf")
    placed = placements(config, {k: tuple(v.shape) for k, v in hf.items()}, "hf", vocab_rows=128)
    assert placed.shapes["embedding.word_embeddings.weight"] == (128, 16) == placed.shapes["output_layer.weight"]
    assert placed.padding == {"embedding.word_embeddings.weight": (100, 128), "output_layer.weight": (100, 128)}
    assert [(p.hf, p.rows, p.at) for p in placed.placements if p.target == "output_layer.weight"] == \
        [("lm_head.weight", (0, 100), 0)]
