"""`--format hf` of a Megatron-Core GPT-OSS model: megatron-core 0.19.2's own save at expert parallel 2
(tests/fixtures/megatron_gptoss.py; kept in tests/fixtures/data/megatron/) as transformers' GptOssForCausalLM,
whose experts are one tensor per layer for all of them: each expert's [gate; up] interleaved and transposed.
The logits are compared with Megatron's own forward; the stacked tensors bit for bit with Megatron's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.export.hf.gpt_oss import config_from_args
from shardstore.export.safetensors import Stacked

DATA = Path(__file__).parents[1] / "fixtures" / "data" / "megatron" / "core0.19.2"
SRC = DATA / "tp1-pp1-dp2-gptoss"  # at TP 2 (attention, its sinks and biases split too): tp2-pp1-dp2-gptoss
# the Hugging Face config of the fixture's model (what a user gives with --hf-config)
CONFIG = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 2,
          "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 100, "hidden_size": 16,
          "intermediate_size": 32, "head_dim": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 16, "swiglu_limit": 7.0, "attention_bias": True,
          "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0}}


def _gate_up(fc1: torch.Tensor) -> torch.Tensor:
    """Megatron-Bridge's GPTOSSMLPGateUpProjMapping._uninterleave: gate rows to the even places, up to the odd."""
    gate, up = fc1.chunk(2)
    return torch.stack([gate, up], 1).flatten(0, 1)


@pytest.mark.parametrize("layout, described", [("tp1-pp1-dp2-gptoss", "args"), ("tp1-pp1-dp2-gptoss", "hf-config"),
                                               ("tp2-pp1-dp2-gptoss", "args")])
