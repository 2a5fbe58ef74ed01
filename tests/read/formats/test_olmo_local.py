"""OLMo's `local` format: FSDP1 flat parameters saved per rank by real gloo processes the way OLMo's
LocalShardedCheckpointer saves them, unsharded bit-exact against torch's own gather of the model and the
optimizer, in both output formats, with torch 2.1–2.2's metadata and torch 2.0's."""

from __future__ import annotations

import collections
import json
import pickle
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import shardstore
from shardstore.cli import main
from shardstore.read.primitives.unpickle import ShardParamInfo, load
from tests.conftest import assert_bitwise_equal, copy_checkpoint
from tests.read.conformance import FormatTests
from tests.test_cli import error_line

CASES = [("2.2", 3), ("2.0", 4), ("hsdp", 4)]  # torch 2.1+ (alignment padding); torch <= 2.0.1; 2 replica groups


def _want(src: Path) -> dict:
    return torch.load(src / "expected.pt.ref", weights_only=False)


def _check_torch_output(out: Path, src: Path) -> None:
    """model.pt, optim.pt and train.pt as OLMo's unsharder writes them, against torch's gather."""
    want = _want(src)
    model = torch.load(out / "model.pt", weights_only=True)
    assert_bitwise_equal(model, want["model"], "model")
    optim = torch.load(out / "optim.pt", weights_only=True)
    rank0 = torch.load(src / "optim" / "rank0.pt", weights_only=False)["param_groups"]
    for group in rank0:  # OLMo's unsharder: rank 0's groups, wrapper names removed from param_names
        group["param_names"] = [n.replace("_fsdp_wrapped_module.", "") for n in group["param_names"]]
    assert optim["param_groups"] == rank0
    names = {pid: name for g in optim["param_groups"] for pid, name in zip(g["params"], g["param_names"])}
    assert set(optim["state"]) == set(names)  # keyed by parameter id, every parameter has state
    for pid, state in optim["state"].items():
        assert_bitwise_equal(state, want["optim"]["state"][names[pid]], f"optim/{pid}")
    train = torch.load(out / "train.pt", weights_only=False)
    assert train.keys() == torch.load(src / "train" / "rank0.pt", weights_only=False).keys()  # rank 0's, whole
    assert (out / "config.yaml").read_bytes() == (src / "config.yaml").read_bytes()


@pytest.mark.parametrize("variant,world", CASES)
def test_local_unshards_bit_exact_in_both_formats(variant: str, world: int, olmo_checkpoints, tmp_path: Path) -> None:
    src = olmo_checkpoints("local", variant, world)
    shardstore.unshard(src, tmp_path / "pt", store=tmp_path / "store", format="torch", jobs=2)
    _check_torch_output(tmp_path / "pt", src)
    shardstore.export(tmp_path / "store", tmp_path / "st")
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), _want(src)["model"], "safetensors")
    store = shardstore.open(tmp_path / "store")
    assert store.manifest.facts.format == "olmo-local"
    assert store.manifest.world_size == 3 * world  # model, optim and train file of every rank


def test_a_cell_astride_two_ranks_is_assembled_from_both(olmo_checkpoints, tmp_path: Path) -> None:
    """ff_proj is the first parameter of its block's flat parameter: rank 0 holds its first 209122 elements,
    rank 1 the rest, the edge mid-row. Its cells are written whole by one rank each, except the one holding
    the edge, which both stage and the coordinator assembles."""
    src = olmo_checkpoints("local", "2.2", 3)
    shardstore.ingest(tmp_path / "store", [src / "model" / "rank1.pt"], jobs=1)
    store = shardstore.open(tmp_path / "store")
    path = "model/transformer.blocks.0.ff_proj.weight"
    entry = store.manifest.arrays[path]
    assert entry.flat and not entry.staged and entry.ncells > 2
    edge = 209122 // entry.cell_elements
    assert edge not in store.cells_present(path)  # half of it is staged, waiting for rank 0
    shardstore.ingest(tmp_path / "store", [src / "model" / "rank0.pt"], jobs=1)
    store = shardstore.open(tmp_path / "store")
    assert edge in store.cells_present(path) and len(store.cells_present(path)) == entry.ncells
    want = _want(src)["model"]["transformer.blocks.0.ff_proj.weight"]
    assert_bitwise_equal(store[path][2170:2190], want[2170:2190])  # rows around the edge (row 2178)


def test_units_arrive_in_any_order_and_ls_names_the_format(olmo_checkpoints, tmp_path: Path) -> None:
    src = olmo_checkpoints("local", "2.2", 3)
    files = sorted(src.glob("*/rank*.pt"), key=lambda p: (p.name, p.parent.name), reverse=True)
    runner = CliRunner()
    first = runner.invoke(main, ["ingest", str(tmp_path / "store"), *map(str, files[:4])])
    assert first.exit_code == 0, first.output
    assert "4/9" in first.output
    rest = runner.invoke(main, ["ingest", str(tmp_path / "store"), str(src)])
    assert rest.exit_code == 0 and "9/9" in rest.output, rest.output
    ls = runner.invoke(main, ["ls", str(tmp_path / "store")])
    assert "format: olmo-local (3 model files + 3 optimizer files + 3 trainer-state files)" in ls.output
    assert runner.invoke(main, ["export", str(tmp_path / "store"), str(tmp_path / "pt"), "--format", "torch"]).exit_code == 0
    _check_torch_output(tmp_path / "pt", src)


