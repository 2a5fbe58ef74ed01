"""`verify SRC OUTPUT`: genuine outputs pass, and every kind of damage a converter does is caught, one
line per tensor: one changed element, a dropped tensor, a cast by truncation, swapped parts of a split
weight, an extra tensor."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardstore
from shardstore.errors import ExportError


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardstore.cli", "verify", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    src = checkpoints(2)
    out = tmp_path_factory.mktemp("verify") / "st"
    shardstore.unshard(src, out, jobs=1)
    return src, out


def _damaged(out: Path, tmp_path: Path, change) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(out, copy)
    tensors = load_file(copy / "model.safetensors")
    change(tensors)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_a_genuine_export_passes(exported) -> None:
    src, out = exported
    result = shardstore.verify(src, out)
    assert result.ok and result.format == "safetensors"
    assert result.tensors == len(load_file(out / "model.safetensors")) > 0
    run = _cli(src, out)
    assert run.returncode == 0 and run.stdout == "", run.stderr
    assert "every one equal" in run.stderr


def test_one_changed_element_is_caught_with_its_index_and_values(exported, tmp_path: Path) -> None:
    src, out = exported
    tensors = load_file(out / "model.safetensors")
    name = next(n for n, t in tensors.items() if t.dim() == 2 and t.dtype == torch.float32)
    copy = tmp_path / "flipped"
    shutil.copytree(out, copy)
    raw = bytearray((copy / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin = json.loads(raw[8:8 + n])[name]["data_offsets"][0]
    row, col = 1, 2
    at = 8 + n + begin + (row * tensors[name].shape[1] + col) * 4
    raw[at + 3] ^= 0x40  # one element's exponent bit
    (copy / "model.safetensors").write_bytes(bytes(raw))
    result = shardstore.verify(src, copy)
    assert [d.name for d in result.differences] == [name]
    assert f"1 of {tensors[name].numel()} elements differ; the first, at [{row}, {col}], is" in result.differences[0].what
    run = _cli(src, copy)
    assert run.returncode == 1 and run.stdout.startswith(f"{name}: 1 of ")


def test_a_dropped_tensor_and_an_extra_one_are_named(exported, tmp_path: Path) -> None:
    src, out = exported
    names = sorted(load_file(out / "model.safetensors"))

    def change(tensors):
        tensors.pop(names[0])
        tensors["lm_head.extra"] = torch.zeros(2)

    result = shardstore.verify(src, _damaged(out, tmp_path, change))
    assert {(d.name, d.what.split(",")[0]) for d in result.differences} == {
        (names[0], "missing from the output"),
        ("lm_head.extra", "in the output")}


def test_a_cast_by_truncation_is_caught_where_round_to_nearest_even_differs(exported, tmp_path: Path) -> None:
    """A bf16 output is checked against the source cast as torch casts it: torch's own cast passes, a
    converter that cut the low mantissa bits off instead does not."""
    src, out = exported
    cast = tmp_path / "bf16"
    shardstore.unshard(src, cast, dtype="bf16", jobs=1)
    assert shardstore.verify(src, cast).ok
    source = load_file(out / "model.safetensors")
    name = next(n for n, t in source.items() if t.dtype == torch.float32 and t.numel() > 16)
    truncated = (source[name].view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert not torch.equal(truncated, source[name].to(torch.bfloat16))  # it does differ here

    def change(tensors):
        tensors[name] = truncated

    result = shardstore.verify(src, _damaged(cast, tmp_path, change))
    assert [d.name for d in result.differences] == [name]
    assert "elements differ" in result.differences[0].what


def test_a_hugging_face_folder_is_checked_under_its_names_and_swapped_splits_are_caught(olmo_models,
                                                                                          tmp_path: Path) -> None:
    """An hf folder (sharded, cast to bf16) is checked under the names and splits the export gives them;
    the up and gate halves of a fused MLP weight swapped is two differences."""
    src = olmo_models("olmo2", "legacy", 3)
    out = tmp_path / "hf"
    shardstore.unshard(src, out, format="hf", dtype="bfloat16", max_shard_size=60_000, jobs=1)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    result = shardstore.verify(src, out)
    assert result.ok and result.format == "hf" and result.tensors > 10
    swapped = tmp_path / "swapped"
    shutil.copytree(out, swapped)
    up, gate = "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate_proj.weight"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    files = {index[up], index[gate]}
    tensors = {f: load_file(out / f) for f in files}
    tensors[index[up]][up], tensors[index[gate]][gate] = tensors[index[gate]][gate], tensors[index[up]][up]
    for f, held in tensors.items():
        save_file(held, swapped / f, metadata={"format": "pt"})
    assert sorted(d.name for d in shardstore.verify(src, swapped).differences) == sorted([gate, up])


def test_an_output_of_other_names_says_so_and_an_unknown_format_is_refused(exported, tmp_path: Path) -> None:
    src, out = exported

    def rename(tensors):
        for name in list(tensors):
            tensors[f"model.{name}"] = tensors.pop(name)

    result = shardstore.verify(src, _damaged(out, tmp_path, rename))
    assert result.differences[-1].name == "(all)" and "no tensor name in common" in result.differences[-1].what
    with pytest.raises(ExportError, match="verify checks safetensors, hf, torch and dcp outputs, not zarr"):
        shardstore.verify(src, out, format="zarr")
    run = _cli(src, tmp_path / "nothing-here")
    assert run.returncode == 2 and "does not exist" in run.stderr


def test_accelerates_own_merge_passes(tmp_path: Path) -> None:
    """A peer's genuine output: `accelerate merge-weights` of the HF Trainer's FSDP2 checkpoint (its DCP
    model folder, as accelerate's docs give it) verifies against the checkpoint folder, tensor for tensor."""
    checkpoint = Path(__file__).parent / "fixtures" / "data" / "accelerate" / "fsdp2-w2" / "checkpoint-4"
    merge = subprocess.run([str(Path(sys.executable).parent / "accelerate"), "merge-weights",
                            str(checkpoint / "pytorch_model_fsdp_0"), str(tmp_path / "merged")],
                           capture_output=True, text=True, timeout=300)
    assert merge.returncode == 0, merge.stderr
    result = shardstore.verify(checkpoint, tmp_path / "merged")
    assert result.ok and result.tensors == len(load_file(tmp_path / "merged" / "model.safetensors"))


PEERS = Path(__file__).parent / "fixtures" / "data" / "peers"
DEEPSPEED = Path(__file__).parent / "fixtures" / "data" / "deepspeed"


@pytest.mark.parametrize("run", ["verl-fsdp2-w4", "verl-fsdp1-w3"])
def test_verls_own_merger_passes_and_a_changed_element_in_it_is_caught(run: str, tmp_path: Path) -> None:
    """`python -m verl.model_merger merge --backend fsdp` (veRL 0.9.1) of a veRL run's actor folder, kept
    with the run (tests/fixtures/peer_outputs.py): an HF folder, verified tensor for tensor against the run
    folder; the same folder with one element of one tensor changed fails, naming it."""
    merged = PEERS / f"{run}.merged"
    result = shardstore.verify(PEERS / run, merged)
    assert result.ok, result.differences
    assert result.format == "hf" and result.tensors == len(load_file(merged / "model.safetensors"))
    copy = tmp_path / "merged"
    shutil.copytree(merged, copy)
    tensors = load_file(copy / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] += 1
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    run_ = _cli(PEERS / run, copy)
    assert run_.returncode == 1
    assert "model.layers.1.mlp.up_proj.weight: 1 of" in run_.stdout and "the first, at [3, 5]" in run_.stdout


@pytest.mark.parametrize("kind", ["z2-w3", "z3-bf16-w3"])
def test_zero_to_fp32s_state_dict_passes_with_its_tied_name(kind: str, tmp_path: Path) -> None:
    """DeepSpeed's own zero_to_fp32.py output (a torch `pytorch_model.bin`: {name: tensor}, the tied
    `lm_head.weight` sharing the embedding's storage), given as its folder or as the file, verifies
    against the ZeRO checkpoint, the tied name compared too; the tie broken by a changed element is caught
    under the tied name, and a dropped tensor is named."""
    out = PEERS / f"{kind}.zero_to_fp32"
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    for given in (out, out / "pytorch_model.bin"):
        result = shardstore.verify(DEEPSPEED / kind, given)
        assert result.ok, result.differences
        assert result.format == "torch" and result.tensors == len(state)
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    state["lm_head.weight"][2, 1] += 1
    del state["model.norm.weight"]
    torch.save(state, tmp_path / "pytorch_model.bin")
    found = {d.name: d.what for d in shardstore.verify(DEEPSPEED / kind, tmp_path).differences}
    assert found.keys() == {"lm_head.weight", "model.norm.weight"}
    assert "the first, at [2, 1]" in found["lm_head.weight"] and found["model.norm.weight"] == "missing from the output"


def test_a_dtype_policy_keeps_matching_tensors_and_is_recorded(olmo_models, tmp_path: Path) -> None:
    """`--dtype bf16 --keep-dtype PATTERN`: tensors whose output name matches (a glob, or `re:` a regex)
    keep their dtype, the rest are cast; the same in one pass and in two steps; the headers record the
    policy; verify passes; a bad pattern or a policy without a cast is one line, before any work."""
    from safetensors import safe_open

    src = olmo_models("olmo2", "legacy", 3)
    one, two = tmp_path / "one", tmp_path / "two"
    shardstore.unshard(src, one, format="hf", dtype="bf16", keep_dtype=["*norm*", r"re:lm_head\..*"], jobs=1)
    shardstore.unshard(src, two, format="hf", dtype="bf16", keep_dtype=["*norm*", r"re:lm_head\..*"], jobs=1,
                       store=tmp_path / "store")
    tensors = load_file(one / "model.safetensors")
    kept = {n for n, t in tensors.items() if t.dtype == torch.float32}
    assert kept == {n for n in tensors if "norm" in n or n.startswith("lm_head.")} and kept != set(tensors)
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in kept)
    assert (one / "model.safetensors").read_bytes() == (two / "model.safetensors").read_bytes()
    with safe_open(one / "model.safetensors", "pt") as f:
        assert f.metadata()["shardstore_keep_dtype"] == r"*norm* re:lm_head\..*"
    assert shardstore.verify(src, one).ok
    with pytest.raises(ExportError, match="--keep-dtype 're:\\(': not a regular expression"):
        shardstore.unshard(src, tmp_path / "bad", dtype="bf16", keep_dtype=["re:("])
    with pytest.raises(ExportError, match="--keep-dtype goes with --dtype"):
        shardstore.unshard(src, tmp_path / "bad", keep_dtype=["*norm*"])
    assert not (tmp_path / "bad").exists()


