"""Megatron-Core MoE checkpoints whose experts are Transformer Engine's grouped GEMMs (TEGroupedMLP), in
both of megatron-core's key layouts (TE's per-GEMM `linear_fc1.weight{i}` and the single grouped
`linear_fc1.weight`, `moe_single_grouped_weight`), saved by megatron-core 0.19.2's own
`dist_checkpointing.save` (tests/fixtures/megatron_te.py, with its documented CPU stand-in of TE's
GroupedLinear) and read against megatron-core's own load of each into one TP 1, EP 1 process of the
other layout, and Megatron's own forward of it.

torch_dist keeps no trace of the layout: megatron-core splits a grouped weight per GEMM before saving,
under the keys SequentialMLP would use, so the experts come out one by one
(`mlp.experts.local_experts.{e}.…`) from either save.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

import shardstore
from tests.read.formats.test_megatron import DATA, _bits, _saved_names

LAYOUTS = ["tp2-pp1-ep2-etp2-te-gemm", "tp2-pp1-ep2-etp1-te-grouped"]
EXPERTS = 4
# TEGroupedMLP's parameters: a GEMM's (`weight3`) or all the GEMMs' on a leading axis (`weight`)
GROUPED = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias|_extra_state)([0-9]*)")


def _per_expert(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core's TEGroupedMLP state dict under the names of its experts one by one (SequentialMLP's):
    GEMM i is local expert i, a grouped weight's row i too, the extra state every expert's; the norms under
    the names torch_dist gives them."""
    return _saved_names(_one_by_one(model))


