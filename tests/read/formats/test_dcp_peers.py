"""torch's own DCP test configurations (torch/testing/_internal/distributed/checkpoint_utils.py and
test/distributed/checkpoint/: ZStandard streams, empty saves, flatten_state_dict=False, every dtype, 0-d,
expanded and transposed tensors, tensors in lists and tuples, DTensor placements, HF storage), each saved
with torch's own writer in the test and read back by torch's own reader, compared with shardstore's
exports bit for bit."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardstore
from tests.conftest import assert_bitwise_equal
from tests.read.formats.test_dcp import refused


def _save(state: dict[str, Any], folder: Path, **writer: Any) -> Path:
    dcp.save(state, storage_writer=FileSystemWriter(folder, **writer))
    return folder


def _torch_reads(folder: Path) -> dict[str, Any]:
    """What torch's own reader makes of the folder: dcp_to_torch_save's one file (beside the folder)."""
    dcp_to_torch_save(folder, f"{folder}.torch-reads.pt")
    return torch.load(f"{folder}.torch-reads.pt", weights_only=False)


def _exported(folder: Path, tmp_path: Path, fmt: str = "torch") -> dict[str, Any]:
    """shardstore's export of the folder, read back: --format torch's checkpoint.pt, or --format dcp's folder
    through torch's own reader."""
    out = tmp_path / f"out-{fmt}"
    shardstore.unshard(folder, out, format=fmt, jobs=1)
    if fmt == "dcp":
        return _torch_reads(out)
    return torch.load(out / "checkpoint.pt", weights_only=False)


def _mixed_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=gen), "zeros": torch.zeros(4096),
                      "ids": torch.arange(10), "half": torch.randn(3, 5, generator=gen).to(torch.bfloat16)},
            "step": 3, "extra": {"lr": 0.1, "count": torch.tensor(5.0), "names": ["a", "b"]}}


# ------------------------------------------------------------------------------------------ ZStandard


def _zstd_checkpoint(tmp_path: Path) -> Path:
    from torch.distributed.checkpoint._extension import ZStandard

    return _save(_mixed_state(), tmp_path / "zstd", _extensions=[ZStandard()])


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_zstandard_items_read_as_torch_reads_them(fmt: str, tmp_path: Path) -> None:
    src = _zstd_checkpoint(tmp_path)
    md = pickle.loads((src / ".metadata").read_bytes())
    assert all(info.transform_descriptors == ["stream.zstd/1"] for info in md.storage_data.values())
    assert_bitwise_equal(_exported(src, tmp_path, fmt), _torch_reads(src), fmt)


def _rewritten(src: Path, edit) -> Path:
    """The checkpoint with its .metadata rewritten by torch's own pickle after `edit(metadata, folder)`."""
    md = pickle.loads((src / ".metadata").read_bytes())
    edit(md, src)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    return src


def _item(md: Any, fqn: str) -> Any:
    return next(info for index, info in md.storage_data.items() if index.fqn == fqn)


def _bomb(md: Any, folder: Path) -> None:
    """model.ids' item pointed at a small zstd stream of 64 MiB of zeros appended to its file."""
    info = _item(md, "model.ids")
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    with open(folder / info.relative_path, "ab") as f:
        info.offset = f.tell()
        f.write(bomb)
    info.length = len(bomb)


