"""Megatron-Core LoRA adapters as peft's (shardstore/export/hf/megatron_lora.py), on Megatron-Bridge's own
LoRA (tests/fixtures/megatron_lora.py): a dense model at TP=2, whole and as Bridge's adapter-only save
beside its run_config.yaml, and an MoE model (SequentialMLP experts, each with its own adapter) over 2
expert-parallel ranks. Their bases are the models of tests/fixtures/data/megatron/core0.19.2/tp2-pp1 and
tp1-pp1-dp2-moe (the same weights, bit for bit), whose Hugging Face exports the adapters load onto.

The oracles: the live TP=2 model's own logits with and without its adapters (megatron-core's forward,
gathered over TP), and peft itself: `PeftModel.from_pretrained` of the `--adapter` folder onto the base,
and its `merge_and_unload()` against the `--merge-adapter` export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardstore
from tests.conftest import assert_bitwise_equal
from tests.refusals import assert_refused, cli

DATA = Path(__file__).parents[1] / "fixtures" / "data" / "megatron" / "core0.19.2"
WHOLE, ADAPTER_ONLY = DATA / "tp2-pp1-lora", DATA / "tp2-pp1-lora-adapter-only"
MOE = DATA / "tp1-pp1-ep2-moe-lora"
# each whole save, and the checkpoint of its base model (the same weights, bit for bit)
BASES = {WHOLE: DATA / "tp2-pp1", ADAPTER_ONLY: DATA / "tp2-pp1", MOE: DATA / "tp1-pp1-dp2-moe"}
RUN_CONFIG = "iter_0000010/run_config.yaml"
HF = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERTS = 4  # the MoE model's


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The Hugging Face folder of a save's base model (the base checkpoint's own export), checked against
    the live model's logits with its adapters disabled; made once per base."""
    made: dict[Path, Path] = {}

    def base(src: Path) -> Path:
        if BASES[src] not in made:
            out = tmp_path_factory.mktemp("base") / "hf"
            shardstore.unshard(BASES[src], out, format="hf", jobs=1)
            torch.testing.assert_close(_logits(_hf(out), src), _ref(src)["base_logits"], rtol=1e-4, atol=1e-4)
            made[BASES[src]] = out
        return made[BASES[src]]
    return base


def _ref(src: Path) -> dict[str, Any]:
    ref: dict[str, Any] = torch.load(f"{WHOLE if src == ADAPTER_ONLY else src}.expected.pt.ref", weights_only=True)
    return ref


def _hf(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _logits(model: Any, src: Path) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=_ref(src)["ids"]).logits
    return logits


def _adapted(src: Path) -> list[str]:
    """The Hugging Face modules a save's adapter adapts: attention's, and the MLP's (each expert's)."""
    mlps = [f"mlp.{p}" for p in HF[4:]] if src != MOE else \
        [f"block_sparse_moe.experts.{e}.{p}" for e in range(EXPERTS) for p in ("w1", "w3", "w2")]
    return [f"model.layers.{i}.{m}" for i in range(2) for m in [f"self_attn.{p}" for p in HF[:4]] + mlps]


