"""DCP's Hugging Face safetensors (torch's HuggingFaceStorageWriter), sharded and consolidated, against
what the writing processes gathered, in every output format."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.errors import CheckpointError
from shardstore.read.discover import open_source
from tests.conftest import assert_bitwise_equal
from tests.export.conformance import MegatronOutputTests
from tests.read.conformance import FormatTests
from tests.read.formats.test_dcp import refused


@pytest.mark.parametrize("form", ["sharded", "consolidated"])
def test_every_format_is_the_gathered_model(form: str, dcp_hf_checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = dcp_hf_checkpoint / form
    want = torch.load(dcp_hf_checkpoint / "expected.pt.ref", weights_only=False)
    assert open_source(src).format == "dcp-hf"
    shardstore.unshard(src, tmp_path / "torch", format="torch", jobs=2)
    assert_bitwise_equal(torch.load(tmp_path / "torch" / "checkpoint.pt", weights_only=True), dict(want["model"]),
                         "torch", ordered=form == "sharded")  # DCP's list keeps the state dict's order
    shardstore.unshard(src, tmp_path / "st", jobs=2)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), dict(want["model"]), "safetensors")
    shardstore.unshard(src, tmp_path / "dcp", format="dcp", jobs=2)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    assert_bitwise_equal(torch.load(tmp_path / "dcp.pt", weights_only=False), dict(want["model"]), "dcp")


def test_hf_export_takes_the_config_beside_the_weights(dcp_hf_checkpoint: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.fixtures.verl import IDS

    shardstore.unshard(dcp_hf_checkpoint / "sharded", tmp_path / "hf", format="hf", jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    assert torch.equal(got, torch.load(dcp_hf_checkpoint / "expected.pt.ref", weights_only=False)["logits"])


def test_a_shard_file_of_another_save_is_refused(dcp_hf_checkpoint: Path, tmp_path: Path) -> None:
    """A file replaced by one of another save: planning again refuses the folder, naming the file, and a
    worker handed it under the old plan refuses it by its header."""
    from shardstore.read.formats import dcp_hf

    src = shutil.copytree(dcp_hf_checkpoint / "sharded", tmp_path / "src")
    swapped = src / "shard-00002-model-00001-of-00001.safetensors"
    store = shardstore.ingest(tmp_path / "s", [src / "shard-00001-model-00001-of-00001.safetensors"], jobs=1)
    shutil.copy(dcp_hf_checkpoint / "consolidated" / "sharded" / "shard-00002-model-00001-of-00002.safetensors", swapped)
    with pytest.raises(CheckpointError, match="shard-00002-model-00001-of-00001.safetensors: "):
        shardstore.ingest(tmp_path / "s", [swapped], jobs=1)
    assert shardstore.open(tmp_path / "s").status().ranks_done == [0]
    with pytest.raises(CheckpointError, match="shard-00002-model-00001-of-00001.safetensors: its header differs"):
        dcp_hf.open_unit(str(swapped), None, False, repr, store.manifest.facts.reader_view())


def test_forged_offsets_are_refused_before_anything_is_written(dcp_hf_checkpoint: Path, tmp_path: Path) -> None:
    """Two files claiming the same rows leave others uncovered: the plan refuses it up front."""
    src = shutil.copytree(dcp_hf_checkpoint / "sharded", tmp_path / "src")
    shutil.copy(src / "shard-00001-model-00001-of-00001.safetensors", src / "shard-00002-model-00001-of-00001.safetensors")
    with pytest.raises(CheckpointError):
        shardstore.unshard(src, tmp_path / "out", jobs=1)
    assert not (tmp_path / "out" / "model.safetensors").exists()


class TestDcpHfConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, dcp_hf_checkpoint) -> Path:
        return dcp_hf_checkpoint / "sharded"

    @pytest.fixture
    def foreign(self, dcp_hf_checkpoint) -> Path:
        return dcp_hf_checkpoint / "consolidated" / "sharded" / "shard-00002-model-00001-of-00002.safetensors"


class TestDcpHfOutputs(MegatronOutputTests):
    @pytest.fixture
    def checkpoint(self, dcp_hf_checkpoint) -> Path:
        return dcp_hf_checkpoint / "sharded"


@pytest.mark.parametrize("same", [True, False])
def test_a_tensor_whole_in_two_files_is_taken_once_only_if_its_bytes_agree(same: bool, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    a, b, c = torch.arange(12.0).reshape(3, 4), torch.arange(6.0), torch.ones(5)
    save_file({"a": a, "b": b}, src / "model-00001-of-00002.safetensors")
    save_file({"b": b if same else b + 1, "c": c}, src / "model-00002-of-00002.safetensors")
    if not same:
        with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: holds b as "
                                                  r"model-00001-of-00002\.safetensors does, with other bytes"):
            shardstore.unshard(src, tmp_path / "out", jobs=1)
        assert not (tmp_path / "out").exists()
        return
    shardstore.unshard(src, tmp_path / "out", jobs=1)
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), {"a": a, "b": b, "c": c})


def test_a_shard_copied_over_another_is_refused_by_the_index_or_the_sharding(dcp_hf_checkpoint: Path,
                                                                              tmp_path: Path) -> None:
    """Copied over another file, a shard's tensors would be taken once and the other's lost: the index names
    each tensor's file, and DCP's sharded files never hold one piece twice."""
    src = shutil.copytree(dcp_hf_checkpoint / "consolidated", tmp_path / "consolidated", ignore=shutil.ignore_patterns("sharded"))
    shutil.copy(src / "model-00001-of-00002.safetensors", src / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: (holds|lacks) .* which "
                                              r"model\.safetensors\.index\.json maps to"):
        shardstore.unshard(src, tmp_path / "out", jobs=1)
    sharded = shutil.copytree(dcp_hf_checkpoint / "sharded", tmp_path / "sharded")
    first, *rest = sorted(sharded.glob("shard-*.safetensors"))
    shutil.copy(first, rest[-1])
    with pytest.raises(CheckpointError, match=rf"{rest[-1].name}: holds the piece of .* that {first.name} holds"):
        shardstore.unshard(sharded, tmp_path / "out", jobs=1)
    assert not (tmp_path / "out").exists()


def _with_header(path: Path, change) -> None:
    """Rewrite a safetensors file's JSON header through `change` (its data, addressed relative to the header's
    end, stays valid)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.parametrize("forgery", ["metadata-object", "metadata-list", "sharding-info-object", "dtype-list"])
