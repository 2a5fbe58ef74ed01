"""MXFP4 (export/mxfp4.py): GPT-OSS as OpenAI released it, each layer's experts kept as 4-bit blocks and
power-of-two scales, dequantized on the way out. transformers is the oracle: its `convert_moe_packed_tensors`
for the arithmetic, and its `from_pretrained` of the folder (which dequantizes MXFP4 into bfloat16 on a CPU)
for the tensors and logits. The folder is written in the hub's layout from a model transformers saved
(tests/fixtures/gpt_oss_hf.py): transformers has no CPU quantizer to write one.

megatron-core itself loads the `--format megatron --transformer-impl local` output of `gpt_oss_hf.py --mxfp4`
(tests/fixtures/megatron_load.py, out of CI) with the logits transformers gives the MXFP4 folder: run
2026-12-07, within 3.5e-07 at TP 1, 6.6e-07 at TP 2 × PP 2 and at TP 2 × EP 2."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import shardstore
from shardstore.export import mxfp4
from shardstore.export.mxfp4 import columns, values
from tests.conftest import assert_bitwise_equal
from tests.fixtures.gpt_oss_hf import mxfp4_folder

def _transformers(folder: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """transformers' own model of `folder` (MXFP4 dequantized into bfloat16 on a CPU): its state dict and
    its logits on a fixed batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 77, 150, 3, 42, 8]])).logits
    return {k: v.contiguous() for k, v in model.state_dict().items()}, logits


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("native", [True, False])
def test_values_are_transformers_own_bit_for_bit(dtype: str, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every byte and every scale (0 makes subnormals, 255 infinities of all but the smallest values: an exact
    ldexp, as torch's), against transformers' convert_moe_packed_tensors: the C extension's and numpy's."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if native and not mxfp4.NATIVE:
        assert os.environ.get("SHARDSTORE_REQUIRE_NATIVE") != "1", "CI builds the C extension"
        pytest.skip("the C extension was not built (no compiler at install time)")
    if not native:
        monkeypatch.setattr(mxfp4, "_mxfp4_c", None)
        monkeypatch.setattr(mxfp4, "_columns_c", None)
    draw = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=draw, dtype=torch.uint8)
    scales = torch.randint(0, 256, (3, 40, 4), generator=draw, dtype=torch.uint8)
    scales[0, 0, :] = torch.tensor([0, 1, 254, 255])
    want = convert_moe_packed_tensors(blocks, scales, dtype=getattr(torch, dtype))
    for e in range(3):
        packed, exponents = blocks[e].numpy(), scales[e].numpy()
        assert bytes(columns(packed, exponents, 0, 4, dtype)) == want[e].contiguous().view(torch.uint8).numpy().tobytes()
        for first, count in ((1, 2), (3, 1), (2, 0)):  # a slab of groups: their columns, transposed
            slab = want[e][first * 32:(first + count) * 32].contiguous().view(torch.uint8).numpy().tobytes()
            assert bytes(columns(packed, exponents, first, count, dtype)) == slab, (e, first, count)
        assert bytes(values(packed, exponents, dtype)) == want[e].T.contiguous().view(torch.uint8).numpy().tobytes()


class _Arrays:
    """The one store call an MXFP4 array's reading makes (`stream`, rows of an array), over numpy arrays."""

    def __init__(self, **arrays: np.ndarray) -> None:
        self.arrays = arrays

    def stream(self, path: str, allow_partial: bool = False, rows: tuple[int, int] | None = None) -> Iterator[bytes]:
        first, stop = rows or (0, len(self.arrays[path]))
        yield self.arrays[path][first:stop].tobytes()


@pytest.mark.parametrize("slab", [1, 3000, 1 << 24])  # a row or a group a slab, a few, the whole expert
def test_an_expert_streams_in_slabs_as_transformers_dequantizes_it(slab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`parts` (transformers' orientation, columns × rows) and `member_rows` (Megatron's, rows × columns,
    rows gathered from their interleaving: [gate; up]) give the same bytes however many slabs it takes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from shardstore.export.resolve import ArrayRef

    monkeypatch.setattr(mxfp4, "SLAB_BYTES", slab)
    draw = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 10, 3, 16), generator=draw, dtype=torch.uint8)
    scales = torch.randint(120, 130, (3, 10, 3), generator=draw, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # (experts, 96 columns, 10 rows)
    store: Any = _Arrays(b=blocks.numpy(), s=scales.numpy())
    source = mxfp4.dequantizing(ArrayRef("b", "uint8", (3, 10, 3, 16)), ArrayRef("s", "uint8", (3, 10, 3)),
                                "bfloat16", "x")
    assert b"".join(bytes(p) for p in source.parts(store)) == want.contiguous().view(torch.uint8).numpy().tobytes()
    for expert in range(3):
        rows = want[expert].T  # rows x columns, as stored
        for interleave in (1, 2):
            gathered = torch.cat([rows[way::interleave] for way in range(interleave)])
            got = b"".join(bytes(p) for p in source.member_rows(store, expert, interleave))
            assert got == gathered.contiguous().view(torch.uint8).numpy().tobytes(), (expert, interleave)


def test_an_mxfp4_model_becomes_transformers_own_bfloat16_model(tmp_path: Path) -> None:
    """`--format hf --dtype bfloat16`: every tensor transformers' from_pretrained holds, bit for bit (the
    experts dequantized and transposed as it does), the config without quantization_config, the logits;
    `--format safetensors --dtype bfloat16` the same tensors; without --dtype, the blocks and scales as
    they are."""
    mxfp4_folder(tmp_path / "src")
    want, logits = _transformers(tmp_path / "src")
    shardstore.unshard(tmp_path / "src", tmp_path / "hf", format="hf", dtype="bfloat16", jobs=2)
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    got = _safetensors(tmp_path / "hf")
    assert got["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert_bitwise_equal(got, {k: v for k, v in want.items() if k in got}, "mxfp4")
    assert set(got) == set(want)
    assert torch.equal(_transformers(tmp_path / "hf")[1], logits)
    shardstore.unshard(tmp_path / "src", tmp_path / "st", format="safetensors", dtype="bfloat16", jobs=1)
    assert_bitwise_equal(_safetensors(tmp_path / "st"), got, "mxfp4 safetensors")  # (the config kept beside it)
    for out in ("hf", "st"):  # checked as the export dequantized them, not as their bytes cast
        verified = shardstore.verify(tmp_path / "src", tmp_path / out)
        assert verified.ok and verified.tensors == len(got), verified.summary()
    shardstore.unshard(tmp_path / "src", tmp_path / "kept", format="hf", jobs=1)
    assert_bitwise_equal(_safetensors(tmp_path / "kept"), _safetensors(tmp_path / "src"), "mxfp4 kept")


@pytest.mark.parametrize("via", ["one pass", "store", "sharded"])
def test_an_mxfp4_model_becomes_a_megatron_checkpoint_of_its_dequantized_experts(via: str, tmp_path: Path) -> None:
    """`--format megatron` of the MXFP4 model: each expert dequantized straight into Megatron's rows ×
    columns ([gate; up] gathered from the interleaved rows); read back as Hugging Face's, transformers' own
    bfloat16 model bit for bit. Also of the folder in two files with an index, each expert's blocks in one
    and its scales in the other (each file a worker's unit)."""
    mxfp4_folder(tmp_path / "src")
    if via == "sharded":
        _split(tmp_path / "src")
    want, logits = _transformers(tmp_path / "src")
    store = {"store": tmp_path / "store"} if via == "store" else {}
    shardstore.unshard(tmp_path / "src", tmp_path / "megatron", format="megatron", jobs=2, **store)
    shardstore.unshard(tmp_path / "megatron", tmp_path / "back", format="hf", jobs=1)
    got = _safetensors(tmp_path / "back")
    assert_bitwise_equal(got, {k: v for k, v in want.items() if k in got}, "mxfp4 via megatron")
    assert torch.equal(_transformers(tmp_path / "back")[1], logits)
    verified = shardstore.verify(tmp_path / "src", tmp_path / "megatron")  # the experts as the writer dequantized them
    assert verified.ok and verified.tensors == len(got), verified.summary()


def _split(folder: Path) -> None:
    """`folder`'s model.safetensors as two files and their index, the scales apart from their blocks."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    files = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.endswith("_scales")},
             "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.endswith("_scales")}}
    for name, part in files.items():
        save_file(part, folder / name, metadata={"format": "pt"})
    weight_map = {key: name for name, part in files.items() for key in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_the_c_extension_refuses_bytes_that_are_not_its_groups() -> None:
    if not mxfp4.NATIVE:
        pytest.skip("the C extension was not built (no compiler at install time)")
    with pytest.raises(ValueError, match="mxfp4: 31 packed bytes for 2 groups of 16"):
        mxfp4._mxfp4_c(bytes(31), bytes(2), True)
    with pytest.raises(ValueError, match="mxfp4_columns: 64 packed bytes, 4 exponents, 2 rows, groups 1 \\+ 2"):
        mxfp4._columns_c(bytes(64), bytes(4), True, 2, 1, 2)  # (2 groups a row: group 2 is none)
    with pytest.raises(ValueError, match="mxfp4_columns: 60 packed bytes"):
        mxfp4._columns_c(bytes(60), bytes(4), True, 2, 0, 2)


def test_blocks_that_do_not_fit_their_scales_are_refused_by_name(tmp_path: Path) -> None:
    mxfp4_folder(tmp_path / "src")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    key = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[key] = tensors[key][:, :, :0].contiguous()
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(shardstore.ExportError, match=r"model\.layers\.0\.mlp\.experts\.down_proj_blocks: uint8 "
                                                     r"\[4, 64, 1, 16\] with uint8 scales \[4, 64, 0\]"):
        shardstore.unshard(tmp_path / "src", tmp_path / "hf", format="hf", dtype="bfloat16", jobs=1)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