@pytest.mark.parametrize("src", [WHOLE, ADAPTER_ONLY, MOE], ids=["whole", "adapter-only", "moe"])
def test_the_adapter_folder_loads_onto_the_base_with_the_live_logits(src: Path, bases: Any, tmp_path: Path) -> None:
    """`--adapter`: peft's names for the Hugging Face modules (linear_qkv's A for each of q, k and v, its B
    split per query group as the weight; linear_fc1's for gate and up; each expert's its own), r and alpha
    from Bridge's run_config.yaml; peft loads it onto the base with the live LoRA model's logits."""
    from peft import PeftModel
    from safetensors.torch import load_file

    out = tmp_path / "adapter"
    proc = cli("unshard", src, out, "--format", "hf", "--adapter", "-q")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"], config["use_dora"]) == (4, 8, False, False)
    assert sorted(config["target_modules"]) == sorted({m.rsplit(".", 1)[-1] for m in _adapted(src)})
    written = load_file(out / "adapter_model.safetensors")
    assert sorted(written) == sorted(f"base_model.model.{m}.lora_{ab}.weight" for m in _adapted(src) for ab in "AB")
    megatron = _ref(src)["model"]
    for i in range(2):  # A whole for each projection of a fused linear
        a = megatron[f"decoder.layers.{i}.self_attention.linear_qkv.adapter.linear_in.weight"]
        for proj in HF[:3]:
            assert torch.equal(written[f"base_model.model.model.layers.{i}.self_attn.{proj}.lora_A.weight"], a)
    loaded = PeftModel.from_pretrained(_hf(bases(src)), out).eval()
    torch.testing.assert_close(_logits(loaded, src), _ref(src)["logits"], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(_ref(src)["logits"], _ref(src)["base_logits"], atol=1e-2)  # (the adapter matters)
    if src == ADAPTER_ONLY:  # the same adapter as the whole save's
        whole = tmp_path / "whole"
        shardstore.unshard(WHOLE, whole, format="hf", adapter=True, jobs=1)
        assert_bitwise_equal(written, load_file(whole / "adapter_model.safetensors"), "adapter")
    assert shardstore.verify(src, out, jobs=1).ok


@pytest.mark.parametrize("src", [WHOLE, MOE], ids=["dense", "moe"])
def test_the_merged_model_is_peft_merging_the_adapter_and_has_the_live_logits(src: Path, bases: Any,
                                                                               tmp_path: Path) -> None:
    """`--merge-adapter` of a whole save: each Hugging Face module's rows of the fused weight merged with
    the same rows of B, in float32; what peft's merge_and_unload() makes of the adapter on the base, and
    the live model's logits."""
    from peft import PeftModel
    from safetensors.torch import load_file

    shardstore.unshard(src, tmp_path / "adapter", format="hf", adapter=True, jobs=1)
    result = shardstore.unshard(src, tmp_path / "merged", format="hf", merge_adapter=True, jobs=1)
    assert any(f"merged the LoRA adapter (r=4, alpha=8) into {len(_adapted(src))} modules" in note
               for note in result.notes)
    base = bases(src)
    merged = PeftModel.from_pretrained(_hf(base), tmp_path / "adapter").merge_and_unload().state_dict()
    loaded = _hf(tmp_path / "merged").state_dict()  # (transformers >= 5 fuses an MoE's experts as it loads them)
    assert sorted(loaded) == sorted(merged)
    for key, value in merged.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=1e-6, msg=key)
    written = load_file(tmp_path / "merged" / "model.safetensors")
    assert not torch.equal(written["model.layers.0.self_attn.k_proj.weight"],
                           load_file(base / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"])
    torch.testing.assert_close(_logits(_hf(tmp_path / "merged"), src), _ref(src)["logits"], rtol=1e-4, atol=1e-4)
    assert shardstore.verify(src, tmp_path / "merged", merge_adapter=True, jobs=1).ok
    # --format safetensors: the same weights, under the Hugging Face names
    shardstore.unshard(src, tmp_path / "st", merge_adapter=True, jobs=1)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), written, "safetensors", ordered=True)
    assert shardstore.verify(src, tmp_path / "st", merge_adapter=True, jobs=1).ok


def test_the_adapter_only_save_is_merged_onto_the_base_folder(bases: Any, tmp_path: Path) -> None:
    """Bridge's adapter-only save with `--base` (the base's Hugging Face folder): the merged model is the
    whole save's merged export, byte for byte."""
    shardstore.unshard(ADAPTER_ONLY, tmp_path / "onto", format="hf", merge_adapter=True, base=str(bases(WHOLE)),
                       jobs=1)
    shardstore.unshard(WHOLE, tmp_path / "merged", format="hf", merge_adapter=True, jobs=1)
    from safetensors.torch import load_file

    assert_bitwise_equal(load_file(tmp_path / "onto" / "model.safetensors"),
                         load_file(tmp_path / "merged" / "model.safetensors"), "merged")
    torch.testing.assert_close(_logits(_hf(tmp_path / "onto"), WHOLE), _ref(WHOLE)["logits"], rtol=1e-4, atol=1e-4)


def test_a_plain_export_says_what_the_checkpoint_holds(tmp_path: Path) -> None:
    assert_refused(cli("unshard", WHOLE, tmp_path / "hf", "--format", "hf", "-q"),
                   "holds a LoRA model", ".adapter.linear_in.weight", "--adapter", "--merge-adapter")
    assert not (tmp_path / "hf").exists()


