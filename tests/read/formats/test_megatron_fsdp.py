"""Megatron-FSDP's `--ckpt-format fsdp_dtensor` checkpoints, written by megatron-core 0.19.2's own Megatron-FSDP
and Megatron-LM's own save path in gloo processes (tests/fixtures/megatron_fsdp.py; the files are kept in
tests/fixtures/data/megatron/fsdp_dtensor/), against what the live ranks assembled.

The folder is found without flags, and its tensors come out under the names the torch_dist reading gives
Megatron's (fc1 whole: the gate's rows, then the up's; experts `local_experts.{e}` by their global index;
a parameter's Adam state `optimizer.state.{kind}.{name}`), so that the same Hugging Face mapping exports both.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.read.discover import open_source
from tests.refusals import assert_refused, cli

DATA = Path(__file__).parents[2] / "fixtures" / "data" / "megatron" / "fsdp_dtensor"
DENSE, MOE = "fsdp-dp3", "fsdp-dp2-qwen2moe"
ITER = "iter_0000010"


def _want(layout: str) -> dict:
    return torch.load(DATA / f"{layout}.expected.pt.ref", weights_only=True)


def _state(want: dict) -> dict[str, torch.Tensor]:
    """The live optimizer state (`{param}.{kind}`) under the torch_dist reading's names."""
    return {f"optimizer.state.{key.rsplit('.', 1)[1]}.{key.rsplit('.', 1)[0]}": v for key, v in want["optimizer"].items()}


@pytest.mark.parametrize("layout", [DENSE, MOE])
def test_found_without_flags_and_every_output_is_what_the_live_ranks_held(layout: str, tmp_path: Path) -> None:
    """`shardstore unshard RUN OUT` takes the run folder's latest iteration as DCP; safetensors holds the
    model, torch and dcp (read back by torch's own dcp_to_torch_save) the model and the optimizer's state:
    bit for bit what the live ranks assembled before Megatron-LM split fc1 and renumbered the experts."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src, want = DATA / layout, _want(layout)
    assert open_source(src).format == "dcp" and f"/{ITER}/" in open_source(src).units[0]
    assert cli("unshard", src, tmp_path / "st").returncode == 0
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert set(st) == set(want["model"]) and all(torch.equal(st[k], v) for k, v in want["model"].items())
    assert any(".mlp.linear_fc1.weight" in k or "local_experts.3.linear_fc1.weight" in k for k in st)
    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=2)
    shardstore.unshard(src, tmp_path / "dcp", format="dcp", jobs=2)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    state = _state(want)
    for got in (torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=False),
                torch.load(tmp_path / "dcp.pt", weights_only=False)):
        model = {k: v for k, v in got["model"].items() if isinstance(v, torch.Tensor)}
        assert set(model) == set(want["model"]) and all(torch.equal(model[k], v) for k, v in want["model"].items())
        optimizer = {k: v for k, v in got["optimizer"].items() if k in state}
        assert set(optimizer) == set(state) and all(torch.equal(optimizer[k], v) for k, v in state.items())
        assert got["iteration"] == 10 and got["args"].ckpt_format == "fsdp_dtensor"
        layers = [int(k.split(".")[2]) for k in got["model"] if k.startswith("decoder.layers.")]
        assert layers == sorted(layers)  # layer by layer, as the torch_dist reading gives them


@pytest.mark.parametrize("layout, architecture", [(DENSE, "LlamaForCausalLM"), (MOE, "Qwen2MoeForCausalLM")])
def test_hf_export_by_the_torch_dist_mapping_gives_megatrons_own_logits(layout: str, architecture: str,
                                                                         tmp_path: Path) -> None:
    """Described by Megatron-LM's args in the checkpoint, exported by the mapping torch_dist checkpoints
    take: transformers reproduces Megatron's own forward (float32) of the live weights."""
    from transformers import AutoModelForCausalLM

    want = _want(layout)
    shardstore.unshard(DATA / layout, tmp_path / "hf", format="hf", jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    with torch.no_grad():
        got = model(input_ids=want["ids"]).logits
    torch.testing.assert_close(got, want["logits"], rtol=1e-4, atol=1e-4)


def _edit_metadata(folder: Path, change) -> None:
    """Rewrite a copy's .metadata (torch's own pickle of it) through `change`."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    change(metadata)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _without(tmp_path: Path, fixture: str, gone: str) -> Path:
    """A copy of `fixture`'s run whose .metadata has lost the key `gone` (its file's items stay)."""
    run = tmp_path / "run"
    shutil.copytree(DATA / fixture, run)

    def drop(metadata) -> None:
        del metadata.state_dict_metadata[gone]
        for index in [i for i in metadata.storage_data if i.fqn == gone]:
            del metadata.storage_data[index]

    _edit_metadata(run / ITER, drop)
    return run


def _refused(src: Path, out: Path, *needles: str) -> None:
    assert_refused(cli("unshard", src, out, "-q"), *needles)
    assert not (out / "model.safetensors").exists()


def test_a_missing_expert_is_refused_naming_it(tmp_path: Path) -> None:
    """An expert's key gone from the metadata (a lost file of expert rank 1): the args' num_experts say
    which, before a byte is written."""
    run = _without(tmp_path, MOE, "model.module.decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight")
    _refused(run, tmp_path / "out", "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight is missing")


def test_a_gate_half_without_its_up_half_is_refused(tmp_path: Path) -> None:
    run = _without(tmp_path, DENSE, "model.module.decoder.layers.1.mlp.linear_fc1.weight_v")
    _refused(run, tmp_path / "out", "model.module.decoder.layers.1.mlp.linear_fc1.weight_w",
             "without its up half (…_v)")


def test_a_distcp_file_of_another_save_is_refused_naming_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(DATA / DENSE, run)
    shutil.copy(DATA / MOE / ITER / "__1_0.distcp", run / ITER / "__1_0.distcp")
    _refused(run, tmp_path / "out", f"{ITER}/__1_0.distcp")


def test_uneven_chunks_that_do_not_tile_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    """The gate half's second rank's rows one row higher: a row of fc1 twice, the gate's last row nowhere."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    run = tmp_path / "run"
    shutil.copytree(DATA / DENSE, run)
    key = "model.module.decoder.layers.0.mlp.linear_fc1.weight_w"

    def overlap(metadata) -> None:
        chunks = metadata.state_dict_metadata[key].chunks
        last = max(range(len(chunks)), key=lambda c: chunks[c].offsets[0])
        was, moved = chunks[last].offsets, torch.Size([chunks[last].offsets[0] - 1, 0])
        assert was[0] > 0
        chunks[last] = ChunkStorageMetadata(moved, chunks[last].sizes)
        metadata.storage_data = {(MetadataIndex(key, moved) if i.fqn == key and i.offset == was else i): v
                                 for i, v in metadata.storage_data.items()}

    _edit_metadata(run / ITER, overlap)
    _refused(run, tmp_path / "out", "decoder.layers.0.mlp.linear_fc1.weight")


