"""`--format hf`: from a sharded checkpoint to a folder transformers loads, in one command.

OLMo 1 and OLMo 2 models are ai2-olmo's own `olmo.model.OLMo`, trained under FSDP by gloo processes and
saved in each format OLMo wrote; the logits of `AutoModelForCausalLM.from_pretrained(OUT)` are compared
with OLMo's own forward pass over torch's gather of the same weights. A Composer checkpoint of a
transformers model round-trips through `from_pretrained` and `AutoTokenizer.from_pretrained`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import shardstore
from shardstore.cli import main
from tests.conftest import copy_checkpoint, expected
from tests.fixtures.olmo_model import ARCHS, build_model
from tests.test_cli import error_line

TOLERANCE = 1e-4
IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(7))


def _reference_logits(arch: str, src: Path) -> torch.Tensor:
    model = build_model(arch)
    model.load_state_dict(torch.load(src / "expected.pt.ref", weights_only=False)["model"])
    with torch.no_grad():
        return model.eval()(IDS).logits


def _hf_logits(out: Path, **kwargs: object) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, **kwargs).eval()
    with torch.no_grad():
        return model, model(IDS).logits.float()


CASES = [("olmo2", "legacy", 3), ("olmo1", "local", 2), ("olmo2", "olmo_core", 3), ("olmo1", "torch_new", 2)]


@pytest.mark.parametrize("arch,fmt,world", CASES)
def test_olmo_checkpoints_load_in_transformers_with_olmos_logits(arch: str, fmt: str, world: int, olmo_models,
                                                                tmp_path: Path) -> None:
    src = olmo_models(arch, fmt, world)
    result = CliRunner().invoke(main, ["unshard", str(src), str(tmp_path / "hf"), "--format", "hf", "-q"])
    assert result.exit_code == 0, result.output
    model, logits = _hf_logits(tmp_path / "hf")
    assert type(model).__name__ == ("Olmo2ForCausalLM" if arch == "olmo2" else "OlmoForCausalLM")
    assert (logits - _reference_logits(arch, src)).abs().max().item() <= TOLERANCE

    # The fused weights are split exactly as transformers' converters split them, bit for bit.
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    full = torch.load(src / "expected.pt.ref", weights_only=False)["model"]
    d, heads = ARCHS[arch]["d_model"], ARCHS[arch]["n_heads"]
    kv = ARCHS[arch].get("n_kv_heads") or heads
    q, k, v = torch.split(full["transformer.blocks.1.att_proj.weight"], [d, d // heads * kv, d // heads * kv])
    up, gate = torch.chunk(full["transformer.blocks.1.ff_proj.weight"], 2)
    for name, want in [("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                       ("mlp.up_proj", up), ("mlp.gate_proj", gate)]:
        assert torch.equal(weights[f"model.layers.1.{name}.weight"], want), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == kv and config["vocab_size"] == 128 and config["eos_token_id"] == 99
    assert config["rope_theta"] == ARCHS[arch]["rope_theta"]
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 99


def test_dtype_and_shards_apply(olmo_models, tmp_path: Path) -> None:
    src = olmo_models("olmo2", "legacy", 3)
    shardstore.unshard(src, tmp_path / "hf", format="hf", dtype="bfloat16", max_shard_size=60_000, jobs=1)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    params = sum(t.numel() for f in files for t in load_file(tmp_path / "hf" / f).values())
    assert index["metadata"] == {"total_parameters": params, "total_size": 2 * params}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, logits = _hf_logits(tmp_path / "hf")
    assert model.dtype == torch.bfloat16
    assert (logits - _reference_logits("olmo2", src)).abs().max().item() < 0.05  # bf16 rounding only


@pytest.fixture(scope="module")
def composer_hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both Composer formats of one model, saved by one gloo world of 2."""
    from tests.fixtures.composer_hf import make_composer_hf_checkpoints

    base = tmp_path_factory.mktemp("composer-hf")
    return make_composer_hf_checkpoints({fmt: base / fmt for fmt in ("rank-files", "dcp")}, 2)


@pytest.mark.parametrize("fmt", ["rank-files", "dcp"])
def test_a_composer_hf_model_round_trips_with_its_tokenizer(fmt: str, composer_hf: dict[str, Path],
                                                            tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = composer_hf[fmt]
    result = shardstore.unshard(src, tmp_path / "hf", format="hf", jobs=2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src / "hf-config")).eval()
    full = torch.load(src / "expected.pt.ref", weights_only=False)["model"]
    reference.load_state_dict({k.removeprefix("model."): v for k, v in full.items()})
    ids = torch.arange(24).reshape(2, 12) % 97
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
    if fmt == "dcp":  # DCP dropped the tokenizer's empty entries: no tokenizer rather than a wrong one
        assert not (tmp_path / "hf" / "tokenizer.json").exists() and "tokenizer files not written" in result.notes[0]
        return
    tok, want = AutoTokenizer.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(src / "tokenizer")
    text = "w1 w5 w90 unknown w3"
    assert tok(text)["input_ids"] == want(text)["input_ids"] and tok.eos_token == "</s>"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the files the tokenizer saved, content for content
        assert json.loads((tmp_path / "hf" / name).read_text()) == json.loads((src / "tokenizer" / name).read_text())


