"""The output side's conformance suite (in the spirit of read/conformance.py's `FormatTests`): every input
format's tests may subclass `OutputTests`, providing

    checkpoint  a folder holding one checkpoint, as its trainer wrote it;

and so show, for every output format of the registry (export/registry.py), what shardstore promises of
an export: the one-pass output (`unshard`, the ingest writing straight into the files) is the two-step
output (`ingest`, then `export` from the store) byte for byte; an earlier export of another format in OUT
is refused before anything is read, and replaced with `overwrite`; an export of an incomplete store says
so in the output.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import zipfile
from pathlib import Path

import pytest

import shardstore
from shardstore.export.registry import FORMATS
from shardstore.read.discover import open_source

# the formats every checkpoint's model goes out in; `--format megatron` and `--format nemo` take a model of
# the Llama family only (MegatronOutputTests)
LLAMA_ONLY = ["megatron", "nemo"]
ANY_MODEL = [f for f in FORMATS if f not in LLAMA_ONLY]
# torch.save writes a random id into every file; everything else must be equal
RANDOM = (".data/serialization_id",)
TORCH_FILES = (".pt", ".bin", ".ckpt", ".pth")


def _contents(folder: Path) -> dict[str, str]:
    """Every file of an export by name and a digest of its bytes; a torch zip by its records (less
    torch.save's random id); a DCP folder (the export, or a folder in it: Megatron's release/) by its items
    (their keys, chunks and bytes: the two paths may order the items in the files differently, and
    `.metadata` says where each is)."""
    from torch.distributed.checkpoint import FileSystemReader

    out = {}
    dcps = {p.parent for p in folder.rglob(".metadata") if p.is_file()}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and ".shardstore-scratch" not in p.parts):
        name = str(path.relative_to(folder))
        if path.parent in dcps and (path.name == ".metadata" or path.name.endswith(".distcp")):
            continue
        if path.suffix in TORCH_FILES and zipfile.is_zipfile(path):
            out.update({f"{name}:{record}": digest for record, digest in _records(path.read_bytes()).items()})
        else:
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    for dcp in sorted(dcps):
        at = str(dcp.relative_to(folder))
        md = FileSystemReader(str(dcp)).read_metadata()
        out[f"{at}/.metadata:state_dict_metadata"] = repr(sorted(md.state_dict_metadata.items()))
        out[f"{at}/.metadata:planner_data"] = repr(sorted((md.planner_data or {}).items()))
        for index, info in md.storage_data.items():
            with open(dcp / info.relative_path, "rb") as f:
                f.seek(info.offset)
                out[f"{at}/item:{index.fqn}:{list(index.offset or ())}"] = repr(sorted(_records(f.read(info.length)).items()))
    return out


def _records(data: bytes) -> dict[str, str]:
    """A torch.save zip's records (named without the archive's folder) and their digests, but its random id."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {info.filename.split("/", 1)[-1]: hashlib.sha256(zf.read(info)).hexdigest()
                for info in zf.infolist() if not info.filename.endswith(RANDOM)}


class OutputTests:
    # the transformers config of the checkpoint's model, for outputs that describe it, where the checkpoint
    # carries no description of its own (None: it does)
    hf_config: dict | None = None

    @pytest.fixture
    def checkpoint(self) -> Path:
        raise NotImplementedError

    def _options(self, format: str, tmp_path: Path) -> dict[str, object]:
        if not FORMATS[format].describes_model or self.hf_config is None:
            return {}
        from transformers import LlamaConfig

        LlamaConfig(**self.hf_config).save_pretrained(tmp_path / "config")
        return {"hf_config": tmp_path / "config" / "config.json"}

    @pytest.mark.parametrize("format", ANY_MODEL)
    def test_one_pass_is_two_steps_byte_for_byte(self, format: str, checkpoint: Path, tmp_path: Path) -> None:
        one_pass_is_two_steps(format, checkpoint, tmp_path, self._options(format, tmp_path))

    @pytest.mark.parametrize("format", ANY_MODEL)
    def test_an_earlier_export_of_another_format_is_refused_then_replaced(self, format: str, checkpoint: Path,
                                                                          tmp_path: Path) -> None:
        earlier_export_is_refused_then_replaced(format, checkpoint, tmp_path, self._options(format, tmp_path))


