"""Megatron-LM's `--ckpt-format torch` with expert parallelism (`mp_rank_TT_PPP_EEE`) and virtual pipeline
chunks (`model0`, `model1`), and megatron-core's torch_dist of the same MoE model at EP 2 x TP 2 x PP 2
with the distributed optimizer, all written by megatron-core 0.19.2's own code
(tests/fixtures/megatron_core.py; kept in tests/fixtures/data/megatron/): read bit for bit as
megatron-core's own load and the live ranks give them, and what cannot be merged exactly refused by name.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardstore
from tests.read.conformance import FormatTests
from tests.read.formats.test_megatron import (DATA, _bits, _common, _iteration, _mtp_is_the_hubs_layer_after_the_last,
                                               _per_layer, _same, _saved_names)

EP = DATA / "tp2-pp2-dp2-legacy-qwen2moe-optim"  # Qwen2-MoE's blocks: 4 experts over 2 expert ranks, shared expert
VP = DATA / "tp2-pp2-legacy-vp"  # 4 layers, 2 stages of 2 virtual chunks each
# DeepSeek-V3's blocks (4 layers, the first dense; MLA; a shared expert; an expert bias), its MTP layer on the
# last stage beside that stage's copy of the embedding
DSV3 = DATA / "tp2-pp2-dp2-legacy-dsv3"
LAYOUTS = [EP.name, VP.name, DSV3.name]


def _model(out: Path) -> dict[str, Any]:
    return torch.load(out / "checkpoint.pt", weights_only=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_and_virtual_pipeline_merge_as_megatron_core_loads_them(layout: str, tmp_path: Path) -> None:
    """Each expert rank's experts renumbered after the ranks before it (what is not an expert taken from
    expert rank 0), each virtual chunk's layers after the chunks before it (v * L / VP + p * L / (PP * VP)),
    routed and shared experts' SwiGLU fc1 [gate; up] per tensor rank, the router whole: bit for bit the
    model megatron-core's own load gives one TP=1, EP=1 process, in its order; each rank's other values
    (its distributed optimizer's distrib_optim.pt too: the dense and the expert optimizer's parameter
    state, as saved) kept under ranks/; the Hugging Face export gives Megatron's own logits (DeepSeek-V3's
    MTP layer, of the last stage, the hub's layer after the last)."""
    from transformers import AutoModelForCausalLM

    src = DATA / layout
    want = torch.load(f"{src}.expected.pt.ref", weights_only=True)
    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=2)
    got = _model(tmp_path / "pt")
    tensors = {k: v for k, v in got["model"].items() if isinstance(v, torch.Tensor)}
    assert list(tensors) == list(want["model"])  # Megatron's own order: layer by layer, expert by expert
    for key, value in want["model"].items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key
    names = sorted(p.name for p in (src / "iter_0000010").iterdir())
    assert sorted(got["ranks"]) == names and len(names) == 8 if layout == EP.name else 4
    for name in names if layout == EP.name else []:
        saved = torch.load(src / "iter_0000010" / name / "distrib_optim.pt", weights_only=False)
        assert _same(got["ranks"][name]["distrib_optim"], saved)
        assert [s is None for s in saved] == [name.endswith("_001"), False]  # the dense one: data-parallel rank 0's
    shardstore.unshard(src, tmp_path / "hf", format="hf", jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(input_ids=want["ids"]).logits
    torch.testing.assert_close(logits, want["logits"], rtol=1e-4, atol=1e-4)
    if layout == DSV3.name:
        _mtp_is_the_hubs_layer_after_the_last(tmp_path / "hf", want["model"], layers=4)


def _per_expert(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The live ranks' per-parameter optimizer state of the routed experts, saved with an expert axis
    (`experts.experts.linear_fc1.weight`), under each expert's own name as the model's are."""
    out = {}
    for key, value in saved.items():
        head, sep, tail = key.partition(".mlp.experts.experts.")
        out.update({f"{head}.mlp.experts.local_experts.{e}.{tail}": value[e] for e in range(value.shape[0])}
                   if sep else {key: value})
    return out


@pytest.mark.parametrize("layout", ["tp2-pp2-dp2-qwen2moe-optim", "tp2-pp2-dp2-qwen2moe-optim-full"])
def test_expert_parallel_torch_dist_with_its_optimizer_is_what_megatron_held(layout: str, tmp_path: Path) -> None:
    """The same MoE model saved as torch_dist at EP 2 x TP 2 x PP 2 after two training steps, its
    optimizer `dp_reshardable` (flat buckets per rank, the expert optimizer's beside the dense one's) or
    `fully_reshardable` (per parameter, per expert): the model bit for bit what megatron-core's own load
    gives, the optimizer's state what the live ranks held."""
    src = DATA / layout
    want = torch.load(f"{src}.expected.pt.ref", weights_only=True)
    result = shardstore.unshard(src, tmp_path / "out", format="torch", jobs=2)
    assert any("flat buckets" in n for n in result.notes) == layout.endswith("-optim")
    got = _model(tmp_path / "out")
    model = _saved_names(want["model"])
    tensors = {k: v for k, v in got["model"].items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(model) and all(torch.equal(tensors[k], v) for k, v in model.items())
    optimizer = {k: v for k, v in got["optimizer"].items() if isinstance(v, torch.Tensor)}
    expected = _per_expert(_per_layer(want["optimizer"]))
    assert set(optimizer) == set(expected)
    for key, value in expected.items():  # bit for bit: a bucket's padding is whatever memory held
        assert optimizer[key].dtype == value.dtype and torch.equal(_bits(optimizer[key]), _bits(value)), key
    if layout.endswith("-full"):  # per routed expert, under its global number
        assert "optimizer.state.exp_avg.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in optimizer
    assert _common(got)["args"].expert_model_parallel_size == 2


# ---------------------------------------------------------------------------------------------- refused
def _copy(tmp_path: Path, src: Path = EP) -> Path:
    out = tmp_path / "run" / "iter_0000010"
    shutil.copytree(src / "iter_0000010", out)
    return out


def _refused(src: Path, tmp_path: Path, *needles: str) -> None:
    """Refused before anything is written, in one line naming what."""
    with pytest.raises(shardstore.CheckpointError) as refused:
        shardstore.unshard(src, tmp_path / "refused", format="torch")
    line = str(refused.value)
    assert "\n" not in line and all(n in line for n in needles), line
    assert not (tmp_path / "refused").exists()


def _forge(path: Path, change: Any) -> None:
    from tests.fixtures.forge import resaved

    resaved(path, path, change)


def test_a_missing_expert_rank_is_refused_up_front(tmp_path: Path) -> None:
    """Expert rank 1's folders gone (the rest a whole TP x PP grid by themselves): the args' grid names them."""
    src = _copy(tmp_path)
    for folder in src.glob("mp_rank_*_001"):
        shutil.rmtree(folder)
    _refused(src, tmp_path, str(src), "rank folders missing for the args' TP=2 x PP=2 x EP=2 grid: "
             "mp_rank_00_000_001, mp_rank_00_001_001, mp_rank_01_000_001, mp_rank_01_001_001")


def test_an_expert_ranks_file_of_another_save_is_refused_in_one_line(tmp_path: Path) -> None:
    """Expert rank 1's file of iteration 20 beside the others of iteration 10 (every key and shape alike)."""
    from tests.refusals import assert_refused, cli

    src = _copy(tmp_path)
    other = src / "mp_rank_01_001_001" / "model_optim_rng.pt"
    _forge(other, _iteration(20))
    assert_refused(cli("unshard", src, tmp_path / "out", "-q"), f"{other}: records iteration 20, but "
                   f"{src / 'mp_rank_00_000_000' / 'model_optim_rng.pt'} records 10")
    assert not (tmp_path / "out").exists()


def _drop_expert(state: dict) -> None:
    state["model"] = {k: v for k, v in state["model"].items() if ".local_experts.1." not in k}


def _gemms(count: int) -> Any:
    """Transformer Engine's per-GEMM weights of an expert rank, `count` of them (it holds 2): one dropped,
    or one more."""
    def change(state: dict) -> None:
        head = "decoder.layers.0.mlp.experts.linear_fc1.weight"
        if count < 2:
            del state["model"][f"{head}1"]
        else:
            state["model"][f"{head}2"] = state["model"][f"{head}1"].clone()
    return change


def _router(state: dict) -> None:
    key = "decoder.layers.0.mlp.router.weight"
    state["model"][key] = state["model"][key][:3].clone()


TE = DATA / "tp2-pp1-ep2-etp2-te-gemm-legacy"  # TEGroupedMLP's per-GEMM weights, mp_rank_TT_EEE (PP 1)


@pytest.mark.parametrize("layout, change, needles", [  # expert rank 1's file of stage 0, tensor rank 0
    (EP, _drop_expert, ["decoder.layers.0.mlp.experts.local_experts.*.linear_fc1.weight: holds experts [2], its "
                        "expert rank's are 2..3"]),
    (TE, _gemms(3), ["decoder.layers.0.mlp.experts.linear_fc1.weight2: expert 2 of an expert rank's 2 (num_experts 4"]),
    (TE, _gemms(1), ["decoder.layers.0.mlp.experts.local_experts.*.linear_fc1.weight: holds experts [2], its "
                     "expert rank's are 2..3"]),
    (EP, _router, ["decoder.layers.0.mlp.router.weight: 3 rows for the args' num_experts 4"])])
def test_experts_of_another_count_and_a_router_of_another_size_are_refused(
        layout: Path, change: Any, needles: list[str], tmp_path: Path) -> None:
    """An expert rank's file missing an expert, with one grouped GEMM too many or too few, or a router of
    another expert count: refused naming the file and the key, nothing written."""
    src = _copy(tmp_path, layout)
    path = src / ("mp_rank_00_000_001" if layout == EP else "mp_rank_00_001") / "model_optim_rng.pt"
    _forge(path, change)
    _refused(src, tmp_path, f"{path}: ", *needles)


def test_transformer_engine_grouped_experts_merge_under_sequential_names(tmp_path: Path) -> None:
    """TEGroupedMLP's per-GEMM `linear_fc1.weight{l}` of each expert rank (megatron-core's own torch-format
    save, mp_rank_TT_EEE): GEMM l of expert rank e is expert e * 2 + l, split by tensor rank as
    SequentialMLP's is, under SequentialMLP's names as the torch_dist reading gives them: bit for bit
    megatron-core's own load of the same model's torch_dist save (TE's extra state kept as saved); the
    Hugging Face export gives Megatron's own logits."""
    from transformers import AutoModelForCausalLM

    from tests.read.formats.test_megatron_te import _one_by_one

    want = torch.load(DATA / "tp2-pp1-ep2-etp2-te-gemm.expected.pt.ref", weights_only=True)
    shardstore.unshard(TE, tmp_path / "out", format="torch", jobs=2)
    got = {k: v for k, v in _model(tmp_path / "out")["model"].items() if isinstance(v, torch.Tensor)}
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in got
    model = {k: v for k, v in _one_by_one(want["model"]).items() if not k.endswith("_extra_state")}
    extra = {k: v for k, v in want["model"].items() if k.endswith("_extra_state")}  # TE's, kept as saved
    assert set(got) == set(model) | set(extra) and all(torch.equal(got[k], v) for k, v in (model | extra).items())
    shardstore.unshard(TE, tmp_path / "hf", format="hf", jobs=2)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = hf(input_ids=want["ids"]).logits
    torch.testing.assert_close(logits, want["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key, value", [("expert_tensor_parallel_size", 1), ("decoder_first_pipeline_num_layers", 1),
                                        ("pipeline_model_parallel_layout", "Et|tL"), ("num_experts", 3)])
def test_layouts_not_merged_are_refused_by_their_argument(key: str, value: object, tmp_path: Path) -> None:
    """The experts' own tensor split, uneven pipeline stages, experts that do not divide over the expert
    ranks: refused naming the argument."""
    src = _copy(tmp_path)
    path = src / "mp_rank_00_000_000" / "model_optim_rng.pt"
    _forge(path, lambda state: setattr(state["args"], key, value))
    _refused(src, tmp_path, f"{path}: args set {key}=")


def _gate(state: dict) -> None:
    key = "decoder.layers.0.mlp.shared_experts.gate_weight"
    state["model"][key] = torch.cat([state["model"][key]] * 2)


def _one_chunk(state: dict) -> None:
    del state["model1"]


@pytest.mark.parametrize("layout, rank, change, needles", [
    # what is not an expert, of another shape in an expert rank's file than in expert rank 0's (a mixed folder)
    (EP, "mp_rank_00_000_001", _gate, ["what is not a routed expert differs in its keys or shapes from",
                                       "mp_rank_00_000_000/model_optim_rng.pt's"]),
    (VP, "mp_rank_00_001", _one_chunk, ["holds 1 model chunks, its args virtual_pipeline_model_parallel_size 2"])])
def test_a_file_that_does_not_fit_its_place_is_refused(layout: Path, rank: str, change: Any, needles: list[str],
                                                       tmp_path: Path) -> None:
    """An expert rank's copy of the dense model of another shape, a file with fewer virtual pipeline chunks
    than the args: refused naming the file, nothing written."""
    src = _copy(tmp_path, layout)
    path = src / rank / "model_optim_rng.pt"
    _forge(path, change)
    _refused(src, tmp_path, f"{path}: ", *needles)


def test_the_last_stages_copy_of_the_embedding_and_mtp_layers_are_placed(tmp_path: Path) -> None:
    """Multi-token prediction's layers live on the last stage beside its copy of the embedding (here
    added to the genuine files as Megatron-LM's MTP stage holds them): the copy is taken from stage 0
    (refused when it is not alike), `mtp.layers.{i}` keep their numbers (not a decoder layer's), MTP's
    eh_proj split by rows as the column-parallel layer it is."""
    src = _copy(tmp_path, VP)
    first = [torch.load(src / f"mp_rank_0{t}_000" / "model_optim_rng.pt", weights_only=False)["model0"]
             for t in range(2)]
    projections = [torch.randn(8, 32) for _ in range(2)]

    def mtp(t: int) -> Any:
        def change(state: dict) -> None:
            state["model1"]["embedding.word_embeddings.weight"] = first[t]["embedding.word_embeddings.weight"]
            state["model1"]["mtp.layers.0.eh_proj.weight"] = projections[t]
            state["model1"]["mtp.layers.0.enorm.weight"] = torch.ones(16)
        return change
    for t in range(2):
        _forge(src / f"mp_rank_0{t}_001" / "model_optim_rng.pt", mtp(t))
    shardstore.unshard(src, tmp_path / "out", format="torch", jobs=2)
    got = _model(tmp_path / "out")["model"]
    want = torch.load(f"{VP}.expected.pt.ref", weights_only=True)["model"]
    assert torch.equal(got["embedding.word_embeddings.weight"], want["embedding.word_embeddings.weight"])
    assert torch.equal(got["mtp.layers.0.eh_proj.weight"], torch.cat(projections))
    assert torch.equal(got["mtp.layers.0.enorm.weight"], torch.ones(16))
    for t in range(2):  # a copy of another shape on both tensor ranks
        _forge(src / f"mp_rank_0{t}_001" / "model_optim_rng.pt",
               lambda state: state["model1"].update({"embedding.word_embeddings.weight": torch.zeros(50, 8)}))
    _refused(src, tmp_path, "mp_rank_00_001/model_optim_rng.pt: embedding.word_embeddings.weight (float32 [100, 8]) "
             "is a copy of what no earlier rank's file holds alike")


# ---------------------------------------------------------------------------------------------- MLA
MLA = {"tp": 2, "mla": {"q": 8, "kv": 6}, "experts": None, "glu": True}


@pytest.mark.parametrize("name, rows, rank0, rank1", [
    # Transformer Engine's spec duplicates the down projections on every rank: whole, from rank 0 alone
    ("linear_q_down_proj.weight", 8, [((0, 0), (8, 16), 0, 8)], []),
    ("linear_kv_down_proj.weight", 6, [((0, 0), (6, 16), 0, 6)], []),
    ("linear_qkv_down_proj.weight", 14, [((0, 0), (14, 16), 0, 14)], []),
    # the local spec's are column-parallel: 1/TP of the rows; the fused one 1/TP of q's, then of kv's
    ("linear_q_down_proj.weight", 4, [((0, 0), (4, 16), 0, 4)], [((4, 0), (4, 16), 0, 4)]),
    ("linear_qkv_down_proj.weight", 7, [((0, 0), (4, 16), 0, 4), ((8, 0), (3, 16), 4, 7)],
     [((4, 0), (4, 16), 0, 4), ((11, 0), (3, 16), 4, 7)])])
def test_mla_down_projections_are_whole_or_split_as_their_rows_say(name: str, rows: int, rank0: list,
                                                                    rank1: list) -> None:
    """MLA's down projections (q_lora_rank 8; kv_lora_rank + rope 6) at TP 2: the boxes each rank's rows
    fill (global offsets, sizes, local rows), and the merged shape."""
    from shardstore.read.formats.megatron_torch import _boxes

    key = f"decoder.layers.0.self_attention.{name}"
    shape = (rows * (2 if rank1 else 1), 16)
    assert _boxes(key, (rows, 16), 0, MLA, "f") == (shape, rank0)
    assert _boxes(key, (rows, 16), 1, MLA, "f") == (shape, rank1)


def test_an_mla_down_projection_the_args_cannot_place_is_refused() -> None:
    from shardstore.read.formats.megatron_torch import _boxes

    with pytest.raises(shardstore.CheckpointError, match=r"f: .*linear_kv_down_proj.weight: 5 rows, neither all 6"):
        _boxes("decoder.layers.0.self_attention.linear_kv_down_proj.weight", (5, 16), 0, MLA, "f")
    with pytest.raises(shardstore.CheckpointError, match="the args name no multi_latent_attention"):
        _boxes("decoder.layers.0.self_attention.linear_q_down_proj.weight", (4, 16), 0, {**MLA, "mla": None}, "f")


class TestExpertParallelConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        return EP / "iter_0000010"

    @pytest.fixture
    def foreign(self, tmp_path: Path) -> Path:
        return TE / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt"  # EP's name without its stage


class TestVirtualPipelineConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        return VP / "iter_0000010"

    @pytest.fixture
    def foreign(self, tmp_path: Path) -> Path:
        return DATA / "tp2-pp2-legacy" / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt"