def test_hf_export_gives_megatrons_own_logits(layout: str, described: str, tmp_path: Path) -> None:
    """Sinks, biases, the clamped quick-GeGLU experts stacked as GptOss keeps them, a window on every other
    layer, YaRN: transformers' GptOss reproduces Megatron's logits (float32, summed in another order), from
    Megatron-LM's args in the checkpoint or a config.json given."""
    from transformers import AutoModelForCausalLM

    src, want = DATA / layout, torch.load(DATA / f"{layout}.expected.pt.ref", weights_only=True)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    given = tmp_path / "config.json" if described == "hf-config" else None
    shardstore.unshard(src, tmp_path / "hf", format="hf", hf_config=given, jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        got = model(input_ids=want["ids"]).logits
    torch.testing.assert_close(got, want["logits"], rtol=1e-4, atol=1e-4)
    written, megatron = load_file(tmp_path / "hf" / "model.safetensors"), want["model"]
    for i in range(2):  # the moved tensors are Megatron's, bit for bit
        experts = [f"decoder.layers.{i}.mlp.experts.local_experts.{e}." for e in range(4)]
        stacked = {"gate_up_proj": [_gate_up(megatron[f"{e}linear_fc1.weight"]).T for e in experts],
                   "gate_up_proj_bias": [_gate_up(megatron[f"{e}linear_fc1.bias"]) for e in experts],
                   "down_proj": [megatron[f"{e}linear_fc2.weight"].T for e in experts],
                   "down_proj_bias": [megatron[f"{e}linear_fc2.bias"] for e in experts]}
        for name, parts in stacked.items():
            assert torch.equal(written[f"model.layers.{i}.mlp.experts.{name}"], torch.stack(parts)), name
        assert torch.equal(written[f"model.layers.{i}.self_attn.sinks"],
                           megatron[f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"])
    assert not shardstore.verify(src, tmp_path / "hf", hf_config=given, jobs=1).differences  # it reads stacks too


@pytest.mark.parametrize("layout", ["tp1-pp1-dp2-gptoss", "tp2-pp1-dp2-gptoss"])
def test_every_tensor_reads_as_megatron_core_loads_it(layout: str, tmp_path: Path) -> None:
    """The sinks, the biases and each expert (from its expert-parallel rank) bit for bit, under Megatron's names."""
    from tests.read.formats.test_megatron import _saved_names

    want = _saved_names(torch.load(DATA / f"{layout}.expected.pt.ref", weights_only=True)["model"])
    shardstore.unshard(DATA / layout, tmp_path / "st", jobs=2)
    got = load_file(tmp_path / "st" / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_a_stacked_tensor_streams_one_expert_at_a_time(tmp_path: Path) -> None:
    """The stack is read and written expert by expert: one part per expert, each one expert's bytes."""
    from shardstore.export.registry import request
    from shardstore.export.hf import plan_hf
    from shardstore.read.discover import open_source

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    store = shardstore.ingest(tmp_path / "store", open_source(SRC), jobs=1)
    _, plan = plan_hf(store, "model", request("hf", hf_config=tmp_path / "config.json"))
    item = next(it for group in plan.groups for it in group if it.key == "model.layers.0.mlp.experts.gate_up_proj")
    assert isinstance(item.source, Stacked) and item.shape == (4, 16, 64)
    assert [len(part) for part in item.source.parts(store)] == [16 * 64 * 4] * 4


def _args(**change: Any) -> dict[str, Any]:
    """Megatron-LM's args of the fixture's model (as its common state holds them), changed."""
    from tests.fixtures.megatron_gptoss import WINDOW, YARN

    return {"num_layers": 2, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 4,
            "group_query_attention": True, "num_query_groups": 2, "kv_channels": 8, "normalization": "RMSNorm",
            "padded_vocab_size": 100, "untie_embeddings_and_output_weights": True, "num_experts": 4,
            "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "add_bias_linear": True, "add_qkv_bias": True,
            "swiglu": False, "quick_geglu": True, "softmax_type": "learnable", "activation_func_clamp_value": 7.0,
            "glu_linear_offset": 1.0, "window_size": WINDOW, "window_attn_skip_freq": 2,
            "position_embedding_type": "yarn", "rotary_base": 150000, "max_position_embeddings": 16, **YARN, **change}


@pytest.mark.parametrize("key, value", [
    ("num_experts", None), ("add_bias_linear", False), ("quick_geglu", False), ("glu_linear_offset", 0.0),
    ("activation_func_clamp_value", None), ("window_size", (3, 3)), ("window_attn_skip_freq", [1, 0, 1]),
    ("rotary_interleaved", True), ("moe_router_pre_softmax", True), ("moe_router_score_function", "sigmoid"),
    ("moe_shared_expert_intermediate_size", 32), ("qk_layernorm", True), ("normalization", "LayerNorm"),
    # and values a common state's args may hold that are no values at all: a line, never a traceback
    ("rotary_scaling_factor", "32"), ("yarn_beta_fast", [1]), ("mscale", "x"), ("rotary_base", "x"),
    ("yarn_original_max_position_embeddings", 4096.5)])
def test_what_gpt_oss_cannot_express_is_refused_by_name(key: str, value: Any) -> None:
    """A model with learnable attention sinks is GPT-OSS's; what else it has that GptOss has not is refused
    naming Megatron's argument (the unchanged args make a GptOss config)."""
    assert config_from_args(_args(), "args")[0]["architectures"] == ["GptOssForCausalLM"]
    with pytest.raises(shardstore.ExportError, match=f"args: {key} is "):
        config_from_args(_args(**{key: value}), "args")


def test_windows_follow_megatrons_skip_frequency() -> None:
    """Megatron windows (1-based) layers not divisible by an int skip frequency, the ones a list marks, or
    every layer without one; none without a window."""
    def types(**change: Any) -> list[str]:
        return [t[0] for t in config_from_args(_args(num_layers=4, **change), "args")[0]["layer_types"]]

    assert types() == ["s", "f", "s", "f"] and types(window_attn_skip_freq=4) == ["s", "s", "s", "f"]
    assert types(window_attn_skip_freq=[0, 1, 1, 0]) == ["f", "s", "s", "f"]
    assert types(window_attn_skip_freq=None) == ["s"] * 4 and types(window_size=None) == ["f"] * 4


def test_plain_rotary_embeddings_are_said_so() -> None:
    """GptOss takes YaRN when the config names no rope scaling: Megatron's plain rope is written as "default"."""
    from transformers import GptOssConfig

    config = config_from_args(_args(position_embedding_type="rope", rotary_base=10000), "args")[0]
    assert GptOssConfig(**config).rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    yarn = GptOssConfig(**config_from_args(_args(), "args")[0]).rope_parameters
    assert yarn["rope_type"] == "yarn" and yarn["truncate"] is False and yarn["rope_theta"] == 150000.0


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": False}, "attention_bias is false"),
    ({"num_local_experts": 3}, r"mlp\.router\.weight: shape \[4, 16\], the config makes it \[3, 16\]"),
    ({"intermediate_size": 16}, r"local_experts\.0\.linear_fc1\.weight: shape \[64, 16\], the config makes it")])
def test_a_config_gpt_oss_does_not_match_is_refused_before_writing(change: dict[str, Any], message: str,
                                                                   tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **change}))
    with pytest.raises(shardstore.ExportError, match=message):
        shardstore.unshard(SRC, tmp_path / "hf", format="hf", hf_config=tmp_path / "config.json", jobs=1)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.parametrize("key, value", [("softmax_type", "off-by-one"), ("window_size", (3, 0))])
