"""`--format nemo` (export/nemo.py): a NeMo 2 checkpoint is `--format megatron`'s tensors, bit for bit as
torch's DCP reader assembles them, under NeMo's `module.` prefix, with the common state NeMo's
megatron-core reads (common.pt) and a context/ naming NeMo's classes with the model's config; shardstore
reads it back as the same Hugging Face model.

NeMo itself reads the output (tests/fixtures/nemo_load.py, out of CI: NeMo 2.7.3's llm collection needs
megatron-core 0.16.1 and does not install in the test set-up): run 2026-12-07, `load_context` of the model,
its tokenizer and the whole TrainerContext, and the weights loaded under `module.` into the GPTModel its
config builds, every tensor equal to megatron-core's load of `--format megatron`'s output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import shardstore
from shardstore.export import nemo
from tests.conftest import assert_bitwise_equal
from tests.export.test_hf_megatron_inverse import DATA
from tests.export.test_megatron import _dcp

# NeMo's model and config class for each fixture's model
CLASSES = {"tp1-pp1": ("LlamaModel", "LlamaConfig"), "tp2-pp1-qwen2": ("Qwen2Model", "Qwen2Config"),
           "tp2-pp1-qwen3": ("Qwen3Model", "Qwen3Config"), "tp2-pp1-tied": ("LlamaModel", "LlamaConfig"),
           "tp1-pp1-dp2-moe": ("MixtralModel", "MixtralConfig"), "tp1-pp1-dp2-qwen3moe": ("Qwen3Model", "Qwen3MoEConfig")}


# a tokenizer's files (their bytes are copied as they are, whatever they say)
TOKENIZER = {"tokenizer_config.json": b'{"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64}',
             "special_tokens_map.json": b'{"eos_token": "</s>"}', "tokenizer.model": bytes(range(256))}


def _hf(layout: str, tmp_path: Path) -> Path:
    shardstore.unshard(DATA / layout, tmp_path / "hf", format="hf", jobs=1)
    for name, data in TOKENIZER.items():
        (tmp_path / "hf" / name).write_bytes(data)
    return tmp_path / "hf"


def _objects(io: dict) -> dict[str, dict]:
    """io.json's objects by the path fiddle recorded for each."""
    return {obj["paths"][0]: obj for obj in io["objects"].values() if "paths" in obj}


def _arguments(io: dict, obj: dict) -> dict[str, object]:
    """A Config's arguments: leaves as values, pyrefs as "module.name", Configs as their class name, an
    empty dict as {}."""
    out = {}
    for attr, value in obj["items"]:
        name = attr.removeprefix("Attr(name='").removesuffix("')")
        if value["type"] == "leaf":
            out[name] = value["value"]
        elif value["type"] == "pyref":
            out[name] = f"{value['module']}.{value['name']}"
        else:
            target = io["objects"][value["key"]]
            if target["type"]["name"] == "dict":
                assert not target["items"], "only an empty dict is written here"
                out[name] = {}
                continue
            meta = io["objects"][target["metadata"]["key"]]
            out[name] = dict(meta["items"])["Attr(name='fn_or_cls')"]["name"]
    return out