@pytest.mark.parametrize("args, needle", [({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size 2"),
                                          ({"virtual_pipeline_model_parallel_size": 2},
                                           "virtual_pipeline_model_parallel_size 2"),
                                          ({"megatron_fsdp_version": 2}, "megatron_fsdp_version 2"),
                                          ({"num_experts": 8}, "local_experts.4.linear_fc1.weight is missing"),
                                          # Megatron's checkpoint_inspector's conversion of a torch_dist save:
                                          # that run's args, torch_dist's global layer numbers
                                          ({"ckpt_format": "torch_dist", "use_megatron_fsdp": False,
                                            "pipeline_model_parallel_size": 2}, None)])
def test_what_the_args_say_these_names_cannot_place_is_refused_by_the_arguments_name(args: dict,
                                                                                   needle: str | None) -> None:
    """Megatron-FSDP's own save of several pipeline stages (each numbers its layers from 0), of virtual
    pipeline chunks, with Megatron-FSDP v2's optimizer state; experts the args count and the save lacks."""
    from shardstore.read.formats import dcp, megatron_fsdp

    ckpt = dcp.read_checkpoint(DATA / MOE / ITER)
    assert ckpt.megatron_fsdp
    genuine = {"ckpt_format": "fsdp_dtensor", "use_megatron_fsdp": True, "pipeline_model_parallel_size": 1,
               "virtual_pipeline_model_parallel_size": None, "megatron_fsdp_version": 1, "num_experts": 4}
    megatron_fsdp.check_args(genuine, ckpt, "the save")
    if needle is None:
        megatron_fsdp.check_args({**genuine, **args}, ckpt, "the save")
        return
    with pytest.raises(shardstore.CheckpointError, match=needle):
        megatron_fsdp.check_args({**genuine, **args}, ckpt, "the save")


@pytest.mark.parametrize("saved, name, half", [
    ("module.module.decoder.layers.2.mlp.linear_fc1.weight_w", "decoder.layers.2.mlp.linear_fc1.weight", "w"),
    ("module.decoder.layers.2.mlp.linear_fc1.bias_v", "decoder.layers.2.mlp.linear_fc1.bias", "v"),
    # Transformer Engine's grouped experts (TEGroupedMLP), by their global index: SequentialMLP's names
    ("module.decoder.layers.1.mlp.experts.linear_fc1.weight5_w", "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight", "w"),
    ("module.decoder.layers.1.mlp.experts.linear_fc1.bias12_v", "decoder.layers.1.mlp.experts.local_experts.12.linear_fc1.bias", "v"),
    ("module.decoder.layers.1.mlp.experts.linear_fc2.weight7", "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight", None),
    ("module.decoder.layers.1.mlp.shared_experts.linear_fc1.weight_v", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight", "v"),
    ("module.mtp.layers.0.transformer_layer.mlp.linear_fc1.weight_w", "mtp.layers.0.transformer_layer.mlp.linear_fc1.weight", "w"),
    # not SwiGLU's: kept as saved
    ("module.decoder.layers.1.mlp.linear_fc2.weight_w", "decoder.layers.1.mlp.linear_fc2.weight_w", None)])
def test_megatron_fsdp_names_are_the_torch_dist_readings(saved: str, name: str, half: str | None) -> None:
    """Megatron-LM's handle_swiglu_in_state_dict's keys (dense, shared and routed experts' fc1 weight and bias)
    and handle_experts_in_state_dict's (SequentialMLP's and TEGroupedMLP's), wrappers off."""
    from shardstore.read.formats.megatron_fsdp import _megatron_name, unwrapped

    assert _megatron_name(unwrapped(saved)) == (name, half)
