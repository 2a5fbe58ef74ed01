"""torch.distributed.checkpoint folders, saved by real gloo processes, unsharded bit-exact against torch's
own `dcp_to_torch_save`: FSDP1, FSDP2 DTensors, hybrid sharding, tensor parallel x FSDP (boxes on two
dimensions), optimizer state, bf16 and non-tensor values."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.read.discover import open_source
from tests.conftest import assert_bitwise_equal
from tests.read.conformance import FormatTests


def _expected(folder: Path) -> dict:
    return torch.load(f"{folder}.expected.pt.ref", weights_only=False)


def _torch_output(out: Path) -> dict:
    """A plain DCP save's --format torch: one checkpoint.pt in its own nesting (not OLMo's three files)."""
    assert not (out / "model.pt").exists()
    return torch.load(out / "checkpoint.pt", weights_only=True)


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2", "hsdp", "tp"])
def test_dcp_unshards_bit_exact_in_both_formats(kind: str, dcp_checkpoints, tmp_path: Path) -> None:
    src = dcp_checkpoints(kind)
    want = _expected(src)
    shardstore.unshard(src, tmp_path / "pt", store=tmp_path / "store", format="torch", jobs=2)
    assert_bitwise_equal(_torch_output(tmp_path / "pt"), want, kind)
    shardstore.export(tmp_path / "store", tmp_path / "st")
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), want["model"], f"{kind} safetensors")
    store = shardstore.open(tmp_path / "store")
    assert store.manifest.facts.format == "dcp" and store.status().ok
    assert store["trainer/config/name"] == kind and store["trainer/step"] == 3


def test_two_dimensional_boxes_read_lazily(dcp_checkpoints, tmp_path: Path) -> None:
    src = dcp_checkpoints("tp")  # RowwiseParallel x FSDP: down.weight [128, 3072] split on both dimensions
    shardstore.ingest(tmp_path / "store", sorted(str(p) for p in src.glob("*.distcp")), jobs=1)
    store = shardstore.open(tmp_path / "store")
    h = store["model/blocks.0.down.weight"]
    want = _expected(src)["model"]["blocks.0.down.weight"]
    assert store.manifest.arrays[h.path].cell == (64, 1536)  # one cell per box: one writer each
    assert_bitwise_equal(h[60:70, 1530:1540], want[60:70, 1530:1540])


def test_olmo_and_composer_folders_are_found(dcp_checkpoints, tmp_path: Path) -> None:
    src = dcp_checkpoints("fsdp1")
    olmo = tmp_path / "step1000"
    shutil.copytree(src, olmo / "model_and_optim")
    shardstore.unshard(olmo, tmp_path / "olmo", jobs=1)
    assert_bitwise_equal(load_file(tmp_path / "olmo" / "model.safetensors"), _expected(src)["model"])
    composer = tmp_path / "composer"
    for batch in (10, 20):
        shutil.copytree(src, composer / f"ep0-ba{batch}")
    os.symlink(composer / "ep0-ba20", composer / "latest-rank0.pt")
    shardstore.unshard(composer, tmp_path / "latest", jobs=1)
    shardstore.unshard(composer, tmp_path / "ba10", step=10, jobs=1)
    assert (tmp_path / "ba10" / "model.safetensors").exists()
    shutil.copytree(src, tmp_path / "two" / "ep0-ba10")
    shutil.copytree(src, tmp_path / "two" / "ep0-ba20")
    assert open_source(tmp_path / "two").units[0].startswith(str(tmp_path / "two" / "ep0-ba20"))  # the newest


def test_partial_ingest_and_ls_names_the_format(dcp_checkpoints, tmp_path: Path) -> None:
    src = dcp_checkpoints("fsdp2")
    files = sorted(str(p) for p in src.glob("*.distcp"))
    shardstore.ingest(tmp_path / "store", files[:2], jobs=1)
    status = shardstore.open(tmp_path / "store").status()
    assert status.ranks_done == [0, 1] and status.ranks_missing == [2, 3] and not status.ok
    ls = subprocess.run([sys.executable, "-m", "shardstore", "ls", tmp_path / "store"], capture_output=True, text=True)
    assert ls.stdout.startswith("format: dcp (4 .distcp files)"), ls.stdout
    shardstore.ingest(tmp_path / "store", files, jobs=1)
    assert shardstore.open(tmp_path / "store").status().ok


def _metadata_with(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint whose .metadata was rewritten by torch's own pickle after `edit(metadata)`."""
    import pickle

    shutil.copytree(src, dst)
    md = pickle.loads((dst / ".metadata").read_bytes())
    edit(md)
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    return dst


