"""`--format dcp --names` (export/renamed.py, export/hf/torchtitan.py): a Hugging Face model as a DCP
checkpoint under torchtitan's names is what torchtitan's own `StateDictAdapter.from_hf` makes of it, bit
for bit, and loads into a model sharded by FSDP2 at world sizes 2 and 3; a JSON file of renames does what
it says, and every mistake in it is one line.

The expected state dicts are torchtitan 0.3.0's (tests/fixtures/torchtitan_names.py made them, with the
tiny transformers models beside them; CI only reads them). torchtitan itself loads the output
(tests/fixtures/torchtitan_load.py, out of CI: torchtitan 0.3.0 needs triton to import its distributed
code): run 2026-12-07 on this writer's output of the fixtures, torchtitan's Llama3 and DeepSeek-V3 under
its own FSDP2 wrapping at world sizes 2 and 3 gave transformers' logits within 2.6e-06 and 4.6e-06."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardstore
from shardstore.errors import ExportError
from tests.conftest import Phases, assert_bitwise_equal
from tests.test_cli import error_line

DATA = Path(__file__).parents[1] / "fixtures" / "data" / "torchtitan" / "from-hf-0.3.0"
MODELS = ["llama", "llama-tied", "deepseek-v3"]


def _dcp(folder: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The folder's tensors as torch's reader assembles them, into tensors shaped as `like`'s; its keys and
    their global shapes must be exactly `like`'s (torch's reader fills what it is given, whatever shape the
    .metadata says)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    described = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert {k: tuple(v.size) for k, v in described.items()} == {k: tuple(v.shape) for k, v in like.items()}
    got = {k: torch.full_like(v, 7) for k, v in like.items()}
    dcp.load(got, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return got


@pytest.mark.parametrize("model", MODELS)
def test_the_model_under_torchtitans_names_is_torchtitans_own_from_hf(model: str, tmp_path: Path) -> None:
    """In one pass (nothing exported from a store) and in two steps, the same tensors: torchtitan's."""
    want = load_file(DATA / model / "expected.safetensors")
    phases = Phases()
    shardstore.unshard(DATA / model / "hf", tmp_path / "one", format="dcp", names="torchtitan", jobs=2,
                       progress=phases)
    assert phases.phases == ["ingest"], phases.phases
    assert_bitwise_equal(_dcp(tmp_path / "one", want), want, model)
    shardstore.unshard(DATA / model / "hf", tmp_path / "two", format="dcp", names="torchtitan", jobs=2,
                       store=tmp_path / "store")
    assert_bitwise_equal(_dcp(tmp_path / "two", want), want, model)


def _load_sharded(rank: int, world: int, folder: str, expected: str, port: int) -> None:
    """One rank of a model holding `expected`'s tensors as parameters, each module fully_shard-ed (FSDP2),
    loaded from `folder` by dcp.load at this world size: every gathered tensor is the expected one."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        want = load_file(expected)
        root = torch.nn.Module()
        for key, value in want.items():
            *path, leaf = key.split(".")
            module = root
            for name in path:
                if not hasattr(module, name):
                    module.add_module(name, torch.nn.Module())
                module = getattr(module, name)
            module.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(value)))
        for module in reversed([m for m in root.modules() if m is not root and list(m.parameters(recurse=False))]):
            fully_shard(module)  # (the innermost first: a module's own fully_shard takes what is left below it)
        fully_shard(root)
        state = root.state_dict()
        dcp.load(state, checkpoint_id=folder)
        for key, value in root.state_dict().items():
            got = value.full_tensor()
            assert got.dtype == want[key].dtype and torch.equal(got.view(torch.uint8), want[key].view(torch.uint8)), key
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model", ["llama", "deepseek-v3"])
def test_it_loads_into_an_fsdp2_model_at_world_sizes_2_and_3(model: str, tmp_path: Path) -> None:
    from tests.fixtures.fsdp import spawn_gloo

    shardstore.unshard(DATA / model / "hf", tmp_path / "out", format="dcp", names="torchtitan", jobs=1)
    for world in (2, 3):
        spawn_gloo(_load_sharded, (world, str(tmp_path / "out"), str(DATA / model / "expected.safetensors")), world)


def test_a_multi_token_prediction_layer_is_left_out_and_said(tmp_path: Path) -> None:
    """DeepSeek-V3's release holds a layer past num_hidden_layers (its MTP module), which torchtitan's
    model is built without: left out, said, the rest as torchtitan's adapter makes it."""
    src = tmp_path / "hf"
    src.mkdir()
    for f in (DATA / "deepseek-v3" / "hf").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = shardstore.unshard(src, tmp_path / "out", format="dcp", names="torchtitan", jobs=1)
    assert any("layers [3]" in note and "multi-token prediction" in note for note in result.notes), result.notes
    want = load_file(DATA / "deepseek-v3" / "expected.safetensors")
    assert_bitwise_equal(_dcp(tmp_path / "out", want), want, "deepseek-v3")