class MegatronOutputTests(OutputTests):
    """For checkpoints of a model `--format megatron` and `--format nemo` write (a Llama-family transformers
    model): their outputs keep the same promises."""

    @pytest.mark.parametrize("format", LLAMA_ONLY)
    def test_megatron_one_pass_is_two_steps_byte_for_byte(self, format: str, checkpoint: Path, tmp_path: Path) -> None:
        one_pass_is_two_steps(format, checkpoint, tmp_path, self._options(format, tmp_path))

    @pytest.mark.parametrize("format", LLAMA_ONLY)
    def test_an_earlier_export_is_refused_then_replaced_by_megatron(self, format: str, checkpoint: Path,
                                                                    tmp_path: Path) -> None:
        earlier_export_is_refused_then_replaced(format, checkpoint, tmp_path, self._options(format, tmp_path))


def one_pass_is_two_steps(format: str, checkpoint: Path, tmp_path: Path, options: dict[str, object]) -> None:
    shardstore.unshard(checkpoint, tmp_path / "one", format=format, jobs=1, **options)
    store = shardstore.ingest(tmp_path / "store", open_source(checkpoint), jobs=1)
    shardstore.export(store, tmp_path / "two", format=format, **options)  # type: ignore[arg-type]
    one, two = _contents(tmp_path / "one"), _contents(tmp_path / "two")
    assert one and one == two


def earlier_export_is_refused_then_replaced(format: str, checkpoint: Path, tmp_path: Path,
                                            options: dict[str, object]) -> None:
    other = "torch" if format != "torch" else "safetensors"  # files the other format never writes
    out = tmp_path / "out"
    shardstore.unshard(checkpoint, out, format=other, jobs=1)
    before = _contents(out)
    with pytest.raises(shardstore.ExportError, match="earlier export"):
        shardstore.unshard(checkpoint, out, format=format, jobs=1, **options)
    assert _contents(out) == before  # refused before anything was written
    shardstore.unshard(checkpoint, out, format=format, jobs=1, overwrite=True, **options)
    shardstore.unshard(checkpoint, tmp_path / "alone", format=format, jobs=1, **options)
    assert _contents(out) == _contents(tmp_path / "alone")  # the earlier files gone, and only those


class PartialOutputTests:
    """For checkpoints whose last unit holds no value that another unit does not hold too (per-rank files
    repeat their values), so that only tensors have holes when it is missing (a value cannot be a hole)."""

    @pytest.fixture
    def checkpoint(self) -> Path:
        raise NotImplementedError

    @pytest.mark.parametrize("format", [f for f in FORMATS if not FORMATS[f].subtree])
    def test_an_incomplete_store_is_refused_or_said_partial(self, format: str, checkpoint: Path, tmp_path: Path) -> None:
        """Every unit but the last: refused, naming the store; with allow_partial, written, and the output
        says which units were missing (outputs of the whole store: a subtree may not need the last unit)."""
        source = open_source(checkpoint)
        store = shardstore.ingest(tmp_path / "store", source.units[:-1], jobs=1)
        with pytest.raises(shardstore.StoreError, match="incomplete store"):
            shardstore.export(store, tmp_path / "refused", format=format)
        result = shardstore.export(store, tmp_path / "out", format=format, allow_partial=True)
        assert result.partial is not None and result.partial["shardstore_partial"] == "true"
        said = [p for p in (tmp_path / "out").rglob("*") if p.is_file() and b"shardstore_partial" in p.read_bytes()]
        assert said, "no output file says the export is partial"
        shutil.rmtree(tmp_path / "out")