def _first_item(md):
    return next(iter(md.storage_data.values()))


def _first_tensor(md):
    return next(m for m in md.state_dict_metadata.values() if getattr(m, "chunks", None))


@pytest.mark.parametrize("edit, needle", [
    (lambda md: setattr(_first_item(md), "relative_path", "../../etc/passwd"), "not a file name inside"),
    (lambda md: setattr(_first_item(md), "transform_descriptors", ["zstd"]), "transforms ['zstd']"),
    (lambda md: setattr(_first_item(md), "length", 10**9), "truncated?"),
    (lambda md: setattr(_first_item(md), "offset", -5), "impossible"),
    # a tensor described smaller than its chunks (a stacked tensor's leading size written as 0)
    (lambda md: setattr(_first_tensor(md), "size", torch.Size([0, *_first_tensor(md).size[1:]])),
     "lies outside its tensor"),
])
def test_forged_metadata_is_refused_in_one_line(edit, needle: str, dcp_checkpoints, tmp_path: Path) -> None:
    src = _metadata_with(dcp_checkpoints("fsdp1"), tmp_path / "ckpt", edit)
    proc = subprocess.run([sys.executable, "-m", "shardstore", "unshard", src, tmp_path / "out", "-j", "1"],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_a_distcp_file_of_another_checkpoint_is_refused(dcp_checkpoints, tmp_path: Path) -> None:
    a, b = dcp_checkpoints("fsdp1"), dcp_checkpoints("fsdp2")
    shardstore.ingest(tmp_path / "store", [str(a / "__0_0.distcp")], jobs=1)
    with pytest.raises(shardstore.ShardstoreError, match="different keys|world size"):
        shardstore.ingest(tmp_path / "store", [str(b / "__1_0.distcp")], jobs=1)
    # the same keys and shapes, another save: its files do not belong with this store's
    other = _metadata_with(a, tmp_path / "other", lambda md: setattr(md.storage_meta, "save_id", "another run"))
    with pytest.raises(shardstore.CheckpointError, match="another DCP checkpoint"):
        shardstore.ingest(tmp_path / "store", [str(other / "__1_0.distcp")], jobs=1)
    assert shardstore.open(tmp_path / "store").status().ranks_done == [0]


def test_dcp_from_s3_into_a_store_on_s3_and_on_dask(s3, dcp_checkpoints, tmp_path: Path) -> None:
    """Ranged reads of the items out of .distcp objects; one Dask task per .distcp file."""
    from tests.conftest import upload

    src = dcp_checkpoints("tp")
    url = upload(src, "s3://dcp-a/step10", pattern="*distcp")
    upload(src, "s3://dcp-a/step10", pattern=".metadata")
    shardstore.unshard(url, tmp_path / "pt", store="s3://dcp-a/store", format="torch", jobs=2)
    assert_bitwise_equal(_torch_output(tmp_path / "pt"), _expected(src), "from S3")
    shardstore.unshard(url, tmp_path / "st", store="s3://dcp-a/store-dask", scheduler="dask", jobs=2)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), _expected(src)["model"], "on Dask")
    assert shardstore.open("s3://dcp-a/store-dask").status().ok