def test_torch_outputs_are_walked_key_by_key(tmp_path: Path) -> None:
    """A torch output (shardstore's checkpoint.pt, or torch's own `dcp_to_torch_save` file by any name) is
    read back with the safe unpickler and walked beside what the export would write: genuine ones pass;
    a changed element and a dropped key are each named by their path."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = Path(__file__).parent / "corpus" / "data" / "torchtitan-dcp-t2.13-w2" / "step-2"
    dcp_to_torch_save(src, tmp_path / "theirs.pt")
    assert shardstore.verify(src, tmp_path / "theirs.pt").ok
    shardstore.unshard(src, tmp_path / "ours", format="torch", jobs=1)
    result = shardstore.verify(src, tmp_path / "ours")
    assert result.ok and result.format == "torch" and result.tensors > 10
    state = torch.load(tmp_path / "theirs.pt", weights_only=False)
    weight = next(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 2)
    state[weight][0, 1] += 1
    dropped = next(k for k in state if k != weight)
    del state[dropped]
    torch.save(state, tmp_path / "damaged.pt")
    names = {d.name: d.what for d in shardstore.verify(src, tmp_path / "damaged.pt").differences}
    assert names.keys() == {f"checkpoint.pt/{weight}", f"checkpoint.pt/{dropped}"}
    assert names[f"checkpoint.pt/{weight}"].startswith("1 of ") and "at [0, 1]" in names[f"checkpoint.pt/{weight}"]
    assert names[f"checkpoint.pt/{dropped}"] == "missing from the output"


def test_dcp_outputs_are_read_back_and_walked_key_by_key(tmp_path: Path) -> None:
    """A DCP output (shardstore's, or torch's own `torch_save_to_dcp` of the unsharded state) is read through
    the DCP reader and walked beside the checkpoint's state: genuine ones pass; a changed element and a
    dropped key are each named by their path."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    src = Path(__file__).parent / "corpus" / "data" / "torchtitan-dcp-t2.13-w2" / "step-2"
    shardstore.unshard(src, tmp_path / "ours", format="dcp", jobs=1)
    result = shardstore.verify(src, tmp_path / "ours")
    assert result.ok and result.format == "dcp" and result.tensors > 10
    dcp_to_torch_save(src, tmp_path / "whole.pt")
    torch_save_to_dcp(tmp_path / "whole.pt", tmp_path / "theirs")
    assert shardstore.verify(src, tmp_path / "theirs").ok
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    weight = next(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 2)
    state[weight][1, 2] -= 1
    dropped = next(k for k in state if k != weight)
    del state[dropped]
    torch.save(state, tmp_path / "damaged.pt")
    torch_save_to_dcp(tmp_path / "damaged.pt", tmp_path / "damaged")
    names = {d.name: d.what for d in shardstore.verify(src, tmp_path / "damaged", format="dcp").differences}
    assert names.keys() == {weight, dropped}
    assert names[weight].startswith("1 of ") and "at [1, 2]" in names[weight]
    assert names[dropped] == "missing from the output"
    run = _cli(src, tmp_path / "damaged", "--json")
    assert run.returncode == 1 and json.loads(run.stdout)["format"] == "dcp"