def _run(tmp_path: Path, src: Path, edit: Any) -> Path:
    """A copy of `src` whose run_config.yaml `edit` rewrites."""
    run = shutil.copytree(src, tmp_path / "run")
    config = run / RUN_CONFIG
    config.write_text(edit(config.read_text()))
    return run


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.replace("  dim: 4\n", "  dim: 8\n"), "run_config.yaml: r is 8, but the adapter's lora_A have [4] rows"),
    (lambda t: t.replace("  - linear_fc2\n", ""), "do not name decoder.layers.0.mlp.linear_fc2"),
    (lambda t: t.replace("megatron.bridge.peft.lora.LoRA", "megatron.bridge.peft.dora.DoRA"),
     "run_config.yaml: peft is 'megatron.bridge.peft.dora.DoRA'"),
    (lambda t: t.replace("  normalize_moe_lora: false", "  normalize_moe_lora: true"), "normalize_moe_lora")],
    ids=["rank", "targets", "dora", "moe-ranks"])
def test_a_run_config_of_another_run_is_refused_before_any_rank_is_read(edit: Any, needle: str,
                                                                        tmp_path: Path) -> None:
    run = _run(tmp_path, ADAPTER_ONLY, edit)
    assert_refused(cli("unshard", run, tmp_path / "out", "--format", "hf", "--adapter", "-q"), needle)
    assert not (tmp_path / "out").exists()


def test_what_the_save_does_not_say_is_asked_for(tmp_path: Path) -> None:
    """Without Bridge's run_config.yaml (NeMo's and veRL's Megatron saves keep their LoRA's alpha
    elsewhere), alpha is asked for; Megatron's LoRA has no rsLoRA."""
    run = shutil.copytree(ADAPTER_ONLY, tmp_path / "run")
    (run / RUN_CONFIG).unlink()
    assert_refused(cli("unshard", run, tmp_path / "out", "--format", "hf", "--adapter", "--hf-config",
                       _config(tmp_path), "-q"), "--lora-alpha A")
    assert_refused(cli("unshard", run, tmp_path / "out", "--format", "hf", "--adapter", "--hf-config",
                       _config(tmp_path), "--lora-alpha", "8", "--rslora", "-q"), "it has no rsLoRA")
    proc = cli("unshard", run, tmp_path / "out", "--format", "hf", "--adapter", "--hf-config", _config(tmp_path),
               "--lora-alpha", "8", "-q")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["lora_alpha"] == 8


def _config(tmp_path: Path) -> Path:
    """The base's Hugging Face config (what describes an adapter-only save without Bridge's run_config)."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=100, head_dim=4).save_pretrained(tmp_path / "config")
    return tmp_path / "config" / "config.json"


def test_an_adapter_without_its_pair_is_refused_naming_it(tmp_path: Path) -> None:
    """A copy of the whole save whose .metadata lost linear_proj's linear_out: refused naming the module."""
    import pickle

    run = shutil.copytree(WHOLE, tmp_path / "run")
    metadata = run / "iter_0000010" / ".metadata"
    with metadata.open("rb") as f:
        saved = pickle.load(f)  # (the test's own copy of the fixture: trusted)
    gone = "decoder.layers.self_attention.linear_proj.adapter.linear_out.weight"
    del saved.state_dict_metadata[gone]
    saved.storage_data = {index: data for index, data in saved.storage_data.items() if index.fqn != gone}
    with metadata.open("wb") as f:
        pickle.dump(saved, f)
    assert_refused(cli("unshard", run, tmp_path / "out", "--format", "hf", "--adapter", "-q"),
                   "linear_proj.adapter.linear_in.weight: the adapter of decoder.layers.0.self_attention.linear_proj "
                   "has no linear_out")


