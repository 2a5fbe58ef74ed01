"""`verify SRC OUTPUT`: genuine outputs pass, and every kind of damage a converter does is caught, one
line per tensor: one changed element, a dropped tensor, a cast by truncation, swapped parts of a split
weight, an extra tensor."""

from __future__ import annotations

import json
import re
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
    with pytest.raises(ExportError, match="unknown format 'zarr'; choose one of safetensors, torch, dcp, hf"):
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
    assert names.keys() == {f"damaged.pt/{weight}", f"damaged.pt/{dropped}"}  # by the file's own name
    assert names[f"damaged.pt/{weight}"].startswith("1 of ") and "at [0, 1]" in names[f"damaged.pt/{weight}"]
    assert names[f"damaged.pt/{dropped}"] == "missing from the output"


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


def _values(what: str) -> tuple[float, float]:
    """The two values a difference line names: (in the output, from the checkpoint)."""
    found = re.search(r"is (\S+) in the output, (\S+) from the checkpoint$", what)
    assert found, what
    return float(found[1]), float(found[2])


def _first_difference(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[int, list[int], float, float]:
    """What verify must report for a tensor, from torch: how many elements differ in their bits, the first's
    index, its value in the output (`theirs`) and in the checkpoint (`ours`)."""
    bits = {4: torch.int32, 2: torch.int16}[ours.element_size()]
    differ = (ours.view(bits) != theirs.view(bits)).reshape(-1)
    first = int(differ.nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(first), ours.shape)]
    return int(differ.sum()), index, float(theirs.reshape(-1)[first]), float(ours.reshape(-1)[first])