@pytest.mark.parametrize("layout", list(CLASSES))
def test_a_nemo_checkpoint_is_megatrons_tensors_under_module_with_nemos_context(layout: str, tmp_path: Path) -> None:
    hf = _hf(layout, tmp_path)
    shardstore.unshard(hf, tmp_path / "nemo", format="nemo", jobs=1)
    shardstore.unshard(hf, tmp_path / "megatron", format="megatron", vocab_multiple=1, jobs=1)
    out = tmp_path / "nemo"
    tensors, objects = _dcp(out / "weights")
    want, want_objects = _dcp(tmp_path / "megatron" / "release")
    assert_bitwise_equal(tensors, {"module." + k: v for k, v in want.items()})
    config = json.loads((hf / "config.json").read_text())
    assert tensors["module.embedding.word_embeddings.weight"].shape[0] == config["vocab_size"]  # as NeMo builds it
    assert objects == {"module." + k for k in want_objects if k != "common_state/shard_0_1"}
    assert torch.load(out / "weights" / "common.pt", weights_only=True) == nemo.COMMON_STATE
    assert json.loads((out / "weights" / "metadata.json").read_text())["common_backend"] == "torch"

    io = json.loads((out / "context" / "io.json").read_text())
    by_path = _objects(io)
    assert _arguments(io, by_path["<root>"]) == {"model": CLASSES[layout][0],
                                                 "trainer": "Trainer", "extra": {}}
    root_meta = io["objects"][io["objects"][io["root"]["key"]]["metadata"]["key"]]
    assert dict(root_meta["items"])["Attr(name='fn_or_cls')"]["name"] == "TrainerContext"
    model = _arguments(io, by_path["<root>.model"])
    assert model["config"] == CLASSES[layout][1]
    assert model["tokenizer"] == "AutoTokenizer"
    fields = _arguments(io, by_path["<root>.model.config"])
    assert fields["num_layers"] == config["num_hidden_layers"] and fields["hidden_size"] == config["hidden_size"]
    assert fields["num_query_groups"] == config["num_key_value_heads"]
    assert fields["share_embeddings_and_output_weights"] == (layout == "tp2-pp1-tied")
    assert fields["add_qkv_bias"] == (layout == "tp2-pp1-qwen2") and fields["qk_layernorm"] == ("qwen3" in layout)
    experts = config.get("num_local_experts") or config.get("num_experts")
    assert fields.get("num_moe_experts") == experts and fields.get("moe_router_topk") == (experts and
                                                                                         config["num_experts_per_tok"])
    assert fields["activation_func"] == "torch.nn.functional.silu"
    assert _arguments(io, by_path["<root>.model.tokenizer"]) == {"pretrained_model_name": "nemo_tokenizer"}
    copied = {p.name: p.read_bytes() for p in (out / "context" / "nemo_tokenizer").iterdir()}
    assert {k: v for k, v in copied.items() if k != "generation_config.json"} == TOKENIZER

    described = yaml.safe_load((out / "context" / "model.yaml").read_text())
    assert described["config"]["_target_"].endswith("." + CLASSES[layout][1])
    for key, value in fields.items():  # the same fields, a callable or a dtype as its `_target_`
        said = described["config"][key]
        assert (said["_target_"] if isinstance(said, dict) else said) == value, key
    assert described["tokenizer"]["pretrained_model_name"] == "nemo_tokenizer"

    result = shardstore.verify(hf, out)  # read back (weights/ under module., the config from model.yaml)
    assert result.ok and result.format == "nemo", result.summary()


def test_what_nemo_has_no_class_for_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    hf = _hf("tp1-pp1-dp2-qwen2moe", tmp_path)  # its gated shared expert: --format megatron writes it, not NeMo
    with pytest.raises(shardstore.ExportError, match="Qwen2MoeForCausalLM has no NeMo 2 model class written here"):
        shardstore.unshard(hf, tmp_path / "out", format="nemo", jobs=1)
    assert not (tmp_path / "out").exists()
    llama = _hf("tp1-pp1", tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(shardstore.ExportError, match="rotary embeddings scaled as"):
        shardstore.unshard(llama, tmp_path / "yarn", format="nemo", jobs=1)
    assert not (tmp_path / "yarn").exists()


def test_llama_3s_scaling_is_llama31config_and_a_model_without_tokenizer_names_none(tmp_path: Path) -> None:
    hf = _hf("tp1-pp1", tmp_path)
    for name in TOKENIZER:
        (hf / name).unlink()
    config = json.loads((hf / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    (hf / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    written = shardstore.unshard(hf, tmp_path / "out", format="nemo", jobs=1)
    assert any("names no tokenizer" in note for note in written.notes), written.notes
    io = json.loads((tmp_path / "out" / "context" / "io.json").read_text())
    by_path = _objects(io)
    assert _arguments(io, by_path["<root>.model"]) == {"config": "Llama31Config"}
    fields = _arguments(io, by_path["<root>.model.config"])
    assert (fields["scale_factor"], fields["low_freq_factor"], fields["high_freq_factor"], fields["old_context_len"]) == \
        (8.0, 1.0, 4.0, 8192)
    assert yaml.safe_load((tmp_path / "out" / "context" / "model.yaml").read_text())["tokenizer"] is None