def test_a_model_file_of_another_rank_is_refused(olmo_checkpoints, tmp_path: Path) -> None:
    """rank1.pt copied over rank2.pt: it describes rank 1's slice, not rank 2's."""
    ckpt = copy_checkpoint(olmo_checkpoints("local", "2.2", 3), tmp_path / "ckpt")
    shutil.copy(ckpt / "model" / "rank1.pt", ckpt / "model" / "rank2.pt")
    line = error_line("unshard", str(ckpt), str(tmp_path / "out"), "-q")
    assert "model/rank2.pt: flat parameter 0: _shard_param_infos disagree with its slice" in line


def test_shard_infos_that_disagree_with_the_layout_are_refused(olmo_checkpoints, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(olmo_checkpoints("local", "2.2", 3), tmp_path / "ckpt")
    state = torch.load(ckpt / "model" / "rank1.pt", weights_only=False)
    handle = state["modules"][1]["handles"][0]
    infos = list(handle["flat_param._shard_param_infos"])
    first = next(i for i, info in enumerate(infos) if info.in_shard)
    infos[first] = infos[first]._replace(intra_param_start_idx=infos[first].intra_param_start_idx + 96)
    handle["flat_param._shard_param_infos"] = tuple(infos)
    torch.save(state, ckpt / "model" / "rank1.pt")
    line = error_line("unshard", str(ckpt), str(tmp_path / "out"), "-q")
    assert "model/rank1.pt" in line and "_shard_param_infos disagree" in line


def test_optimizer_state_of_the_wrong_size_is_refused(olmo_checkpoints, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(olmo_checkpoints("local", "2.2", 3), tmp_path / "ckpt")
    state = torch.load(ckpt / "optim" / "rank2.pt", weights_only=False)
    pid = next(iter(state["state"]))
    state["state"][pid]["exp_avg"] = state["state"][pid]["exp_avg"][:-1].clone()
    torch.save(state, ckpt / "optim" / "rank2.pt")
    line = error_line("unshard", str(ckpt), str(tmp_path / "out"), "-q")
    assert "optim/rank2.pt" in line and "exp_avg" in line and "this rank holds" in line


def test_a_world_size_that_contradicts_the_files_is_refused(olmo_checkpoints, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(olmo_checkpoints("local", "2.2", 3), tmp_path / "ckpt")
    (ckpt / "metadata.yaml").write_text("world_size: 2\n")
    line = error_line("unshard", str(ckpt), str(tmp_path / "out"), "-q")
    assert "rank 2" in line and "world has 2" in line


def test_shard_param_info_loads_from_either_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.1 pickled _ShardParamInfo under torch.distributed.fsdp.flat_param, 2.2+ under _flat_param
    (the real class here); both load, in strict mode too, as shardstore's own record of the five fields."""
    from torch.distributed.fsdp._flat_param import _ShardParamInfo

    old = types.ModuleType("torch.distributed.fsdp.flat_param")
    old._ShardParamInfo = collections.namedtuple("_ShardParamInfo", _ShardParamInfo._fields)  # type: ignore[attr-defined]
    old._ShardParamInfo.__module__ = old.__name__
    monkeypatch.setitem(sys.modules, old.__name__, old)
    for cls in (_ShardParamInfo, old._ShardParamInfo):
        loaded = load(pickle.dumps(cls(True, 4, 12, 96, 107), protocol=2), "test", strict=True)
        assert isinstance(loaded, ShardParamInfo) and tuple(loaded) == (True, 4, 12, 96, 107)


def test_the_store_keeps_the_layout_it_planned_from(olmo_checkpoints, tmp_path: Path) -> None:
    """Workers check their files against the layout derived from rank 0 and kept in the manifest."""
    src = olmo_checkpoints("local", "2.2", 3)
    shardstore.ingest(tmp_path / "store", [src / "model" / "rank0.pt"], jobs=1)
    manifest = json.loads((tmp_path / "store" / "__shardstore__" / "manifest.json").read_text())
    layout = manifest["facts"]["reader"]["olmo_local"]
    assert layout["world"] == 3 and layout["group"] == 3 and len(layout["handles"]) == 3
    block = layout["handles"][1]
    assert [p[0] for p in block["params"]][:2] == ["transformer.blocks.0.ff_proj.weight",
                                                  "transformer.blocks.0.attn_norm.weight"]
    assert block["total"] % 3 == 0  # FSDP padded it to divide by the world size


def test_a_run_folder_of_steps_is_searched_one_level_down(olmo_checkpoints, tmp_path: Path) -> None:
    """OLMo's save folder holds one checkpoint per step: --step picks one, and two are never mixed; without
    it the newest is taken, and the first line of the output names it."""
    from tests.fixtures.forge import resaved

    run = tmp_path / "run"
    shutil.copytree(olmo_checkpoints("local", "2.2", 3), run / "step1000")  # with its expected answer
    copy_checkpoint(olmo_checkpoints("olmo_core", "flat", 3), run / "step2000")
    for step in (1000, 2000):  # the step each folder's name says, as OLMo's trainer records it
        for train in (run / f"step{step}" / "train").glob("rank*.pt"):
            resaved(train, train, lambda state: state.update(global_step=step))
    proc = subprocess.run([sys.executable, "-m", "shardstore.cli", "unshard", str(run), str(tmp_path / "new")],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr.splitlines()[0] == f"unshard: the checkpoint in {run / 'step2000'}"
    line = error_line("unshard", str(run), str(tmp_path / "out"), "--step", "3000", "-q")
    assert line.endswith("no checkpoint matches --step 3000; it holds step1000, step2000"), line
    shardstore.unshard(run, tmp_path / "out", step=1000, format="torch", jobs=1)
    _check_torch_output(tmp_path / "out", run / "step1000")


def test_parameter_starts_follow_the_padding_the_file_records() -> None:
    """Mixed precision (bf16 compute over fp32 storage) aligns to 8 elements, not the stored dtype's 4:
    the list from a real OLMo run's model file. fp32 and no alignment read as themselves."""
    from shardstore.read.formats.olmo_local import _layouts

    numels = [90, 90, 8100, 11070, 24300]
    assert _layouts(numels, [90, 6, 90, 6, 8100, 4, 11070, 2, 24300, 4]) == [[0, 96, 192, 8296, 19368]]
    assert _layouts(numels, [90, 2, 90, 2, 8100, 11070, 2, 24300]) == [[0, 92, 184, 8284, 19356]]  # fp32: 4
    assert _layouts(numels, numels) == [[0, 90, 180, 8280, 19350]]  # torch 2.0, use_orig_params=False
    assert _layouts(numels, [90, 3, 90, 3, 8100, 11070, 24300]) == []  # padding no alignment gives
    assert _layouts([5, 120], [5, 120, 3]) == []  # a tail padding without the padding before 120 at any alignment > 1


def test_an_ambiguous_padding_list_is_settled_by_the_ranks_own_infos() -> None:
    """(4, 4) padded as (4, 4, 4) is 8-aligned padding before the second parameter, or 4-aligned with a
    tail: both fit the list. Each rank's `_shard_param_infos` says which, and only that layout is kept."""
    from shardstore.read.formats.olmo_local import _handles, _narrow

    def copy_of(rank: int, second_start: int) -> dict:
        """A rank's metadata for a group of 6 (2 elements each), as FSDP writes it for that layout."""
        lo = 2 * rank
        infos = []
        for start in (0, second_start):
            held = start <= lo < start + 4
            infos.append((True, 0, 2, lo - start, lo - start + 1) if held else (False, None, None, None, None))
        from shardstore.records import StorageRef, TensorRef
        return {"flat_param.data": TensorRef(StorageRef("0", "float32", 2), 0, (2,), (1,), "float32"),
                "flat_param._fqns": ("a", "b"), "flat_param._shapes": ((4,), (4,)), "flat_param._numels": (4, 4),
                "flat_param._numels_with_padding": (4, 4, 4), "flat_param._shard_numel_padded": 0,
                "flat_param._shard_param_infos": [ShardParamInfo(*i) for i in infos]}

    both = _handles("", copy_of(0, 8), "test")
    assert [[p.start for p in h.params] for h in both] == [[0, 4], [0, 8]]
    # rank 0 (elements 0-1) cannot tell them apart; rank 2 (elements 4-5) can
    assert _narrow([both], [("", copy_of(0, 8))], 0, 6, "test") == [both]
    for start in (4, 8):
        (kept,) = _narrow([both], [("", copy_of(2, start))], 2, 6, "test")
        assert [[p.start for p in h.params] for h in kept] == [[0, start]]


class TestOlmoLocalConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, olmo_checkpoints) -> Path:
        return olmo_checkpoints("local", "2.2", 3)

    @pytest.fixture
    def foreign(self, olmo_checkpoints) -> Path:
        return olmo_checkpoints("local", "2.0", 3) / "model" / "rank1.pt"


def test_a_trainer_state_of_another_step_is_refused(tmp_path: Path) -> None:
    """OLMo names step{N}/ by the global_step train/rank{r}.pt records: a genuine corpus checkpoint of step 1
    in a step2/ folder is refused in one line naming rank 0's file, nothing left; in step1/ it unshards."""
    from tests.refusals import assert_step_is_checked

    assert_step_is_checked(Path(__file__).parents[2] / "corpus" / "data" / "olmo-local-t2.1-hsdp-w4", tmp_path, 1, "train/rank0.pt")