def test_olmo_torch_new_with_its_trainer_state_files(dcp_checkpoints, tmp_path: Path) -> None:
    """OLMo's torch_new checkpointer: model_and_optim/ (DCP) beside train/rank{r}.pt (the trainer state)."""
    from tests.fixtures.fsdp import trainer_state

    src = dcp_checkpoints("fsdp1")
    step = tmp_path / "step1"  # OLMo names it by the global_step its trainer state records
    shutil.copytree(src, step / "model_and_optim")
    (step / "train").mkdir()
    for rank in range(4):
        torch.save(trainer_state(rank, 4), step / "train" / f"rank{rank}.pt")
    shardstore.unshard(step, tmp_path / "pt", store=tmp_path / "store", format="torch", jobs=2)
    want = _expected(src)
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "model.pt", weights_only=True), want["model"], "model.pt")
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "optim.pt", weights_only=True), want["optim"], "optim.pt")
    train = torch.load(tmp_path / "pt" / "train.pt", weights_only=False)
    rank0 = trainer_state(0, 4)
    rng, rank0_rng = train.pop("rng"), rank0.pop("rng")  # train/rank0.pt whole, its RNG states too
    assert train == {**rank0, "trainer": want["trainer"]}  # the DCP's own values, and rank 0's trainer state
    assert rng["python"] == rank0_rng["python"]
    assert_bitwise_equal(rng["cuda"], rank0_rng["cuda"], "rank 0's RNG state")
    store = shardstore.open(tmp_path / "store")
    assert sorted(store.values("rng/cuda")) == [4, 5, 6, 7]  # every rank's, numbered after the 4 .distcp files
    ls = subprocess.run([sys.executable, "-m", "shardstore", "ls", tmp_path / "store"], capture_output=True, text=True)
    assert ls.stdout.startswith("format: dcp (4 .distcp files + 4 trainer-state files)") and "files ingested: 8/8" in ls.stdout


