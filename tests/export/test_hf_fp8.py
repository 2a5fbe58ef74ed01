"""FP8 models with block scales (export/hf/fp8.py), as transformers' own FP8 quantizer writes them, against
transformers' own dequantization (`FineGrainedFP8Config(dequantize=True)`): `--dtype bfloat16` gives its
weights bit for bit and its logits, and so does `--format megatron` read back. transformers quantizes only
where it finds a GPU; its check of the environment is the one stand-in (the quantization is its own code)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardstore
from tests.conftest import assert_bitwise_equal
from tests.fixtures.dcp import item_zips

IDS = torch.tensor([[1, 5, 9, 200, 3, 77]])


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 model quantized by transformers' FineGrainedFP8 (128 × 128 blocks) and saved by it."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Qwen3Config, Qwen3ForCausalLM
    from transformers.quantizers import quantizer_finegrained_fp8

    base = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
                         tie_word_embeddings=False)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(base / "bf16")
    check = quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment
    quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    try:
        model = AutoModelForCausalLM.from_pretrained(base / "bf16", quantization_config=FineGrainedFP8Config(),
                                                     dtype=torch.bfloat16, device_map="cpu")
    finally:
        quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment = check
    model.save_pretrained(base / "fp8")
    return base / "fp8"


def _dequantized_by_transformers(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                dtype=torch.bfloat16).eval()


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_dtype_dequantizes_as_transformers_does(fp8_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert _weights(fp8_model)["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    shardstore.unshard(fp8_model, tmp_path / "bf16", format="hf", dtype="bfloat16", jobs=2)
    want = _dequantized_by_transformers(fp8_model)
    assert_bitwise_equal(_weights(tmp_path / "bf16"), want.state_dict(), "dequantized")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    with torch.no_grad():
        assert torch.equal(got(IDS).logits, want(IDS).logits)
    verified = shardstore.verify(fp8_model, tmp_path / "bf16")  # as the export dequantized it, not as a cast
    assert verified.ok and verified.tensors == len(want.state_dict()), verified.summary()


def test_safetensors_dtype_dequantizes_too(fp8_model: Path, tmp_path: Path) -> None:
    """--format safetensors (the model's tensors under their own names) of the FP8 folder: the same
    dequantized weights, its config.json's blocks taken from beside the weights."""
    shardstore.unshard(fp8_model, tmp_path / "st", format="safetensors", dtype="bfloat16", jobs=1)
    assert_bitwise_equal(_weights(tmp_path / "st"), _dequantized_by_transformers(fp8_model).state_dict(), "safetensors")
    assert shardstore.verify(fp8_model, tmp_path / "st").ok


def test_without_dtype_the_fp8_model_is_kept_as_it_is(fp8_model: Path, tmp_path: Path) -> None:
    shardstore.unshard(fp8_model, tmp_path / "same", format="hf", jobs=1)
    assert_bitwise_equal(_weights(tmp_path / "same"), _weights(fp8_model), "fp8")
    assert "quantization_config" in json.loads((tmp_path / "same" / "config.json").read_text())


@pytest.mark.parametrize("spread", [False, True])
def test_a_megatron_checkpoint_of_an_fp8_model_holds_its_dequantized_weights(fp8_model: Path, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             spread: bool) -> None:
    """The dequantized weights are what the one-pass run's finish writes, in files of their own by the
    workers once they are many bytes, and large ones (`spread`: however few and small)."""
    from shardstore.export import chunks, dcp

    if spread:
        monkeypatch.setattr(dcp, "INLINE_BYTES", 0)
        monkeypatch.setattr(chunks, "SHIPPED_ITEM_BYTES", 0)
    from torch.distributed.checkpoint import FileSystemReader

    shardstore.unshard(fp8_model, tmp_path / "megatron", format="megatron", jobs=2)
    assert item_zips(tmp_path / "megatron" / "release")  # every item's CRCs, the dequantized weights' too
    storage = FileSystemReader(str(tmp_path / "megatron" / "release")).read_metadata().storage_data
    holding = {at.relative_path for index, at in storage.items() if index.fqn.endswith("linear_fc1.weight")}
    assert len(holding) == (2 if spread else 1), holding  # (the quantized MLP weights)
    shardstore.unshard(tmp_path / "megatron", tmp_path / "back", format="hf", jobs=1)
    assert_bitwise_equal(_weights(tmp_path / "back"), _dequantized_by_transformers(fp8_model).state_dict(), "megatron")
    result = shardstore.verify(fp8_model, tmp_path / "megatron")  # against the model dequantized as the writer did
    assert result.ok and result.tensors == len(_weights(tmp_path / "back")), result.summary()


def test_scales_that_do_not_fit_their_weight_are_refused_by_name(fp8_model: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import save_file

    src = shutil.copytree(fp8_model, tmp_path / "src")
    weights = _weights(src)
    weights["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 2)
    for f in src.glob("*.safetensors"):
        f.unlink()
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(shardstore.ExportError, match=r"model.layers.1.mlp.down_proj.weight_scale_inv: shape \[2, 2\], "
                                                     r"but model.layers.1.mlp.down_proj.weight of shape \[256, 384\]"):
        shardstore.unshard(src, tmp_path / "out", format="hf", dtype="bfloat16", jobs=1)
    config = json.loads((fp8_model / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(shardstore.ExportError, match="dequantizes FP8 e4m3 weights with float32 scales"):
        shardstore.unshard(src, tmp_path / "out2", format="hf", dtype="bfloat16", jobs=1)