def test_a_header_field_of_the_wrong_json_type_is_one_line(forgery: str, dcp_hf_checkpoint: Path, tmp_path: Path) -> None:
    """safetensors' __metadata__ maps strings to strings and a dtype is a string: a header giving an object
    or a list where the format has a string is refused naming the file (it was a TypeError traceback)."""
    src = shutil.copytree(dcp_hf_checkpoint / "sharded", tmp_path / "src")
    victim = src / "shard-00002-model-00001-of-00001.safetensors"

    def change(header: dict) -> None:
        meta = header["__metadata__"]
        if forgery == "metadata-object":
            header["__metadata__"] = {"DCP_SHARDING_INFO": json.loads(meta["DCP_SHARDING_INFO"])}
        elif forgery == "metadata-list":
            header["__metadata__"] = [meta]
        elif forgery == "sharding-info-object":
            meta["format"] = {"pt": True}
        else:
            name = next(k for k in header if k != "__metadata__")
            header[name]["dtype"] = ["F32"]

    _with_header(victim, change)
    refused(src, tmp_path / "out", rf"{victim.name}: (safetensors __metadata__ is not an object of strings|.*unknown "
                                   rf"safetensors dtype)")


@pytest.mark.parametrize("form", ["sharded", "consolidated"])
def test_a_workers_task_is_sent_its_files_part_of_the_manifest(form: str, dcp_hf_checkpoint: Path, tmp_path: Path) -> None:
    """Each worker read the whole manifest (92k arrays for DeepSeek-V3: 250 MB in each): a task now carries
    the entries, and the shapes of the reader's facts, of the tensors its files' headers list, and none of
    the files the export writes back; and the worker ingests from that alone."""
    from safetensors import safe_open

    from shardstore import paths
    from shardstore.ingest import IngestOptions, _task, _worker

    src = dcp_hf_checkpoint / form
    source = open_source(src)
    store = shardstore.ingest(tmp_path / "s", [source.units[0]], jobs=1)
    assert store.manifest.facts.side_files and len(store.manifest.facts.reader["dcp_hf"]["shapes"]) > 1
    batch = [u for u in source.units if u != source.units[0]][:1]
    with safe_open(batch[0], "pt") as f:
        held = {paths.escape(name) for name in f.keys()}
    every = set(store.manifest.arrays) | set(store.manifest.objects)
    assert held <= every and (held < every if form == "consolidated" else held)  # (FSDP's shards: a piece of each)
    task = _task(store, batch, IngestOptions(format="dcp-hf"))
    part = task[-1]
    assert set(part.arrays) | set(part.objects) == held
    assert set(part.facts.reader["dcp_hf"]["shapes"]) == held & set(part.arrays)
    assert part.facts.reader["dcp_hf"]["headers"] == store.manifest.facts.reader["dcp_hf"]["headers"]
    assert part.facts.side_files == {} and part.facts.metadata == store.manifest.facts.metadata
    (done,) = _worker(*task)
    assert done.path == batch[0] and shardstore.open(tmp_path / "s").status().ranks_done == sorted(
        [0, source.units.index(batch[0])])
