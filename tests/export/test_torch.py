"""`--format torch` on a checkpoint exactly as OLMo's trainer leaves it: model and optimizer bit-exact,
and the trainer state (paths, TorchVersion, the trainer's own objects) given back as it was."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.ranges import blocks
from tests.conftest import assert_bitwise_equal, expected, exported
from tests.fixtures.fsdp import trainer_state
from tests.test_cli import assert_one_line_error, run

TRAINER_MODULE = "tests.fixtures.olmo_data"


def test_trainer_state_round_trips_while_its_module_is_unimportable(checkpoints, tmp_path: Path, monkeypatch) -> None:
    src = checkpoints(3)
    want = expected(src)
    monkeypatch.delitem(sys.modules, TRAINER_MODULE, raising=False)
    monkeypatch.setitem(sys.modules, TRAINER_MODULE, None)  # an import of the trainer's module would fail here
    shardstore.unshard(src, tmp_path / "pt", store=tmp_path / "store", format="torch", jobs=1)
    store = shardstore.open(tmp_path / "store")
    record = store["data_checkpoint"]
    assert isinstance(record, shardstore.Opaque) and record.name == "MixtureCheckpoint"
    assert record.state["world_size"] == 3 and torch.equal(record.state["weights"], torch.tensor([0.7, 0.3], dtype=torch.float64))
    assert store["checkpoints"] == [Path("/scratch/run/step50"), Path("/scratch/run/step100")]
    assert isinstance(store["torch_version"], torch.torch_version.TorchVersion)
    cuda = store.values("rng/cuda")  # per-rank uint8 RNG states: every rank's is kept
    assert sorted(cuda) == [0, 1, 2] and all(cuda[r].dtype == torch.uint8 for r in cuda)
    assert_bitwise_equal(cuda[2], torch.Generator().manual_seed(102).get_state(), "rank 2's RNG state")
    monkeypatch.undo()

    # The model and optimizer files hold only tensors and plain containers: torch's safe loader reads them.
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "model.pt", weights_only=True), want["model"], "model.pt")
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "optim.pt", weights_only=True), want["optim"], "optim.pt")
    # train.pt gives the trainer its objects back, where its modules exist, as OLMo's unsharder does.
    train = torch.load(tmp_path / "pt" / "train.pt", weights_only=False)
    rank0 = trainer_state(0, 3)
    del rank0["rng"]  # OLMo's unsharder leaves the per-rank RNG states out of train.pt
    assert list(train) == list(rank0)
    from tests.fixtures.olmo_data import MixtureCheckpoint

    assert type(train["data_checkpoint"]) is MixtureCheckpoint and train == rank0
    assert type(train["checkpoints"][0]) is type(Path("/")) and type(train["torch_version"]) is torch.torch_version.TorchVersion


def test_safetensors_export_is_unaffected_and_strict_refuses_the_paths(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    proc = run("unshard", src, tmp_path / "st", "-q")
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), expected(src)["model"])
    assert_one_line_error(run("unshard", src, tmp_path / "strict", "--strict"), "rank0.pt",
                          "refusing to load global pathlib.PosixPath", "strict")


def test_the_runs_config_is_copied_beside_every_export(checkpoints, tmp_path: Path) -> None:
    """OLMo's unsharder copies config.yaml beside model.pt; the Hugging Face converters read it there."""
    import shutil

    src = tmp_path / "step10"
    shutil.copytree(checkpoints(2), src, ignore=shutil.ignore_patterns("expected.pt.ref"))
    config = b"run_name: legacy\nsharded_checkpointer: torch_legacy\nmodel:\n  d_model: 300\n"
    (src / "config.yaml").write_bytes(config)
    shardstore.unshard(src, tmp_path / "pt", store=tmp_path / "store", format="torch", jobs=1)
    assert (tmp_path / "pt" / "config.yaml").read_bytes() == config
    (src / "config.yaml").unlink()  # the store kept it: exports need not find the checkpoint again
    shardstore.export(tmp_path / "store", tmp_path / "st")
    assert (tmp_path / "st" / "config.yaml").read_bytes() == config
    assert exported(tmp_path / "st") == ["config.yaml", "model.safetensors"]


def test_tensor_crcs_come_from_the_rank_files_and_check_out(checkpoints, tmp_path: Path) -> None:
    """Where every cell of a tensor is one rank's whole storage record, the export combines the CRC-32s
    the rank files store instead of reading the bytes; every entry of the output still checks out."""
    import zipfile
    import zlib

    src = checkpoints(3)
    shardstore.unshard(src, tmp_path / "pt", store=tmp_path / "store", format="torch", jobs=1)
    store = shardstore.open(tmp_path / "store")
    combined = {p: store.stored_crc(p) for p in store.manifest.arrays}
    cells = [p for p, e in store.manifest.arrays.items() if not e.staged]  # small tensors are staged: no CRC
    assert len(cells) == 3 and all(combined[p] is not None for p in cells)
    for path, crc in combined.items():
        if crc is not None:
            assert crc == zlib.crc32(b"".join(bytes(b) for b in blocks(store.stream(path)))), path
    for name in ("model.pt", "optim.pt", "train.pt"):
        with zipfile.ZipFile(tmp_path / "pt" / name) as z:
            assert z.testzip() is None, name  # every member's bytes match the CRC-32 written for it
    want = expected(src)
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "model.pt", weights_only=True), want["model"], "model.pt")
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "optim.pt", weights_only=True), want["optim"], "optim.pt")