def test_gpt_oss_blocks_beside_others_are_refused_by_name(key: str, value: Any) -> None:
    """A fixed sink (off-by-one) or a window without GPT-OSS's learnable sinks: a Llama-family class would lose
    it without a word, so it is refused naming the argument."""
    from shardstore.export.hf.megatron import config_from_args as megatron_config

    llama = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "normalization": "RMSNorm", "swiglu": True}
    assert megatron_config(llama, "args")[0]["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(shardstore.ExportError, match=f"args: {key} is "):
        megatron_config({**llama, key: value}, "args")


def test_average_takes_the_mean_of_each_stacked_expert(tmp_path: Path) -> None:
    """`average --format hf` of two GPT-OSS saves: each expert's mean (an ArrayRef's, rounded once into the
    output's dtype), stacked as the export stacks it (it used to refuse the stack as "a small plain tensor")."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    layouts = ["tp1-pp1-dp2-gptoss", "tp2-pp1-dp2-gptoss"]  # attention drawn apart at TP 1 and 2, the experts alike
    result = shardstore.average([DATA / layout for layout in layouts], tmp_path / "mean", weights=[1, 3], format="hf",
                                hf_config=tmp_path / "config.json", jobs=1)
    assert result.averaged == 37 and not result.kept
    ones = []
    for layout in layouts:
        shardstore.unshard(DATA / layout, tmp_path / layout, format="hf", hf_config=tmp_path / "config.json", jobs=1)
        ones.append(load_file(tmp_path / layout / "model.safetensors"))
    mean = load_file(tmp_path / "mean" / "model.safetensors")
    for key, got in mean.items():  # in float64, rounded once, as average computes it
        assert torch.equal(got, (ones[0][key].double() * 0.25 + ones[1][key].double() * 0.75).float()), key
    assert not torch.equal(ones[0]["model.layers.0.self_attn.sinks"], ones[1]["model.layers.0.self_attn.sinks"])


# the hub's openai/gpt-oss-20b config.json, its sizes cut down (a window of 128 on every other layer, YaRN)
HUB = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
       "hidden_size": 2880, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 3,
       "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
       "num_hidden_layers": 6, "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
       "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                        "rope_type": "yarn", "truncate": False},
       "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
       "vocab_size": 201088, "torch_dtype": "bfloat16"}


def _megatron_args(config: dict[str, Any]) -> dict[str, Any]:
    from shardstore.export.megatron import megatron_args

    return vars(megatron_args(config, 201216, 128))


@pytest.mark.parametrize("change", [{}, {"layer_types": ["sliding_attention"] * 6},
                                    {"layer_types": ["full_attention"] * 6},
                                    {"layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 4},
                                    {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2},
                                    {"rope_scaling": {"rope_type": "default"}},
                                    {"rope_scaling": None, "rope_theta": None, "num_experts_per_tok": None,
                                     "sliding_window": None, "layer_types": None, "swiglu_limit": None}])
def test_megatron_args_read_back_as_the_same_gpt_oss(change: dict[str, Any]) -> None:
    """Megatron-LM's args written for a GptOss config (--format megatron's common state) read back (the
    --format hf direction) as a config transformers builds the same model from: its windows, whatever the
    pattern of layer_types (a skip frequency where one gives it, else a flag per layer), its YaRN, and what
    GptOssConfig takes where config.json says nothing (YaRN, its rotary base, top 4, windows of 128)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hub = {k: v for k, v in {**HUB, **change}.items() if v is not None}  # None: not said (GptOss's default)
    args = _megatron_args(hub)
    assert args["softmax_type"] == "learnable" and args["quick_geglu"] and not args["swiglu"]
    back = config_from_args({**args, "vocab_size": 201088}, "args")[0]
    ours, theirs = GptOssConfig(**back), GptOssConfig(**hub)
    for field in ("layer_types", "num_local_experts", "num_experts_per_tok", "intermediate_size", "head_dim",
                  "num_key_value_heads", "swiglu_limit", "attention_bias", "vocab_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    ours_rope, theirs_rope = GptOssRotaryEmbedding(ours), GptOssRotaryEmbedding(theirs)  # the same rotation
    assert torch.equal(ours_rope.inv_freq, theirs_rope.inv_freq)
    assert ours_rope.attention_scaling == theirs_rope.attention_scaling
    if "sliding_attention" in theirs.layer_types:
        assert ours.sliding_window == theirs.sliding_window


@pytest.mark.parametrize("change, message", [
    ({"swiglu_alpha": 1.5}, "swiglu_alpha is 1.5"),
    ({"swiglu_limit": None}, "swiglu_limit is None"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 3}, "layer_types is"),
    ({"layer_types": ["sliding_attention"] * 5}, "layer_types is"),
    ({"sliding_window": None}, "sliding_window is None"),
    ({"rope_scaling": {**HUB["rope_scaling"], "attention_factor": 2.0}}, "rope_scaling: YaRN's attention_factor is 2.0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling: rotary embeddings scaled as 'linear'"),
    # what a config.json may hold that is no value at all: refused in a line, never a traceback
    ({"rope_scaling": {**HUB["rope_scaling"], "factor": "32"}}, "rope_scaling: factor is '32'; a number"),
    ({"rope_scaling": {**HUB["rope_scaling"], "beta_fast": [1]}}, r"rope_scaling: beta_fast is \[1\]; a number"),
    ({"rope_scaling": [1]}, r"rope_scaling is \[1\]; an object"),
    ({"rope_theta": "x"}, "rope_theta is 'x'; a number"),
    ({"num_experts_per_tok": "4"}, "num_experts_per_tok is '4'; a count")])
def test_what_megatron_cannot_say_of_a_gpt_oss_is_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(shardstore.ExportError, match=f"the model's config.json: {message}"):
        _megatron_args({**HUB, **change})