@pytest.mark.parametrize("edit, needle, up_front", [
    (lambda md, _: setattr(_item(md, "model.w"), "length", _item(md, "model.w").length // 2),
     r"__0_0\.distcp: model\.w at \[0, 0\] \(decompressed\): not a torch checkpoint or truncated", False),
    (lambda md, _: setattr(_item(md, "model.w"), "transform_descriptors", ["stream.zstd/2"]),
     r"\.metadata: model\.w: stored through transforms \['stream\.zstd/2'\], which torch's own reader does not read",
     True),
    (lambda md, _: setattr(_item(md, "model.w"), "transform_descriptors", "stream.zstd/1"),
     r"\.metadata: model\.w: transform descriptors 'stream\.zstd/1' are not a list of names", True),
    (lambda md, _: setattr(_item(md, "model.w"), "offset", _item(md, "model.w").offset + 1),
     r"__0_0\.distcp: model\.w at \[0, 0\]: not the ZStandard stream its metadata says", False),
    (_bomb, r"__0_0\.distcp: model\.ids at \[0\]: decompresses to more than the 1048656 bytes", False),
])
def test_a_forged_or_cut_zstandard_item_is_one_line(edit, needle: str, up_front: bool, tmp_path: Path) -> None:
    refused(_rewritten(_zstd_checkpoint(tmp_path), edit), tmp_path / "out", needle, up_front)


def test_a_truncated_zstandard_file_is_refused_by_its_items_ends(tmp_path: Path) -> None:
    src = _zstd_checkpoint(tmp_path)
    distcp = src / "__0_0.distcp"
    distcp.write_bytes(distcp.read_bytes()[:-10])
    refused(src, tmp_path / "out", r"__0_0\.distcp.*truncated")


def test_without_zstandard_the_refusal_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    from shardstore.read.primitives import transforms

    src = _zstd_checkpoint(tmp_path)
    monkeypatch.setattr(transforms, "_zstandard", lambda: None)
    refused(src, tmp_path / "out", r"\.metadata: [a-z.]+: stored through ZStandard \(stream\.zstd/1\); reading it "
                                   r"needs the zstandard module: pip install 'shardstore\[zstd\]'")


# ------------------------------------------------------------------------------------------ empty saves
class _Nothing:
    """A Stateful whose state is empty (torch's tests save such an app state)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state == {}


@pytest.mark.parametrize("case", ["empty", "stateful", "empty-module", "metadata-only"])
@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_an_empty_save_exports_what_torch_loads(case: str, fmt: str, tmp_path: Path) -> None:
    """torch loads a save of nothing as {} (a nested empty dict is dropped as it flattens the state); so do
    the exports. A copy with its empty .distcp file gone, as --format dcp writes one, torch loads the same."""
    state = {"empty": {}, "stateful": {"app": _Nothing()}, "empty-module": {"model": {}, "step": 7},
             "metadata-only": {}}[case]
    src = _save(state, tmp_path / "src")
    if case == "metadata-only":
        for distcp in src.glob("*.distcp"):
            distcp.unlink()
    want = _torch_reads(src)
    assert want == ({"step": 7} if case == "empty-module" else {})
    assert_bitwise_equal(_exported(src, tmp_path, fmt), want, case)


@pytest.mark.parametrize("case", ["empty", "metadata-only"])
def test_watch_takes_an_empty_save_whole(case: str, tmp_path: Path) -> None:
    """watch counts a .distcp file once it reaches its last item's end: an empty save's have none (it was a
    KeyError traceback)."""
    src = _save({}, tmp_path / "src")
    if case == "metadata-only":
        (src / "__0_0.distcp").unlink()
    store = shardstore.watch(tmp_path / "store", src, timeout=60, jobs=1)
    assert store.status().ok
    shardstore.export(store, tmp_path / "out", format="torch")
    assert torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True) == {}


# ------------------------------------------------------------------------------------------ torch's test states
DTYPES = [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
          torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu]


def _of(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A (3, 5) tensor of `dtype`: a float8's every bit pattern is as likely (NaNs too), the rest from bytes."""
    raw = torch.randint(0, 256, (3, 5), generator=gen, dtype=torch.uint8)
    return raw.view(dtype) if dtype.itemsize == 1 and dtype.is_floating_point else raw.to(dtype)


def _torch_test_state(case: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    if case == "dtypes":
        return {"model": {str(dtype).removeprefix("torch."): _of(dtype, gen) for dtype in DTYPES}}
    if case == "shapes":  # 0-d, expanded (stride 0), transposed and sliced (not contiguous), without elements
        return {"model": {"scalar": torch.tensor(3.5), "count": torch.tensor(7), "expanded": torch.ones(4).expand(3, 4),
                          "transposed": rand(4, 6).t(), "sliced": rand(8, 8)[2:5, 1:7], "empty": torch.empty(0, 3)}}
    if case == "containers":  # lists and tuples of tensors and values, nested
        return {"list": [rand(3), rand(2, 2), 5, "x"], "tuple": (rand(3), rand(4)),
                "nested": {"a": [{"b": rand(2)}, (rand(1),)]}}
    return {"model": {"w": rand(4, 4), "sub": {"b": rand(2)}}, "step": 3, "t": rand(5)}  # "unflattened"


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
@pytest.mark.parametrize("case", ["dtypes", "shapes", "containers", "unflattened"])
def test_torch_test_states_read_as_torch_reads_them(case: str, fmt: str, tmp_path: Path) -> None:
    """`unflattened`: saved with flatten_state_dict=False, each top-level value one item (a nested dict of
    tensors torch.saved whole)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = {"planner": DefaultSavePlanner(flatten_state_dict=False)} if case == "unflattened" else {}
    src = tmp_path / "src"
    dcp.save(_torch_test_state(case), storage_writer=FileSystemWriter(src), **planner)
    assert_bitwise_equal(_exported(src, tmp_path, fmt), _torch_reads(src), f"{case} {fmt}")


# ------------------------------------------------------------------------------------------ HF storage
def _hf_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {"embed.weight": torch.randn(10, 4, generator=gen), "layers.0.w": torch.randn(4, 4, generator=gen).bfloat16(),
            "layers.0.b": torch.randn(4, generator=gen),
            "f8": torch.randn(3, 3, generator=gen).to(torch.float8_e4m3fn),
            "ids": torch.arange(6, dtype=torch.int32), "u16": torch.arange(5).to(torch.uint16)}


@pytest.mark.parametrize("case", ["plain", "sharded", "consolidated", "consolidated/sharded", "mapped"])
def test_hf_storage_reads_as_torch_hf_reader_reads_it(case: str, tmp_path: Path) -> None:
    """torch's HuggingFaceStorageWriter without and with save_distributed (shard-* files), with consolidation
    (model-* files, the shards kept in sharded/; `mapped`: its fqn_to_index_mapping over two files), against
    torch's HuggingFaceStorageReader. (torch's consolidation cannot write integer tensors: torch.finfo.)"""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    state = _hf_state()
    kind = case.split("/")[0]
    if kind in ("consolidated", "mapped"):
        state = {k: v for k, v in state.items() if v.is_floating_point()}
    options = {"plain": {}, "sharded": {"save_distributed": True},
               "consolidated": {"save_distributed": True, "enable_consolidation": True},
               "mapped": {"save_distributed": True, "enable_consolidation": True,
                          "fqn_to_index_mapping": {k: 1 + (i % 2) for i, k in enumerate(state)}}}[kind]
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(tmp_path / "src"), **options))
    src = tmp_path / "src" / case.removeprefix(kind).lstrip("/")
    want = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(want, storage_reader=HuggingFaceStorageReader(str(src)))
    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=1)
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=True), want, f"{case} torch")
    shardstore.unshard(src, tmp_path / "st", jobs=1)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), want, f"{case} safetensors")


# ------------------------------------------------------------------------------------------ DTensor placements
def _save_placements(rank: int, world: int, out: str, port: int) -> None:
    """FSDP2 over tensor parallelism on a (dp=2, tp=2) mesh with sizes that do not divide: `_StridedShard`
    + `Shard` pieces of uneven rows, a parameter of one row (an empty piece on one dp rank); and DTensors
    placed on both mesh dimensions: uneven on two axes, twice on one axis (an empty piece), replicated."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5), torch.nn.LayerNorm(5))
    model.register_parameter("row", torch.nn.Parameter(torch.randn(1, 4)))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    full = torch.arange(15.0).reshape(3, 5)
    placed = {"both": distribute_tensor(full, mesh, [Shard(0), Shard(1)]),
              "twice": distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0), Shard(0)]),
              "replicated": distribute_tensor(full, mesh, [Replicate(), Shard(1)])}
    dcp.save({"model": model.state_dict(), "placed": placed}, checkpoint_id=out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def placements(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.fsdp import spawn_gloo

    out = tmp_path_factory.mktemp("placements") / "ckpt"
    spawn_gloo(_save_placements, (4, str(out)), 4)
    return out


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_strided_uneven_and_empty_dtensor_pieces_read_as_torch_reads_them(fmt: str, placements: Path,
                                                                           tmp_path: Path) -> None:
    md = pickle.loads((placements / ".metadata").read_bytes())
    sizes = [tuple(c.sizes) for meta in md.state_dict_metadata.values() for c in getattr(meta, "chunks", [])]
    assert (0, 4) in sizes and (1, 5) in sizes  # an empty piece, an uneven one
    assert_bitwise_equal(_exported(placements, tmp_path, fmt), _torch_reads(placements), fmt)


def test_a_dtype_shardstore_does_not_hold_is_named_as_torch_names_it(tmp_path: Path) -> None:
    src = _save({"w": torch.zeros(2, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, tmp_path / "src")
    refused(src, tmp_path / "out", r"\.metadata: w: unsupported tensor dtype torch\.float4_e2m1fn_x2\Z")


def test_a_step_torchtitan_records_through_zstandard_is_read_against_its_folder_name(tmp_path: Path) -> None:
    """The step a trainer keeps as a bytes item (torchtitan's train_state.step) is checked against its folder
    (step-N) when the plan is made: read through the same ZStandard stream as every item."""
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"model": {"w": torch.arange(6.0)}, "train_state": {"step": 10}}
    src = _save(state, tmp_path / "step-10", _extensions=[ZStandard()])
    assert_bitwise_equal(_exported(src, tmp_path), _torch_reads(src))
    other = _save({**state, "train_state": {"step": 9}}, tmp_path / "again" / "step-10", _extensions=[ZStandard()])
    refused(other, tmp_path / "out", r"step-10/__0_0\.distcp: train_state\.step: records step 9, but its folder is "
                                     r"step-10")