def test_a_file_of_renames_renames_and_leaves_out(tmp_path: Path) -> None:
    src = DATA / "llama" / "hf"
    hf = load_file(src / "model.safetensors")
    names = tmp_path / "names.json"
    names.write_text(json.dumps({r"model\.layers\.(\d+)\.(.+)": r"blocks.\1.\2", r"model\.(.+)": r"\1",
                                 r"lm_head\.weight": None}))
    result = shardstore.unshard(src, tmp_path / "out", format="dcp", names=str(names), jobs=1)
    want = {k.replace("model.layers.", "blocks.").removeprefix("model."): v for k, v in hf.items()
            if k != "lm_head.weight"}
    assert_bitwise_equal(_dcp(tmp_path / "out", want), want, "renamed")
    assert ".metadata" in {p.name for p in result.files}


@pytest.mark.parametrize("rules,needle", [
    ({r"model\.(.+)": r"\1"}, "lm_head.weight: --names"),  # a name no regex matches
    ({r".*layers\.\d+\.(.+)": r"\1", r".*": "x"}, "renames it"),  # two names renamed alike
    ({"(": "x"}, "is no regex"),
    ({r"(.+)": r"\2"}, "for "),  # a group the regex does not have
    (["not", "an", "object"], "a JSON object"),
])
def test_every_mistake_in_a_file_of_renames_is_one_line(rules: object, needle: str, tmp_path: Path) -> None:
    names = tmp_path / "names.json"
    names.write_text(json.dumps(rules))
    line = error_line("unshard", DATA / "llama" / "hf", tmp_path / "out", "--format", "dcp", "--names", names)
    assert needle in line, line
    assert not (tmp_path / "out" / ".metadata").exists()


def test_what_torchtitan_has_no_name_for_is_refused_by_name(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    src.mkdir()
    config = json.loads((DATA / "llama" / "hf" / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    (src / "model.safetensors").write_bytes((DATA / "llama" / "hf" / "model.safetensors").read_bytes())
    assert "Qwen2ForCausalLM" in error_line("unshard", src, tmp_path / "a", "--format", "dcp", "--names", "torchtitan")
    (src / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    tensors = load_file(DATA / "llama" / "hf" / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    line = error_line("unshard", src, tmp_path / "b", "--format", "dcp", "--names", "torchtitan")
    assert "model.layers.0.self_attn.q_proj.bias" in line, line
    line = error_line("unshard", src, tmp_path / "c", "--format", "safetensors", "--names", "torchtitan")
    assert "--names goes with --format dcp" in line, line
    with pytest.raises(ExportError, match="no such file|No such file"):
        shardstore.unshard(DATA / "llama" / "hf", tmp_path / "d", format="dcp", names=str(tmp_path / "none.json"))


@pytest.mark.parametrize("model,dropped,needle", [
    ("llama", "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight: not in the files"),
    ("deepseek-v3", "model.layers.2.mlp.experts.3.down_proj.weight", "but n_routed_experts is 4"),
])
def test_a_tensor_the_model_loads_and_the_files_lack_is_named(model: str, dropped: str, needle: str,
                                                              tmp_path: Path) -> None:
    """torchtitan's load would stop at a missing key: refused before anything is written, naming it."""
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_bytes((DATA / model / "hf" / "config.json").read_bytes())
    tensors = load_file(DATA / model / "hf" / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    line = error_line("unshard", src, tmp_path / "out", "--format", "dcp", "--names", "torchtitan")
    assert needle in line, line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("model", ["llama", "deepseek-v3"])
def test_verify_checks_each_chunk_where_the_trainer_keeps_it(model: str, tmp_path: Path) -> None:
    """`verify SRC OUT --format dcp --names torchtitan`: each tensor (an expert of a stacked one, q in its
    rotary order) where the export put it; one element changed in a .distcp file is named with its tensor."""
    from tests.test_cli import run

    src, out = DATA / model / "hf", tmp_path / "out"
    shardstore.unshard(src, out, format="dcp", names="torchtitan", jobs=1)
    result = shardstore.verify(src, out, format="dcp", names="torchtitan")
    want = load_file(DATA / model / "expected.safetensors")
    assert result.ok and result.tensors >= len(want), result.summary()
    victim = "layers.1.moe.routed_experts.inner_experts.w2_EDF" if model == "deepseek-v3" \
        else "layers.0.attention.qkv_linear.wq.weight"
    raw = want[victim][-1].numpy().tobytes()  # the last expert's (q's last row, in torchtitan's order)
    distcp = next(f for f in out.glob("*.distcp") if raw in f.read_bytes())
    data = distcp.read_bytes()
    at = data.find(raw)
    distcp.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
    result = shardstore.verify(src, out, format="dcp", names="torchtitan")
    assert [d.name for d in result.differences] == \
        [f"{victim}[3]" if model == "deepseek-v3" else victim], result.summary()
    proc = run("verify", src, out, "--format", "dcp", "--names", "torchtitan")
    assert proc.returncode == 1 and victim in proc.stdout + proc.stderr, proc.stderr