def _one_by_one(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.items():
        m = GROUPED.fullmatch(key)
        if m is None:
            out[key] = value
            continue
        head, linear, kind, gemm = m.groups()
        if gemm:
            out[f"{head}local_experts.{gemm}.{linear}.{kind}"] = value
        else:
            parts = [value] * EXPERTS if kind == "_extra_state" else list(value.unbind(0))
            assert len(parts) == EXPERTS, key
            out.update({f"{head}local_experts.{e}.{linear}.{kind}": t for e, t in enumerate(parts)})
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_te_grouped_experts_read_expert_by_expert_as_megatron_core_loads_them(layout: str, tmp_path: Path) -> None:
    """Each expert's fc1 ([gate; up] over both expert-TP ranks) and fc2, bit for bit what megatron-core's
    own load gives a model of the other layout (its pre-hook stacking or splitting the GEMMs), in
    --format torch and safetensors; TE's extra state (an empty uint8 tensor without FP8) kept per expert."""
    from safetensors.torch import load_file

    src = DATA / layout
    saved = _per_expert(torch.load(f"{src}.expected.pt.ref", weights_only=True)["model"])
    want = {k: v for k, v in saved.items() if not k.endswith("_extra_state")}
    assert len([k for k in want if ".local_experts." in k]) == 2 * EXPERTS * 2  # layers, fc1 and fc2
    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=2)
    model = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=False)["model"]
    tensors = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(want)
    for key, value in want.items():
        assert tensors[key].dtype == value.dtype and torch.equal(_bits(tensors[key]), _bits(value)), key
    extra = {k for k in saved if k.endswith("_extra_state")}  # megatron's ShardedObjects: one-element lists
    assert len(extra) == 2 * EXPERTS * 2 and all(model[k][0].dtype == torch.uint8 and model[k][0].numel() == 0
                                                 and saved[k].numel() == 0 for k in extra)
    experts = [want[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(EXPERTS)]
    assert len({bytes(_bits(t)) for t in experts}) == EXPERTS  # every expert its own values: a swap shows
    shardstore.unshard(src, tmp_path / "st", jobs=2)
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert set(st) == set(want) and all(torch.equal(st[k], v) for k, v in want.items())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_export_of_te_grouped_experts_gives_megatrons_own_logits(layout: str, tmp_path: Path) -> None:
    """--format hf, described by Megatron-LM's args: transformers' Mixtral reproduces Megatron's own forward
    through TEGroupedMLP (float32, sums in another order); a config of another expert count is refused
    naming the router's shape before anything is written."""
    from transformers import AutoModelForCausalLM

    src = DATA / layout
    want = torch.load(f"{src}.expected.pt.ref", weights_only=True)
    shardstore.unshard(src, tmp_path / "hf", format="hf", jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert model.config.num_local_experts == EXPERTS
    with torch.no_grad():
        logits = model(input_ids=want["ids"]).logits
    torch.testing.assert_close(logits, want["logits"], rtol=1e-4, atol=1e-4)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "three.json").write_text(json.dumps({**config, "num_local_experts": 3}))
    with pytest.raises(shardstore.ExportError, match=r"mlp\.router\.weight: shape \[4, 16\], the config makes it"):
        shardstore.unshard(src, tmp_path / "hf3", format="hf", hf_config=tmp_path / "three.json", jobs=1)
    assert not (tmp_path / "hf3" / "model.safetensors").exists()


def test_torch_format_rank_files_hold_each_expert_as_megatron_partitions_it() -> None:
    """Megatron-LM's `--ckpt-format torch` of the per-GEMM model (the same live ranks as the torch_dist save):
    mp_rank_{tp:02d}_{ep:03d}/model_optim_rng.pt holds TE's `linear_fc1.weight{i}` for global expert
    ep * 2 + i: its expert-TP rank's gate rows over its up rows (SwiGLU's [gate_t; up_t]), and fc2's
    column block; the router whole. This is the merge a torch-format reader must undo (the reader is
    megatron_torch.py's, taught EP and TP names separately: extend this test with its unshard)."""
    src = DATA / f"{LAYOUTS[0]}-legacy" / "iter_0000010"
    want = _one_by_one(torch.load(DATA / f"{LAYOUTS[0]}.expected.pt.ref", weights_only=True)["model"])
    local = EXPERTS // 2
    for tp in range(2):
        for ep in range(2):
            saved = torch.load(src / f"mp_rank_{tp:02d}_{ep:03d}" / "model_optim_rng.pt", weights_only=False)
            model = saved["model"]
            assert saved["args"].ckpt_format == "torch" and saved["args"].expert_model_parallel_size == 2
            for layer in range(2):
                head = f"decoder.layers.{layer}.mlp."
                assert torch.equal(model[f"{head}router.weight"], want[f"{head}router.weight"])
                assert f"{head}experts.linear_fc1.weight{local}" not in model  # local GEMM numbers only
                for i in range(local):
                    expert = f"{head}experts.local_experts.{ep * local + i}."
                    gate, up = want[f"{expert}linear_fc1.weight"].chunk(2)
                    rows = torch.cat([gate.chunk(2)[tp], up.chunk(2)[tp]])
                    assert torch.equal(model[f"{head}experts.linear_fc1.weight{i}"], rows)
                    fc2 = want[f"{expert}linear_fc2.weight"].chunk(2, dim=1)[tp]
                    assert torch.equal(model[f"{head}experts.linear_fc2.weight{i}"], fc2)


def test_a_rank_file_of_the_other_layouts_save_is_refused_in_one_line(tmp_path: Path) -> None:
    """The grouped save's rank 1 file in the per-GEMM save's place (both megatron-core's own, of the same
    model): its bytes are not what the metadata says, refused naming the file."""
    from tests.refusals import assert_refused, cli

    src = tmp_path / "run"
    shutil.copytree(DATA / LAYOUTS[0], src)
    shutil.copy(DATA / LAYOUTS[1] / "iter_0000010" / "__1_0.distcp", src / "iter_0000010" / "__1_0.distcp")
    line = assert_refused(cli("unshard", src, tmp_path / "out", "-q"), str(src / "iter_0000010" / "__1_0.distcp"))
    assert "the metadata says" in line
    assert not (tmp_path / "out" / "model.safetensors").exists()


class GroupedTensor(torch.Tensor):
    """What torch's pickling sees of TE's GroupedTensor (transformer_engine/pytorch/tensor/grouped_tensor.py):
    a `_make_wrapper_subclass` tensor of shape (experts, out, in) holding no storage of its own, its values
    in `rowwise_data` among its storage fields. TE's own needs CUDA; the pickle's form is torch's for any
    such subclass (`_rebuild_from_type_v2` of `_rebuild_wrapper_subclass`, the fields as its state), its
    bytes not TE's."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> GroupedTensor:
        grouped = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)
        grouped.rowwise_data = data.flatten()
        return grouped

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError(func)


def test_a_torch_format_single_grouped_weight_is_refused_naming_te_grouped_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--ckpt-format torch` pickles a single grouped weight (`moe_single_grouped_weight`) as TE's
    GroupedTensor, a wrapper subclass whose values are not its own storage: refused in one line naming
    it, rather than read as something else."""
    from tests.fixtures.megatron_core import _args
    from tests.refusals import assert_refused, cli

    name = "transformer_engine.pytorch.tensor.grouped_tensor"
    for module in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.tensor", name):
        monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
    monkeypatch.setattr(GroupedTensor, "__module__", name)
    sys.modules[name].GroupedTensor = GroupedTensor  # type: ignore[attr-defined]
    rank = tmp_path / "run" / "iter_0000010" / "mp_rank_00"
    rank.mkdir(parents=True)
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("10")
    args = _args(1, 1, "moe")
    vars(args).update(expert_model_parallel_size=1, moe_grouped_gemm=True, moe_single_grouped_weight=True)
    weight = GroupedTensor(torch.arange(4 * 8 * 4, dtype=torch.float32).reshape(4, 8, 4))
    torch.save({"args": args, "iteration": 10, "checkpoint_version": 3.0,
                "model": {"decoder.layers.0.mlp.experts.linear_fc1.weight": weight}}, rank / "model_optim_rng.pt")
    assert_refused(cli("unshard", tmp_path / "run", tmp_path / "out", "-q"), "GroupedTensor", "model_optim_rng.pt")
    assert not (tmp_path / "out" / "model.safetensors").exists()