def _pickles(folder: Path) -> dict[str, bytes]:
    """Every record of every torch file in `folder` but torch's random serialization id, by name."""
    import zipfile

    out = {}
    for path in sorted(folder.glob("*.pt")):
        with zipfile.ZipFile(path) as z:
            out.update({f"{path.name}:{n.split('/', 1)[1]}": z.read(n) for n in z.namelist()
                        if not n.endswith("serialization_id")})
    return out


def test_the_torch_files_do_not_depend_on_how_the_rank_files_were_read(tmp_path: Path, monkeypatch) -> None:
    """Skimmed by the C extension or unpickled whole, by workers or in this process: the same bytes."""
    from shardstore.read.primitives import skim

    src = Path(__file__).parents[1] / "corpus" / "data" / "olmo-legacy-t2.1-bf16mixed-w3"
    shardstore.unshard(src, tmp_path / "skimmed", format="torch", jobs=1)
    shardstore.unshard(src, tmp_path / "workers", format="torch", jobs=2)
    monkeypatch.setattr(skim, "_skim_c", None)
    shardstore.unshard(src, tmp_path / "whole", format="torch", jobs=1)
    skimmed = _pickles(tmp_path / "skimmed")
    assert skimmed and _pickles(tmp_path / "whole") == skimmed == _pickles(tmp_path / "workers")


def _without_serialization_ids(data: bytes) -> bytes:
    """A file of torch zips (a .distcp file holds one per item) with every zip's random serialization id
    record, and the CRC-32s of it, blanked: all that two saves of the same state may differ in."""
    import re
    import struct

    out = bytearray(data)
    for m in re.finditer(rb"PK\x03\x04", data):
        at = m.start()
        n, extra = struct.unpack_from("<HH", data, at + 26)
        if data[at + 30:at + 30 + n].endswith(b"serialization_id"):
            size = struct.unpack_from("<I", data, at + 18)[0]
            out[at + 14:at + 18] = bytes(4)
            out[at + 30 + n + extra:at + 30 + n + extra + size] = bytes(size)
    for m in re.finditer(rb"PK\x01\x02", data):
        at = m.start()
        n = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + n].endswith(b"serialization_id"):
            out[at + 16:at + 20] = bytes(4)
    return bytes(out)


@pytest.mark.parametrize("fmt", ["torch", "dcp", "hf"])
def test_a_resumed_export_is_the_clean_ones_bytes(fmt: str, tmp_path: Path) -> None:
    """Killed once its first units were in, and run again: the files a clean run writes, pickles included
    (the rerun reads the killed run's records back from disk, where a clean run kept its own in memory)."""
    from tests.conftest import sigkill_mid_way

    src = Path(__file__).parents[1] / "fixtures" / "data" / "deepspeed" / "z3-w3"
    shardstore.unshard(src, tmp_path / "clean", format=fmt, jobs=1)
    out = tmp_path / "resumed"
    cmd = [sys.executable, "-m", "shardstore", "unshard", str(src), str(out), "--format", fmt, "-q", "-j", "1"]
    sigkill_mid_way(cmd, shardstore.scratch_location(out), 6, 2, reset=out)
    shardstore.unshard(src, out, format=fmt, jobs=1)
    if fmt == "torch":
        clean = _pickles(tmp_path / "clean")
        assert clean and _pickles(out) == clean
        return
    names = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        a, b = (tmp_path / "clean" / name).read_bytes(), (out / name).read_bytes()
        assert _without_serialization_ids(a) == _without_serialization_ids(b), name


@pytest.mark.parametrize("kind", ["fsdp1", "tp"])
def test_a_plain_dcp_save_is_what_dcp_to_torch_save_writes(kind: str, dcp_checkpoints, tmp_path: Path) -> None:
    """A user's `dcp.save` of `model`, `optim` and their own `trainer` values: --format torch writes one
    checkpoint.pt in the input's nesting (it wrote OLMo's model.pt, optim.pt and an empty-looking
    train.pt), in one pass and in two steps, and --single-file the same: torch's own `dcp_to_torch_save`
    of the folder (the fixture's .expected.pt.ref), bit for bit. `verify` reads either."""
    src = dcp_checkpoints(kind)
    want = torch.load(f"{src}.expected.pt.ref", weights_only=False)
    assert {"model", "optim"} <= set(want)
    shardstore.unshard(src, tmp_path / "plain", format="torch", jobs=1)
    assert exported(tmp_path / "plain") == ["checkpoint.pt"]
    assert_bitwise_equal(torch.load(tmp_path / "plain" / "checkpoint.pt", weights_only=False), want, ordered=True)
    proc = run("unshard", src, tmp_path / "one", "--format", "torch", "--single-file", "-q")
    assert proc.returncode == 0, proc.stderr
    assert exported(tmp_path / "one") == ["checkpoint.pt"]
    assert_bitwise_equal(torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False), want)
    shardstore.ingest(tmp_path / "store", src, jobs=1)
    shardstore.export(tmp_path / "store", tmp_path / "two", format="torch")
    assert_bitwise_equal(torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=False), want, ordered=True)
    shutil.copy(f"{src}.expected.pt.ref", tmp_path / "theirs.pt")
    for output in (tmp_path / "one", tmp_path / "theirs.pt", tmp_path / "plain"):
        result = shardstore.verify(src, output)
        assert result.ok and result.tensors > 10, (output, result.differences[:3])


def test_single_file_is_for_the_torch_format_only(tmp_path: Path) -> None:
    assert_one_line_error(run("unshard", tmp_path, tmp_path / "out", "--single-file"),
                          "--single-file applies to --format torch only")