def _saved_step(path: Path, seed: int, like: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A user's `dcp.save({"model": ...})` of a model of many tensors (more than verify prints lines for)
    and one of 5 M elements (several 16 MiB blocks), its values from `seed`; with `like`, the big tensor
    is `like`'s but for its last 0.6 M elements (so that its first difference is in a later block)."""
    import torch.distributed.checkpoint as dcp

    from shardstore.cli import VERIFY_LINES

    gen = torch.Generator().manual_seed(seed)
    state = {f"layers.{i}.{p}": torch.randn(6, 5, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
             for i in range(VERIFY_LINES // 2 + 5) for p in ("weight", "bias")}
    state["big"] = torch.randn(5_000_000, generator=gen)
    if like is not None:
        state["big"][:4_400_000] = like["big"][:4_400_000]
    dcp.save({"model": state}, checkpoint_id=path)
    return state


def test_an_export_of_another_checkpoint_is_reported_whole_counts_first_index_and_values(tmp_path: Path) -> None:
    """The user's mistake the report must keep up with: an export of another step verified against this one.
    Every tensor differs; each line gives the count of differing elements, the first one's index and both
    values as torch sees them, also where the first difference is blocks into a tensor, for a safetensors
    output and a DCP one (streamed from a second store, cut elsewhere). The CLI prints the first
    VERIFY_LINES lines and how many more; --json gives every one."""
    from shardstore.cli import VERIFY_LINES

    ours = _saved_step(tmp_path / "step2", seed=2)
    theirs = _saved_step(tmp_path / "step4", seed=4, like=ours)
    shardstore.unshard(tmp_path / "step4", tmp_path / "st", jobs=1)
    shardstore.unshard(tmp_path / "step4", tmp_path / "dcp", format="dcp", jobs=1)
    for out, prefix in ((tmp_path / "dcp", "model/"), (tmp_path / "st", "")):
        result = shardstore.verify(tmp_path / "step2", out)
        found = {d.name.removeprefix(prefix): d.what for d in result.differences}
        assert found.keys() == ours.keys() and result.tensors == len(ours)
        for name, what in found.items():
            count, index, output, source = _first_difference(ours[name], theirs[name])
            assert what.startswith(f"{count} of {ours[name].numel()} elements differ; the first, at {index}, is ")
            assert torch.tensor(_values(what), dtype=ours[name].dtype).tolist() == [output, source], (name, what)
        assert found["big"].startswith(f"{5_000_000 - 4_400_000} of 5000000 elements differ; the first, at [4400000]")
    run = _cli(tmp_path / "step2", tmp_path / "st")  # the last `result`: this output's
    lines = run.stdout.splitlines()
    assert run.returncode == 1 and len(ours) > VERIFY_LINES
    assert lines[:-1] == [str(d) for d in result.differences[:VERIFY_LINES]]
    assert lines[-1] == f"... and {len(ours) - VERIFY_LINES} more (--json lists every one)"
    assert f"{len(ours)} difference(s) in the output" in run.stderr
    listed = json.loads(_cli(tmp_path / "step2", tmp_path / "st", "--json").stdout)["differences"]
    assert {d["name"] for d in listed} == ours.keys()


@pytest.fixture(scope="module")
def user_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A user's training script: a tiny Llama (transformers) trained one AdamW step and `dcp.save`d as
    {"model", "optim"}; the model is returned with it."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (1, 5))).logits.sum().backward()
    optim.step()
    src = tmp_path_factory.mktemp("user-run") / "step1"
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=src)
    return src, model


def test_torchs_own_dcp_to_torch_save_passes_in_its_folder_by_any_name(user_run, olmo_models,
                                                                         tmp_path: Path) -> None:
    """torch's `dcp_to_torch_save` of the user's {"model", "optim"} save, one file holding the whole state, in
    the folder the user gave it (named model.pt, as one of shardstore's split files is, or anything else):
    verified key by key (it said `model.pt: missing from the output ... compared 0 tensors`); a changed
    element and a dropped optimizer key are named under the file's name. shardstore's own split files and
    --single-file still pass."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src, _ = user_run
    for name in ("model.pt", "whole.pth"):
        (tmp_path / name).mkdir()
        dcp_to_torch_save(src, tmp_path / name / name)
        result = shardstore.verify(src, tmp_path / name)
        assert result.ok and result.format == "torch", result.differences
        state = torch.load(tmp_path / name / name, weights_only=False)
        assert result.tensors == sum(isinstance(v, torch.Tensor) for v in _leaves(state)) > 20
    state["model"]["model.layers.1.mlp.up_proj.weight"][3, 4] += 1
    param = list(state["optim"]["state"])[2]
    del state["optim"]["state"][param]["exp_avg"]
    torch.save(state, tmp_path / name / name)
    found = {d.name: d.what for d in shardstore.verify(src, tmp_path / name).differences}
    assert found.keys() == {f"{name}/model/model.layers.1.mlp.up_proj.weight", f"{name}/optim/state/{param}/exp_avg"}
    assert "the first, at [3, 4]" in found[f"{name}/model/model.layers.1.mlp.up_proj.weight"]
    olmo = olmo_models("olmo2", "legacy", 3)
    shardstore.unshard(olmo, tmp_path / "split", format="torch", jobs=1)
    shardstore.unshard(olmo, tmp_path / "single", format="torch", single_file=True, jobs=1)
    assert len(list((tmp_path / "split").glob("*.pt"))) > 1 and len(list((tmp_path / "single").glob("*.pt"))) == 1
    assert shardstore.verify(olmo, tmp_path / "split").ok and shardstore.verify(olmo, tmp_path / "single").ok


def _leaves(value: object) -> list[object]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


@pytest.mark.parametrize("sharded", [False, True])
def test_the_hf_trainers_pytorch_model_bin_passes_beside_its_training_args(user_run, sharded: bool,
                                                                            tmp_path: Path) -> None:
    """The folder the HF Trainer saves with save_safetensors=False: config.json, training_args.bin (its
    pickled TrainingArguments, not a state dict) and pytorch_model.bin, or the shards huggingface_hub's
    save_torch_state_dict writes for it with their pytorch_model.bin.index.json. Verified by name against the
    user's DCP save with no --hf-config (the folder's config.json describes the model); a changed element in
    one shard is named."""
    from huggingface_hub import save_torch_state_dict
    from transformers import TrainingArguments

    src, model = user_run
    out = tmp_path / "trainer"
    out.mkdir()
    model.config.save_pretrained(out)
    torch.save(TrainingArguments(output_dir=str(tmp_path / "run"), report_to="none"), out / "training_args.bin")
    save_torch_state_dict(model.state_dict(), out, safe_serialization=False, max_shard_size=20_000 if sharded else "5GB")
    bins = sorted(out.glob("pytorch_model*.bin"))
    assert (len(bins) > 1) == sharded == (out / "pytorch_model.bin.index.json").is_file()
    result = shardstore.verify(src, out)
    assert result.ok and result.format == "hf" and result.tensors == len(model.state_dict()), result.differences
    shard = torch.load(bins[-1], weights_only=True)
    name = next(k for k, t in shard.items() if t.dim() == 2)
    shard[name][1, 0] += 1
    torch.save(shard, bins[-1])
    found = {d.name: d.what for d in shardstore.verify(src, out).differences}
    assert found.keys() == {name} and "the first, at [1, 0]" in found[name]


def test_an_hf_folder_with_its_own_config_needs_no_hf_config(user_run, tmp_path: Path) -> None:
    """An hf folder holds the config.json its export was given: verify takes it as the model's description
    when the checkpoint has none of its own (it demanded --hf-config); shardstore's export and transformers'
    own save_pretrained of the model both pass, and a dropped tensor is named."""
    src, model = user_run
    model.config.save_pretrained(tmp_path / "config")
    shardstore.unshard(src, tmp_path / "ours", format="hf", hf_config=tmp_path / "config", jobs=1)
    model.save_pretrained(tmp_path / "theirs")
    for out in (tmp_path / "ours", tmp_path / "theirs"):
        result = shardstore.verify(src, out)
        assert result.ok and result.format == "hf" and result.tensors == len(model.state_dict()), result.differences
    tensors = load_file(tmp_path / "theirs" / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "theirs" / "model.safetensors", metadata={"format": "pt"})
    found = shardstore.verify(src, tmp_path / "theirs").differences
    assert [(d.name, d.what) for d in found] == [("model.norm.weight", "missing from the output")]


def test_a_state_dict_of_strided_views_is_compared_in_c_order(user_run, tmp_path: Path) -> None:
    """torch.save keeps a view's strides (a weight held transposed, `w.t().contiguous().t()`): its bytes
    are not one run of the file, and are streamed in blocks of rows in C order; equal passes, a changed
    element is found at its index."""
    src, model = user_run
    state = {k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in model.state_dict().items()}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not state[name].is_contiguous()
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert shardstore.verify(src, tmp_path / "pytorch_model.bin").ok
    state[name][2, 3] += 1
    torch.save(state, tmp_path / "pytorch_model.bin")
    found = {d.name: d.what for d in shardstore.verify(src, tmp_path / "pytorch_model.bin").differences}
    assert found.keys() == {name} and found[name].startswith(f"1 of {state[name].numel()} elements differ; the "
                                                             f"first, at [2, 3]")