def test_verls_megatron_lora_run_gives_bridges_own_adapter(bases: Any, tmp_path: Path) -> None:
    """veRL's Megatron actor of a LoRA run (layout v2, tests/fixtures/verl_megatron_lora.py): the adapter-only
    dist_ckpt beside the adapter Megatron-Bridge's own `save_hf_adapter` wrote into huggingface/adapter/.
    `--adapter` of the dist_ckpt is that adapter, bit for bit, and its config veRL's; merged onto the base,
    the live model's logits."""
    from safetensors.torch import load_file

    run = DATA / "tp2-pp1-lora-verl2"
    bridge = run / "global_step_10" / "actor" / "model" / "huggingface" / "adapter"
    shardstore.unshard(run, tmp_path / "adapter", format="hf", adapter=True, jobs=1)
    assert_bitwise_equal(load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
                         load_file(bridge / "adapter_model.safetensors"), "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((bridge / "adapter_config.json").read_text())
    shardstore.unshard(run, tmp_path / "merged", format="hf", merge_adapter=True, base=str(bases(WHOLE)), jobs=1)
    torch.testing.assert_close(_logits(_hf(tmp_path / "merged"), WHOLE), _ref(WHOLE)["logits"], rtol=1e-4, atol=1e-4)


def test_a_base_of_another_model_is_refused_naming_the_module(bases: Any, tmp_path: Path) -> None:
    """The dense adapter-only save onto the MoE model's folder (the same attention, experts for its MLP):
    refused before any rank is read, naming the first module the base lacks."""
    assert_refused(cli("unshard", ADAPTER_ONLY, tmp_path / "out", "--format", "hf", "--merge-adapter", "--base",
                       bases(MOE), "-q"),
                   "model.layers.0.mlp.down_proj.weight is missing, but the adapter of "
                   "base_model.model.model.layers.0.mlp.down_proj makes [16, 32]: an adapter of another model")
    assert not (tmp_path / "out").exists()


LEGACY = DATA / "tp2-pp2-lora-legacy"


def test_a_torch_format_lora_is_merged_as_megatron_core_loads_it(tmp_path: Path) -> None:
    """Megatron-LM's `--ckpt-format torch` files of the LoRA model at TP=2, PP=2 (tests/fixtures/
    megatron_lora_legacy.py): each adapter's TP parts joined as its linear's input and output are split
    (A on r for linear_qkv and linear_fc1, on its input for linear_proj and linear_fc2; every B on its rows,
    fc1's [gate; up] on each rank), bit for bit megatron-core's own single-process load; merged with the
    alpha the files do not say, the live model's logits."""
    from safetensors.torch import load_file

    ref: dict[str, Any] = torch.load(f"{LEGACY}.expected.pt.ref", weights_only=True)
    shardstore.unshard(LEGACY, tmp_path / "st", jobs=1)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), ref["model"], "torch format")
    assert_refused(cli("unshard", LEGACY, tmp_path / "no-alpha", "--format", "hf", "--merge-adapter", "-q"),
                   "give it as trained: --lora-alpha A")
    shardstore.unshard(LEGACY, tmp_path / "merged", format="hf", merge_adapter=True, lora_alpha=8.0, jobs=1)
    with torch.no_grad():
        logits = _hf(tmp_path / "merged")(input_ids=ref["ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, needle", [("tp2-pp1-dora", "linear_proj.adapter.weight_magnitude"),
                                          ("tp2-pp1-canonical-lora", "linear_qkv.adapter.adapter_q.linear_in.weight")])
def test_bridges_dora_and_canonical_lora_are_refused_by_name_and_written_as_saved(name: str, needle: str,
                                                                                   tmp_path: Path) -> None:
    """Megatron-Bridge's own DoRA and CanonicalLoRA at TP=2 (tests/fixtures/megatron_lora.py): their saves do
    not hold the trained adapter as one model (the fixture's README: DoRA's row-parallel magnitudes per
    rank, CanonicalLoRA's fc1 rows in TP order), so they are refused by name before any rank is read;
    --format safetensors writes what was saved, as megatron-core's own single-process load has it."""
    from safetensors.torch import load_file

    src = DATA / name
    for flag in ("--adapter", "--merge-adapter"):
        assert_refused(cli("unshard", src, tmp_path / flag, "--format", "hf", flag, "-q"), needle,
                       "Megatron-Bridge's DoRA or CanonicalLoRA")
    shardstore.unshard(src, tmp_path / "st", jobs=1)
    ref = torch.load(f"{src}.expected.pt.ref", weights_only=True)
    # (the local spec's norms, saved under Transformer Engine's names as megatron-core maps them)
    saved = {k.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
             .replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"): v for k, v in ref["model"].items()}
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), saved, name)