def test_hf_config_names_the_model_of_any_other_checkpoint(checkpoints, tmp_path: Path) -> None:
    """A transformers Llama saved in OLMo's layout: its weights already carry transformers' names."""
    src = checkpoints(2, kind="hf")
    result = CliRunner().invoke(main, ["unshard", str(src), str(tmp_path / "hf"), "--format", "hf",
                                       "--hf-config", str(src / "hf-config"), "-q"])
    assert result.exit_code == 0, result.output
    loaded, _ = _hf_logits(tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(loaded.config).eval()
    reference.load_state_dict(expected(src)["model"])
    ids = torch.arange(24).reshape(2, 12) % loaded.config.vocab_size
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_olmo_names_are_normalised() -> None:
    from shardstore.export.hf.olmo import normalise

    assert normalise("transformer.block_groups.1.0.att_proj.weight", 2) == "transformer.blocks.2.att_proj.weight"
    assert normalise("_fsdp_wrapped_module.transformer._fsdp_wrapped_module.blocks.3._checkpoint_wrapped_module."
                     "ff_out.weight", 1) == "transformer.blocks.3.ff_out.weight"


def test_without_a_config_the_export_says_what_is_missing(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    line = error_line("unshard", str(src), str(tmp_path / "hf"), "--format", "hf", "-q")
    assert line.endswith("none inside (Composer); give --hf-config PATH")
    assert not (tmp_path / "hf" / ".shardstore-scratch").exists()  # refused before the ingest: nothing kept


def test_olmo_features_transformers_cannot_express_are_refused(olmo_models, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(olmo_models("olmo2", "legacy", 3), tmp_path / "ckpt")
    config = (ckpt / "config.yaml").read_text()
    (ckpt / "config.yaml").write_text(config.replace("  include_bias: false", "  include_bias: true", 1))
    line = error_line("unshard", str(ckpt), str(tmp_path / "a"), "--format", "hf", "-q")
    assert "model.include_bias: an OLMo model with biases has no transformers equivalent" in line
    (ckpt / "config.yaml").write_text(config.replace("  d_model: 64", "  d_model: 32", 1))
    line = error_line("unshard", str(ckpt), str(tmp_path / "b"), "--format", "hf", "-q")
    assert "transformer.wte.weight is [128, 64], but config.yaml implies [128, 32]" in line


def test_a_peft_models_weights_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A LoRA run's model holds the base weights under PEFT's names (`base_layer`) and the adapters:
    under the base model's config.json transformers would start those weights afresh, silently. Refused
    in one line naming a weight and the two ways out (tests/export/test_adapters.py), before any work;
    safetensors still exports them as they are."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    names = ["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
             "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    save_file({n: torch.ones(4, 4) for n in names}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    line = error_line("unshard", str(src), str(tmp_path / "hf"), "--format", "hf", "-q")
    assert "holds a LoRA model: its base weights and its adapter (e.g. " \
           "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight)" in line
    assert "--adapter writes the adapter as peft saves it, --merge-adapter the model with it merged" in line
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
    shardstore.unshard(src, tmp_path / "st")
    assert sorted(load_file(tmp_path / "st" / "model.safetensors")) == sorted(names)


@pytest.fixture(scope="module")
def user_vl_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's own run of a tiny Qwen2-VL: `dcp.save({"model": ...})` with the model's config.json beside
    it, its sub-configs saying their dtype as transformers 4 wrote them (transformers 5 writes the top's)."""
    import torch.distributed.checkpoint as dcp
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64, bos_token_id=0, eos_token_id=1,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2, patch_size=2, spatial_merge_size=1,
                  temporal_patch_size=1)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision))
    src = tmp_path_factory.mktemp("user-vl") / "step4"
    dcp.save({"model": model.state_dict()}, checkpoint_id=src)
    model.config.save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    for sub in ("text_config", "vision_config"):
        config[sub]["torch_dtype"] = "float32"
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_a_bf16_export_says_bf16_in_every_dtype_field_and_loads_so(user_vl_run: Path, tmp_path: Path) -> None:
    """`--dtype bf16 --keep-dtype '*norm*'` of a run described by its own config.json: the norms stay fp32
    in the files, the config names the dtype of most of the bytes, top and sub-configs alike (it said
    float32, and from_pretrained loaded the model at twice its size)."""
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "hf"
    shardstore.unshard(user_vl_run, out, format="hf", dtype="bf16", keep_dtype=["*norm*"], jobs=1)
    weights = load_file(out / "model.safetensors")
    kept = {k for k, t in weights.items() if t.dtype == torch.float32}
    assert kept and all("norm" in k for k in kept)
    assert {t.dtype for k, t in weights.items() if k not in kept} == {torch.bfloat16}

    def dtype_fields(config: dict, where: str = "") -> dict[str, object]:
        found = {f"{where}{k}": v for k, v in config.items() if k in ("dtype", "torch_dtype")}
        for k, v in config.items():
            if isinstance(v, dict):
                found.update(dtype_fields(v, f"{where}{k}."))
        return found

    fields = dtype_fields(json.loads((out / "config.json").read_text()))
    assert {"text_config.torch_dtype", "vision_config.torch_dtype"} <= set(fields)
    assert {"dtype", "torch_dtype"} & set(fields)  # the top's, as the run's config spelled it (or torch_dtype)
    assert set(fields.values()) == {"bfloat16"}, fields
    model = AutoModelForImageTextToText.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # transformers loads one dtype: the config's


def test_a_keep_dtype_pattern_matching_nothing_is_refused_naming_the_nearest(user_vl_run: Path, tmp_path: Path) -> None:
    """`--keep-dtype '*nrom*'` (a typo for norm) kept nothing and said nothing."""
    line = error_line("unshard", str(user_vl_run), str(tmp_path / "hf"), "--format", "hf", "--dtype", "bf16",
                      "--keep-dtype", "*nrom*", "-q")
    assert "--keep-dtype '*nrom*': matches no tensor of the output; the nearest output name is " in line
    assert "norm" in line.rsplit("nearest output name is ", 1)[1]
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