def test_olmo_core_metadata_and_accelerate_folders(dcp_checkpoints, tmp_path: Path, monkeypatch) -> None:
    """OLMo-core's .metadata names its own copy of _StorageInfo (olmo_core is never imported); HF
    accelerate saves DCP in a sub-folder (pytorch_model_fsdp_0/)."""
    import dataclasses
    import pickle
    import types

    src = dcp_checkpoints("fsdp2")
    module = types.ModuleType("olmo_core.distributed.checkpoint.filesystem")

    @dataclasses.dataclass
    class _StorageInfo:  # the same fields as torch's
        relative_path: str
        offset: int
        length: int

    _StorageInfo.__module__ = module.__name__
    _StorageInfo.__qualname__ = "_StorageInfo"
    module._StorageInfo = _StorageInfo
    parts = module.__name__.split(".")
    for i in range(1, len(parts)):  # only to write the pickle as OLMo-core would: its package, as stubs
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    folder = tmp_path / "run" / "pytorch_model_fsdp_0"
    shutil.copytree(src, folder)
    md = pickle.loads((src / ".metadata").read_bytes())
    md.storage_data = {k: _StorageInfo(v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    assert b"olmo_core.distributed.checkpoint.filesystem" in (folder / ".metadata").read_bytes()
    monkeypatch.undo()  # olmo_core is gone again: shardstore must not need it
    shardstore.unshard(tmp_path / "run", tmp_path / "pt", format="torch", jobs=1)
    assert_bitwise_equal(_torch_output(tmp_path / "pt"), _expected(src), "OLMo-core metadata")


MEGATRON = Path(__file__).parents[2] / "fixtures" / "data" / "megatron"


def refused(src: Path, out: Path, needle: str, up_front: bool = True) -> str:
    """`unshard` of `src` refuses in one line matching `needle` and leaves nothing at `out`. `up_front`: the
    dry run (plan=True) refuses with the same line, as the real run does before reading a unit; else the
    refusal is one only reading a unit can make, and the dry run passes."""
    if not up_front:
        shardstore.unshard(src, out, format="torch", jobs=1, plan=True)
    lines = []
    for plan in (True, False) if up_front else (False,):
        with pytest.raises(shardstore.CheckpointError, match=needle) as exc:
            shardstore.unshard(src, out, format="torch", jobs=1, plan=plan)
        lines.append(str(exc.value))
    assert len(set(lines)) == 1 and "\n" not in lines[0], lines
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("save, emptied", [("core0.19.2/tp2-pp1/iter_0000010", False),
                                           ("core0.16.1/tp2-pp1/iter_0000010", False),
                                           ("core0.19.2/tp2-pp1-nemo/weights", False),
                                           ("core0.19.2/tp2-pp1/iter_0000010", True)])
def test_a_megatron_folder_without_its_metadata_json_is_refused_naming_it(save: str, emptied: bool,
                                                                          tmp_path: Path) -> None:
    """Content, not file names, decides: a genuine torch_dist save whose metadata.json was lost (or emptied)
    holds Megatron's keys in its .metadata; read as a plain DCP folder it would export Megatron's stacked
    names (9 tensors for the per-layer 15) and leave its common.pt out. Megatron itself refuses it; so does
    this."""
    src = shutil.copytree(MEGATRON / save, tmp_path / "src")
    (src / "metadata.json").unlink()
    if emptied:
        (src / "metadata.json").write_text("{}")
    what = "does not name its sharded_backend torch_dist" if emptied else "is missing"
    refused(src, tmp_path / "out", rf"src/\.metadata: holds Megatron-Core's torch_dist keys "
                                   rf"\('.*_extra_state/shard_0_2'\), but metadata\.json {what}")


def test_a_refused_global_in_megatrons_local_plans_is_still_refused(tmp_path: Path) -> None:
    """The local plans megatron-core keeps in .metadata are built as placeholders (nothing reads them), but
    every global in them still goes through the allowlist: one that runs code is refused, naming the file."""
    class Runs:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return os.system, ("true",)

    src = _metadata_with(MEGATRON / "core0.19.2/tp2-pp1/iter_0000010", tmp_path / "src",
                         lambda md: md.all_local_plans[1].items.append(Runs()))
    refused(src, tmp_path / "out", r"src/\.metadata: refusing to load global posix\.system .*nothing was run")


class TestDcpConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, dcp_checkpoints) -> Path:
        return dcp_checkpoints("tp")  # boxes on both dimensions

    @pytest.fixture
    def foreign(self, dcp_checkpoints) -> Path:
        return dcp_checkpoints("fsdp2") / "__1_0.distcp"


def _leaves(unit) -> dict:
    """A unit's leaves as plain data: each array's pieces (offsets, sizes, and where their bytes lie)."""
    from shardstore.read.contract import ArrayLeaf

    return {path: (leaf.dtype, leaf.shape, sorted((p.offsets, p.sizes, p.tensor.offset) for p in leaf.pieces))
            if isinstance(leaf, ArrayLeaf) else repr(leaf) for path, leaf in unit.leaves.items()}


def test_a_worker_reads_its_file_from_its_share_without_the_metadata(dcp_checkpoints, tmp_path: Path) -> None:
    """A worker is sent its file's share of the .metadata (`unit_share`), and reads nothing else of it: the
    same file beside a .metadata that no longer parses opens from its share exactly as from the whole
    parse, and fails without it."""
    from shardstore.read.formats.dcp import FORMAT, open_unit

    src = shutil.copytree(dcp_checkpoints("hsdp"), tmp_path / "whole")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in src.glob("*.distcp"):
        shutil.copy(f, bare / f.name)
    (bare / ".metadata").write_bytes(b"not a pickle")
    for f in sorted(src.glob("*.distcp")):
        share = FORMAT.unit_share(str(f), None, {})
        assert share is not None and {i.file for i in share.ckpt.items} == {f.name}
        whole, shared = open_unit(f), open_unit(bare / f.name, share=share)
        try:
            assert (shared.rank, shared.world_size, shared.digest) == (whole.rank, whole.world_size, whole.digest)
            assert _leaves(shared) == _leaves(whole) and shared.leaves
        finally:
            whole.close()
            shared.close()
        with pytest.raises(shardstore.CheckpointError, match="metadata"):
            open_unit(bare / f.name)


def test_a_folder_saved_again_is_read_as_it_is_now_by_a_process_that_read_it_before(tmp_path: Path) -> None:
    """A process that plans one checkpoint after another (`follow`, a notebook) cuts each unit's share from
    the parse it planned with: a folder saved again in place, with other tensors, is not read from the
    parse of its first save; and the process keeps a bounded number of parses."""
    import torch.distributed.checkpoint as dcp

    from shardstore.read.primitives import container

    folder = tmp_path / "ckpt"
    saves = [{"w": torch.arange(12.0).reshape(4, 3)}, {"w": torch.ones(2, 5), "b": torch.full((7,), 2.0)}]
    for i, state in enumerate(saves):
        shutil.rmtree(folder, ignore_errors=True)
        dcp.save(state, checkpoint_id=folder, no_dist=True)
        shardstore.unshard(folder, tmp_path / f"out{i}", jobs=2)
        assert_bitwise_equal(load_file(tmp_path / f"out{i}" / "model.safetensors"), state, f"save {i}")
    for i in range(container.PARSED_KEPT + 2):
        container.parsed_once("dcp", str(tmp_path / f"other{i}"), None, lambda folder, options: folder)
    assert len(container._PARSED) == container.PARSED_KEPT
    assert container.parsed_once("dcp", str(tmp_path / "other5"), None, lambda f, o: "parsed again") == str(
        tmp_path / "other5")  # the newest are kept
