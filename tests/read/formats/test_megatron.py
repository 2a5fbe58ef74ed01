"""Megatron-Core `torch_dist` checkpoints written by megatron-core 0.19.2's own `dist_checkpointing.save`
(tests/fixtures/megatron_core.py; the files are kept in tests/fixtures/data/megatron/), against what
megatron-core's own `dist_checkpointing.load` gives one TP=1, PP=1 process.

A torch_dist folder is DCP underneath, read as a DCP checkpoint whose layers, saved stacked on a leading
axis, come out under Megatron's own per-layer names (Transformer-Engine-style norm names kept). The
optimizer's state, after two training steps through Megatron's DDP and DistributedOptimizer, is compared
with what the live ranks held.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.read.discover import open_source
from tests.read.conformance import FormatTests

MEGATRON = Path(__file__).parents[2] / "fixtures" / "data" / "megatron"
DATA = MEGATRON / "core0.19.2"
# The local layer spec's module names -> the names its sharded state dict gives them (Transformer
# Engine's, whose norms live inside the next linear layer)
SAVED_AS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _saved_names(want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron's per-layer state dict under the names its sharded state dict gives the norms (the local
    MLA spec keeps its own), and a multi-token-prediction layer's inner layer (`transformer_layer`)."""
    out = {}
    for key, value in want.items():
        m = re.fullmatch(r"(decoder\.layers\.\d+\.)(.*)", key)
        mla = m is not None and f"{m.group(1)}self_attention.linear_kv_up_proj.weight" in want
        key = re.sub(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.", r"\1transformer_layer.", key)
        out[m.group(1) + SAVED_AS.get(m.group(2), m.group(2)) if m and not mla else key] = value
    return out


LAYOUTS = ["tp1-pp1", "tp2-pp1", "tp1-pp2", "tp2-pp2", "tp2-pp1-qwen2", "tp2-pp1-qwen3", "tp2-pp1-tied",
           "tp2-pp1-layers", "tp2-pp1-dp2-optim", "tp2-pp1-dp2-optim-full", "tp2-pp2-optim", "tp1-pp1-dp2-moe",
           "tp2-pp1-dp2-bf16-optim",  # Megatron-LM's --bf16: bf16 weights, the optimizer's fp32 main params
           # MoE at expert parallel 2: Qwen3-MoE's q and k norms; Qwen2-MoE's gated shared expert, softmax first
           "tp1-pp1-dp2-qwen3moe", "tp1-pp1-dp2-qwen2moe",
           # DeepSeek-V3's blocks: a dense first layer, MLA, a shared expert, an expert bias, one MTP layer
           "tp1-pp1-dp2-dsv3",
           # megatron-core <= 0.18: the common state in common.pt beside the .distcp files
           "../core0.16.1/tp2-pp1", "../core0.16.1/tp2-pp2-optim", "../core0.16.1/tp2-pp1-dp2-optim-full",
           # megatron-core <= 0.15's default optimizer form, written with torch 2.6
           "../core0.12.2/tp2-pp1-dp2-optim-model-space"]
OPTIM = [layout for layout in LAYOUTS if "optim" in layout]


def _common(got: dict) -> dict:
    """Megatron's common state as the export holds it: megatron-core >= 0.19 keeps it as a bytes item in
    the files (a one-element list), <= 0.18 in common.pt."""
    return got["common_state/shard_0_1"][0] if "common_state/shard_0_1" in got else got["common_state"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_parallel_layout_reads_per_layer_as_megatron_core_loads_it(layout: str, tmp_path: Path) -> None:
    """Layers saved stacked on a leading axis (or per layer: `-layers`) come out under Megatron's
    per-layer names, in layer order, under `model` as Megatron-LM's torch format nests them; safetensors
    holds the model alone; --format dcp holds it as torch reads it back."""
    from safetensors.torch import load_file

    src = DATA / layout
    assert open_source(src).format == "dcp" and "/iter_0000010/" in open_source(src).units[0]  # the latest
    want = _saved_names(torch.load(f"{src}.expected.pt.ref", weights_only=True)["model"])
    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=2)
    got = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=False)  # Megatron-LM's args: a Namespace
    model = got["model"]
    tensors = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(want)
    for key, value in want.items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key
    layers = [int(k.split(".")[2]) for k in model if k.startswith("decoder.layers.")]
    assert layers == sorted(layers)  # layer by layer, as Megatron's own state dict is
    common = _common(got)
    assert common["iteration"] == 10 and common["args"].num_attention_heads == 4 and common["checkpoint_version"] == 3.0
    assert ("output_layer.weight" in model) == (not layout.endswith("tied"))  # tied: the embedding is the output
    extra = {k: v for k, v in model.items() if k.endswith("._extra_state")}
    # attention's two, the MLP's two (or each expert's, and the shared expert's)
    per_layer = 2 + (8 + 2 * layout.endswith("qwen2moe") if layout.endswith("moe") else 2)
    # DeepSeek-V3's: MLA's five linear layers, a dense MLP's two, then two MoE layers' experts and shared
    # expert; the MTP layer's eh_proj and its inner MoE layer
    count = 5 + 2 + 2 * (5 + 8 + 2) + 1 + (5 + 8 + 2) if layout.endswith("dsv3") else 2 * per_layer
    assert len(extra) == count and all(v in ([None], None) for v in extra.values())  # the local spec's
    assert set(got) - {"model", "common_state/shard_0_1", "common_state"} == ({"optimizer"} if "optim" in layout else set())
    shardstore.unshard(src, tmp_path / "st", jobs=2)
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert set(st) == set(want) and all(torch.equal(st[k], v) for k, v in want.items())
    _same_as_dcp(src, tmp_path, want)


def _same_as_dcp(src: Path, tmp_path: Path, want: dict[str, torch.Tensor]) -> None:
    """--format dcp, read back by torch's own dcp_to_torch_save: the model bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    shardstore.unshard(src, tmp_path / "dcp", format="dcp", jobs=2)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    model = torch.load(tmp_path / "dcp.pt", weights_only=False)["model"]
    assert {k for k, v in model.items() if isinstance(v, torch.Tensor)} == set(want)
    assert all(torch.equal(model[k], v) for k, v in want.items())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().flatten().view(torch.uint8)


def _per_layer(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The live ranks' optimizer state under the per-layer names: a stacked key's leading axis split."""
    out = {}
    for key, value in saved.items():
        head, sep, tail = key.partition("decoder.layers.")
        if sep and not tail[0].isdigit():
            out.update({f"{head}{sep}{i}.{tail}": value[i] for i in range(value.shape[0])})
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("layout", OPTIM)
@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_the_distributed_optimizer_state_is_what_the_live_ranks_held(layout: str, fmt: str, tmp_path: Path) -> None:
    """After two steps of Megatron's DDP + DistributedOptimizer: `fully_reshardable` state per parameter
    (param, exp_avg, exp_avg_sq shaped like the model's, per layer), `fully_sharded_model_space`'s
    flattened ranges of each parameter's blocks put back in their places, `dp_reshardable` as its flat buckets
    (one per TP x PP rank, each the data-parallel ranks' parts end to end) and said so; bit for bit what
    the live ranks held, the param_groups with their `step` beside them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = DATA / layout
    want = _per_layer(torch.load(f"{src}.expected.pt.ref", weights_only=True)["optimizer"])
    result = shardstore.unshard(src, tmp_path / "out", format=fmt, jobs=2)
    assert any("flat buckets" in n for n in result.notes) == layout.endswith("-optim")
    if fmt == "dcp":  # torch's own reading of the export
        dcp_to_torch_save(tmp_path / "out", tmp_path / "dcp.pt")
    got = torch.load(tmp_path / ("out/checkpoint.pt" if fmt == "torch" else "dcp.pt"), weights_only=False)
    optimizer = got["optimizer"]
    tensors = {k: v for k, v in optimizer.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(want) and len(want) >= 6
    for key, value in want.items():  # bit for bit: a bucket's padding is whatever memory held (NaN too)
        assert tensors[key].dtype == value.dtype and torch.equal(_bits(tensors[key]), _bits(value)), key
    if layout.endswith("-optim"):
        groups = next(v for k, v in optimizer.items() if k.endswith(".optimizer/shard_0_1"))[0]["param_groups"]
    else:  # per parameter, per layer, shaped like the model's (fully_reshardable, fully_sharded_model_space)
        assert any(k.startswith("optimizer.state.exp_avg.decoder.layers.1.") for k in tensors)
        assert tensors["optimizer.state.exp_avg.output_layer.weight"].shape == got["model"]["output_layer.weight"].shape
        groups = _common(got)["optimizer"]["optimizer"]["param_groups"]
    assert [g["step"] for g in groups] == [2.0, 2.0]  # two steps, in every group


def test_a_megatron_lm_run_folder_gives_the_iteration_its_pointer_names(tmp_path: Path) -> None:
    """Megatron-LM's save_checkpoint: iter_{N:07d}/ folders beside latest_checkpointed_iteration.txt."""
    run = tmp_path / "run"
    for step in (10, 20):
        shutil.copytree(DATA / "tp2-pp1" / "iter_0000010", run / f"iter_{step:07d}")
    (run / "latest_checkpointed_iteration.txt").write_text("20")
    assert open_source(run).units[0].startswith(str(run / "iter_0000020"))
    assert open_source(run, step=10).units[0].startswith(str(run / "iter_0000010"))


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 16, "tie_word_embeddings": False,
         "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "head_dim": 4, "dtype": "float32"}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("described", ["args", "hf-config"])
def test_hf_export_gives_megatrons_own_logits(layout: str, described: str, tmp_path: Path) -> None:
    """q, k and v taken per query group, fc1 split into gate and up, norms renamed: transformers' Llama
    reproduces the logits Megatron's own forward gave (float32; the two order their sums differently).
    The model is described by Megatron-LM's own args in the checkpoint, or by a config.json given."""
    from transformers import AutoModelForCausalLM

    config = dict(LLAMA, tie_word_embeddings=layout.endswith("tied"))
    if layout.endswith("qwen2"):  # q, k and v with biases, split per query group like their weights
        config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
        del config["attention_bias"], config["mlp_bias"], config["head_dim"]
    if layout.endswith("qwen3"):  # a norm over each head's q and k (qk_layernorm), heads of 8 in a width of 16
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=8)
    sparse = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
              "mlp_only_layers": []}
    if layout.endswith("qwen3moe"):  # Mixtral's routing, Qwen3's q and k norms, the hub's Qwen names
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=8, norm_topk_prob=True,
                      **sparse)
    elif layout.endswith("qwen2moe"):  # softmax over every expert, a shared expert behind its sigmoid gate
        config.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", norm_topk_prob=False,
                      shared_expert_intermediate_size=32, **sparse)
        del config["attention_bias"], config["mlp_bias"], config["head_dim"]
    elif layout.endswith("moe"):  # 4 experts, top 2: each expert's fc1 split into w1 and w3
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                      num_experts_per_tok=2)
    elif layout.endswith("dsv3"):  # the hub's DeepSeek-V3 config.json, at the fixture's sizes
        config = DEEPSEEK_V3
    (tmp_path / "config.json").write_text(json.dumps(config))
    src = DATA / layout
    given = tmp_path / "config.json" if described == "hf-config" else None
    result = shardstore.unshard(src, tmp_path / "hf", format="hf", hf_config=given, jobs=2)
    assert any("padded" in n for n in result.notes) == (given is None)
    want = torch.load(f"{src}.expected.pt.ref", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()  # bf16 runs too
    with torch.no_grad():
        got = model(input_ids=want["ids"]).logits
    # float32 sums in another order: ~1e-5 of logits that reach ~20 (every weight drawn from N(0, 1)); a
    # wrong split is off by whole units
    torch.testing.assert_close(got, want["logits"], rtol=1e-4, atol=1e-4)
    assert type(model).__name__ == config["architectures"][0]
    if layout.endswith("dsv3"):  # the MTP layer, which transformers does not build: the hub's layer N's names
        _mtp_is_the_hubs_layer_after_the_last(tmp_path / "hf", want["model"])
        assert any("multi-token-prediction layer(s) are model.layers.3" in n for n in result.notes)
    # a plain q|k|v split would be the same rows read wrongly; DeepSeek's q heads of v's width, v's of q's
    wrong = dict(config, **({"qk_nope_head_dim": 6, "v_head_dim": 4} if layout.endswith("dsv3") else
                            {"num_key_value_heads": 4}))
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    with pytest.raises(Exception, match="shape"):
        shardstore.unshard(src, tmp_path / "hf2", format="hf", hf_config=tmp_path / "wrong.json", jobs=1)
    count = next((k for k in ("num_local_experts", "num_experts", "n_routed_experts") if k in config), None)
    if count is not None:  # a config of another expert count: the router's rows say so, before a byte is written
        (tmp_path / "experts.json").write_text(json.dumps({**config, count: 3}))
        with pytest.raises(shardstore.ExportError, match=r"mlp\.router\.weight: shape \[4, 16\], the config makes it"):
            shardstore.unshard(src, tmp_path / "hf3", format="hf", hf_config=tmp_path / "experts.json", jobs=1)
        assert not (tmp_path / "hf3" / "model.safetensors").exists()


# DeepSeek-V3's config.json as the hub writes it (rope_theta and rope_scaling, the fields transformers 4 and 5
# read), at tests/fixtures/data/megatron/core0.19.2/tp1-pp1-dp2-dsv3's sizes
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 16,
               "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 4,
               "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 2, "num_experts_per_tok": 2,
               "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
               "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 1, "q_lora_rank": 12,
               "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 6,
               "num_nextn_predict_layers": 1, "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
               "max_position_embeddings": 16384, "tie_word_embeddings": False, "hidden_act": "silu",
               "attention_bias": False, "rope_interleave": True, "dtype": "float32"}


def _mtp_is_the_hubs_layer_after_the_last(hf: Path, want: dict[str, torch.Tensor], layers: int = 3) -> None:
    from safetensors.torch import load_file

    got = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()}
    mtp, layer = "mtp.layers.0.", "mtp.layers.0.mtp_model_layer."
    pairs = {"enorm.weight": f"{mtp}enorm.weight", "hnorm.weight": f"{mtp}hnorm.weight",
             "eh_proj.weight": f"{mtp}eh_proj.weight", "shared_head.norm.weight": f"{mtp}final_layernorm.weight",
             "self_attn.kv_b_proj.weight": f"{layer}self_attention.linear_kv_up_proj.weight",
             "mlp.gate.e_score_correction_bias": f"{layer}mlp.router.expert_bias",
             "mlp.experts.3.down_proj.weight": f"{layer}mlp.experts.local_experts.3.linear_fc2.weight"}
    assert all(torch.equal(got[f"model.layers.{layers}.{k}"], want[v]) for k, v in pairs.items())
    assert not any(k.startswith(f"model.layers.{layers + 1}.") for k in got)


def test_a_config_naming_only_its_model_type_is_taken_as_transformers_takes_it(tmp_path: Path) -> None:
    """`LlamaConfig(...).save_pretrained()` writes model_type and no architectures; transformers' Auto
    classes load such a folder as Llama, and so does the export (it used to refuse "architecture None")."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("architectures", "model_type")}).save_pretrained(
        tmp_path / "config")
    assert "architectures" not in json.loads((tmp_path / "config" / "config.json").read_text())
    src = DATA / LAYOUTS[0]
    shardstore.unshard(src, tmp_path / "hf", format="hf", hf_config=tmp_path / "config" / "config.json", jobs=1)
    want = torch.load(f"{src}.expected.pt.ref", weights_only=True)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()(input_ids=want["ids"])
    torch.testing.assert_close(got.logits, want["logits"], rtol=1e-4, atol=1e-4)
    (tmp_path / "gpt2.json").write_text(json.dumps({**LLAMA, "architectures": None, "model_type": "gpt2"}))
    with pytest.raises(shardstore.ExportError, match="architecture 'model_type gpt2'"):
        shardstore.unshard(src, tmp_path / "hf2", format="hf", hf_config=tmp_path / "gpt2.json", jobs=1)


def test_a_common_state_the_metadata_names_must_be_there(tmp_path: Path) -> None:
    """megatron-core <= 0.18: metadata.json names common.pt; without it the args, the iteration and the
    optimizer's param_groups would be lost, so the folder is refused, as is a backend shardstore does not
    read."""
    src = tmp_path / "ckpt"
    shutil.copytree(MEGATRON / "core0.16.1" / "tp2-pp1" / "iter_0000010", src)
    (src / "common.pt").unlink()
    with pytest.raises(shardstore.CheckpointError, match=r"metadata.json: names a common state \(common.pt\)"):
        shardstore.unshard(src, tmp_path / "out", format="torch")
    (src / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    with pytest.raises(shardstore.CheckpointError, match="sharded_backend is 'zarr'"):
        shardstore.unshard(src, tmp_path / "out", format="torch")
    assert not (tmp_path / "out").exists()


def test_the_local_plans_megatron_keeps_in_its_metadata_are_not_built(monkeypatch, tmp_path: Path) -> None:
    """megatron-core keeps every rank's local save plan in .metadata (`all_local_plans`: the checkpoint's
    write items once more). Nothing reads them, so each is built as one shared placeholder (DeepSeek-V3's
    at EP 64 were 136 MB of objects in every process); the model still reads as megatron-core loads it."""
    from safetensors.torch import load_file

    from shardstore.read.formats import dcp
    from shardstore.read.primitives.unpickle import UNREAD, DcpMetadata

    built: list[DcpMetadata] = []
    real = dcp.load

    def load(*args, **kwargs):  # type: ignore[no-untyped-def]
        value = real(*args, **kwargs)
        if isinstance(value, DcpMetadata):
            built.append(value)
        return value

    monkeypatch.setattr(dcp, "load", load)
    monkeypatch.setattr(dcp, "_LAST_TORCH_DIST", {})  # read afresh, not the parse an earlier test kept
    src = DATA / "tp2-pp1"
    shardstore.unshard(src, tmp_path / "st", jobs=1)
    plans = built[0].all_local_plans
    assert len(plans) == 2 and all(plan is UNREAD for plan in plans)
    want = _saved_names(torch.load(f"{src}.expected.pt.ref", weights_only=True)["model"])
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert set(st) == set(want) and all(torch.equal(st[k], v) for k, v in want.items())


# Where each trainer keeps megatron-core's torch_dist folder, and what a user may point shardstore at
TRAINERS = {"tp2-pp1-nemo": ["", "weights"],  # NeMo 2: weights/ beside context/
            "tp2-pp1-verl": ["", "global_step_10", "global_step_10/actor"],  # veRL: actor/dist_ckpt/
            "tp2-pp1-verl2": ["", "global_step_10", "global_step_10/actor"]}  # veRL v2: actor/model/dist_ckpt/


@pytest.mark.parametrize("layout", list(TRAINERS))
def test_nemo_and_verl_folders_are_found_without_flags_and_export_megatrons_logits(layout: str,
                                                                                   tmp_path: Path) -> None:
    """NeMo 2's checkpoint folder and veRL's Megatron run, step and actor folders are found as they are;
    NeMo's `module.` prefix goes (the names are Megatron's); --format hf describes the model from NeMo's
    context/model.yaml or veRL's huggingface/config.json and reproduces Megatron's own logits."""
    from transformers import AutoModelForCausalLM

    want = torch.load(DATA / f"{layout}.expected.pt.ref", weights_only=True)
    for i, given in enumerate(TRAINERS[layout]):
        src = DATA / layout / given
        shardstore.unshard(src, tmp_path / f"pt{i}", format="torch", jobs=2)
        got = torch.load(tmp_path / f"pt{i}" / "checkpoint.pt", weights_only=False)["model"]
        expected = _saved_names({k.removeprefix("module."): v for k, v in want["model"].items()})
        tensors = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
        assert set(tensors) == set(expected)
        assert all(torch.equal(tensors[k], v) for k, v in expected.items())
    result = shardstore.unshard(DATA / layout, tmp_path / "hf", format="hf", jobs=2)
    assert any("padded" in n for n in result.notes) == layout.endswith("nemo")  # veRL's config names the vocab
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(input_ids=want["ids"]).logits
    torch.testing.assert_close(logits, want["logits"], rtol=1e-4, atol=1e-4)


def _same(a: object, b: object) -> bool:
    """Equal as saved: the same keys in the same order, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("layout", ["tp2-pp1-legacy", "tp2-pp2-legacy", "tp2-pp2-dp2-legacy-optim"])
def test_megatron_lm_torch_format_merges_by_megatrons_partition_rules(layout: str, tmp_path: Path) -> None:
    """`--ckpt-format torch`: one file per TP x PP rank (mp_rank_TT[_PPP]/model_optim_rng.pt), each with
    its own part of every tensor and its stage's layers from 0. Merged (column-parallel on dim 0, row-
    parallel on dim 1, SwiGLU's [gate; up] per rank, layers renumbered), it is bit for bit the model
    megatron-core's own load gives one process; each file's other values (and after training, the
    distributed optimizer's distrib_optim.pt beside it) are kept under ranks/ as saved; the
    Hugging Face export, described by the args, gives Megatron's logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = DATA / layout
    want = torch.load(f"{src}.expected.pt.ref", weights_only=True)
    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=2)
    got = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=False)
    tensors = {k: v for k, v in got["model"].items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(want["model"])
    assert all(torch.equal(tensors[k], v) for k, v in want["model"].items())
    layers = [int(k.split(".")[2]) for k in got["model"] if k.startswith("decoder.layers.")]
    assert layers == sorted(layers) and max(layers) == 1
    names = sorted(p.name for p in (src / "iter_0000010").iterdir())
    assert list(got["ranks"]) == sorted(names, key=lambda n: n[::-1])  # stage by stage, tensor rank by rank
    assert all(r["iteration"] == 10 and r["args"].tensor_model_parallel_size == 2 for r in got["ranks"].values())
    assert all(isinstance(r["rng_state"][0]["torch_rng_state"], torch.Tensor) for r in got["ranks"].values())
    for name in names if layout.endswith("optim") else []:  # the distributed optimizer's state, as saved
        saved = torch.load(src / "iter_0000010" / name / "distrib_optim.pt", weights_only=False)
        assert _same(got["ranks"][name]["distrib_optim"], saved)
        assert got["ranks"][name]["optimizer"]["optimizer"]["param_groups"][0]["step"] == 2
    shardstore.unshard(src, tmp_path / "st", jobs=2)
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert set(st) == set(want["model"]) and all(torch.equal(st[k], v) for k, v in want["model"].items())
    _same_as_dcp(src, tmp_path, want["model"])
    shardstore.unshard(src, tmp_path / "hf", format="hf", jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(input_ids=want["ids"]).logits
    torch.testing.assert_close(logits, want["logits"], rtol=1e-4, atol=1e-4)


def test_megatron_lm_torch_format_refuses_what_it_cannot_merge_exactly(tmp_path: Path) -> None:
    """A rank folder missing, one rank's file copied over another's (every length right), a file of
    another stage in a rank's place: each refused by name before anything is written."""
    src = tmp_path / "run" / "iter_0000010"
    shutil.copytree(DATA / "tp2-pp2-legacy" / "iter_0000010", src)
    rank = src / "mp_rank_01_001" / "model_optim_rng.pt"
    saved = rank.read_bytes()
    rank.unlink()
    with pytest.raises(shardstore.CheckpointError, match="mp_rank_01_001: has no model_optim_rng.pt"):
        shardstore.unshard(src, tmp_path / "out", format="torch")
    shutil.copy(src / "mp_rank_00_001" / "model_optim_rng.pt", rank)
    with pytest.raises(shardstore.CheckpointError, match="the same file as"):
        shardstore.unshard(src, tmp_path / "out", format="torch")
    rank.write_bytes(saved)
    other = DATA / "tp2-pp1-legacy" / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"  # a 1-stage save's
    shutil.copy(other, src / "mp_rank_01_000" / "model_optim_rng.pt")
    with pytest.raises(shardstore.CheckpointError, match=r"mp_rank_01_000/model_optim_rng.pt: .*layer 1 of a stage "
                                                         r"of 1 layers"):
        shardstore.unshard(src, tmp_path / "out", format="torch")
    assert not (tmp_path / "out").exists()


class TestMegatronTorchConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        return DATA / "tp2-pp2-legacy" / "iter_0000010"

    @pytest.fixture
    def foreign(self, tmp_path: Path) -> Path:
        return DATA / "tp2-pp1-legacy" / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"


class TestMegatronTorchDistConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        return DATA / "tp2-pp2-optim" / "iter_0000010"

    @pytest.fixture
    def foreign(self, tmp_path: Path) -> Path:
        return DATA / "tp2-pp1-dp2-optim" / "iter_0000010" / "__1_0.distcp"


@pytest.mark.parametrize("key, value", [("moe_router_pre_softmax", True), ("moe_router_score_function", "sigmoid"),
                                        ("moe_router_enable_expert_bias", True)])
def test_moe_routing_mixtral_cannot_follow_is_refused_by_name(key: str, value: object) -> None:
    """Megatron's MoE variants a Mixtral folder would load and then route differently: refused, naming the
    argument, rather than exported with silently different logits."""
    from shardstore.export.hf import megatron

    args = {"num_experts": 4, "moe_router_topk": 2, "num_attention_heads": 4, "hidden_size": 16, "num_layers": 2}
    assert megatron.config_from_args(args, "args")[0]["architectures"] == ["MixtralForCausalLM"]
    with pytest.raises(shardstore.ExportError, match=f"args: {key} is"):
        megatron.config_from_args({**args, key: value}, "args")


def test_a_moe_model_is_the_class_its_blocks_and_routing_are() -> None:
    """q and k norms make a MoE model Qwen3-MoE's; a shared expert Qwen2-MoE's, which holds only with its
    sigmoid gate, a softmax over every expert and q, k and v biases: what is missing is named."""
    from shardstore.export.hf import megatron

    args = {"num_experts": 4, "moe_router_topk": 2, "num_attention_heads": 4, "hidden_size": 16, "num_layers": 2,
            "kv_channels": 8}
    qwen3 = megatron.config_from_args({**args, "qk_layernorm": True}, "args")[0]
    assert (qwen3["architectures"], qwen3["model_type"], qwen3["head_dim"], qwen3["norm_topk_prob"]) == \
        (["Qwen3MoeForCausalLM"], "qwen3_moe", 8, True)
    qwen2 = {**args, "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True,
             "moe_router_pre_softmax": True, "add_qkv_bias": True}
    config = megatron.config_from_args(qwen2, "args")[0]
    assert (config["architectures"], config["shared_expert_intermediate_size"], config["norm_topk_prob"]) == \
        (["Qwen2MoeForCausalLM"], 32, False)
    for key in ("moe_shared_expert_gate", "moe_router_pre_softmax", "add_qkv_bias"):
        with pytest.raises(shardstore.ExportError, match=f"args: {key} is .*which Qwen2Moe cannot express"):
            megatron.config_from_args({**qwen2, key: False}, "args")
    with pytest.raises(shardstore.ExportError, match="args: qk_layernorm is True.*Qwen2Moe"):
        megatron.config_from_args({**qwen2, "qk_layernorm": True}, "args")


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 6), (2, 1, 3, 4)])
def test_a_flattened_range_becomes_boxes_that_are_exactly_its_elements(shape: tuple[int, ...]) -> None:
    """fully_sharded_model_space: a data-parallel rank holds elements [start, start + count) of a block,
    flattened. Every range, split into boxes, fills exactly those elements, each box a run of them."""
    from shardstore.read.formats.dcp import _flat_boxes

    total = int(torch.tensor(shape).prod())
    block = torch.arange(total).reshape(shape)
    for start in range(total):
        for count in range(1, total - start + 1):
            seen = []
            for first, offsets, sizes in _flat_boxes(shape, start, count):
                box = block[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].flatten()
                assert box.tolist() == list(range(start + first, start + first + box.numel()))  # a run
                seen += box.tolist()
            assert seen == list(range(start, start + count))
            assert len(_flat_boxes(shape, start, count)) <= 2 * len(shape) - 1
    with pytest.raises(shardstore.CheckpointError, match="outside a block"):
        _flat_boxes(shape, total - 1, 2)


def test_a_run_whose_pointer_says_release_gives_its_release_folder(tmp_path: Path) -> None:
    """Megatron-LM's checkpoints converted from elsewhere (from Hugging Face, for fine-tuning) live in
    release/, and latest_checkpointed_iteration.txt says `release`."""
    run = tmp_path / "run"
    shutil.copytree(DATA / "tp2-pp1" / "iter_0000010", run / "release")
    shutil.copytree(DATA / "tp2-pp1" / "iter_0000010", run / "iter_0000010")
    (run / "latest_checkpointed_iteration.txt").write_text("release")
    assert open_source(run).units[0].startswith(str(run / "release"))
    assert open_source(run, step=10).units[0].startswith(str(run / "iter_0000010"))


def _iteration(n: int):  # type: ignore[no-untyped-def]
    def change(state: dict) -> None:
        state["iteration"] = n
        state["args"].iteration = n
    return change


@pytest.mark.parametrize("layout", ["tp2-pp1-legacy", "tp2-pp2-dp2-legacy-optim"])
def test_megatron_lm_torch_format_refuses_rank_files_of_two_iterations(layout: str, tmp_path: Path) -> None:
    """Rank 1's model_optim_rng.pt of iteration 20 beside rank 0's of iteration 10 (every key and shape the
    same): refused in one line naming both files, nothing left; the same files in a folder whose name says
    another iteration than theirs too."""
    from tests.fixtures.forge import resaved
    from tests.refusals import assert_refused, cli

    src = tmp_path / "run" / "iter_0000010"
    shutil.copytree(DATA / layout / "iter_0000010", src)
    last = sorted(src.glob("mp_rank_*/model_optim_rng.pt"))[-1]
    resaved(last, last, _iteration(20))
    assert_refused(cli("unshard", src, tmp_path / "out", "-q"), f"{last}: records iteration 20, but "
                   f"{sorted(src.glob('mp_rank_*/model_optim_rng.pt'))[0]} records 10")
    assert not (tmp_path / "out").exists()
    renamed = tmp_path / "run" / "iter_0000020"
    shutil.rmtree(src)
    shutil.copytree(DATA / layout / "iter_0000010", renamed)
    assert_refused(cli("unshard", renamed, tmp_path / "out", "-q"), "records iteration 10, but its folder is "
                   "iter_0000020")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", [MEGATRON / "core0.16.1" / "tp2-pp1", DATA / "tp2-pp1"])  # common.pt; a bytes item
def test_torch_dist_common_state_of_another_iteration_is_refused(layout: Path, tmp_path: Path) -> None:
    """torch_dist's common state records the iteration save_checkpoint named iter_N/ by: in a folder of
    another name, refused in one line naming the file, nothing left."""
    from tests.refusals import assert_refused, cli

    src = tmp_path / "iter_0000020"
    shutil.copytree(layout / "iter_0000010", src)
    assert_refused(cli("unshard", src, tmp_path / "out", "-q"), str(src), "Megatron's common state: records "
                   "iteration 10, but its folder is iter_0000020")
    assert not (tmp_path / "out").exists()


# Megatron-LM's args of a DeepSeek-V3 model (tp1-pp1-dp2-dsv3's, as its scripts set them)
DEEPSEEK_ARGS = {"num_layers": 3, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 4,
                 "multi_latent_attention": True, "q_lora_rank": 12, "kv_lora_rank": 8, "qk_head_dim": 4,
                 "qk_pos_emb_head_dim": 4, "v_head_dim": 6, "qk_layernorm": True, "rotary_scaling_factor": 4.0,
                 "mscale": 1.0, "mscale_all_dim": 1.0, "num_experts": 4, "moe_layer_freq": [0, 1, 1],
                 "moe_ffn_hidden_size": 8, "moe_router_topk": 2, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
                 "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                 "moe_router_pre_softmax": True, "moe_router_topk_scaling_factor": 2.5,
                 "moe_shared_expert_intermediate_size": 16, "mtp_num_layers": 1}


@pytest.mark.parametrize("key, change", [
    ("moe_router_score_function", {"moe_router_score_function": "softmax"}),
    ("moe_router_enable_expert_bias", {"moe_router_enable_expert_bias": False}),  # HF adds a bias of its own
    # 2 of 4 groups scored by their top 1, HF's by their top 2
    ("moe_router_group_topk", {"moe_router_num_groups": 4, "moe_router_group_topk": 2}),
    ("moe_shared_expert_gate", {"moe_shared_expert_gate": True}),
    ("moe_shared_expert_intermediate_size", {"moe_shared_expert_intermediate_size": None}),
    ("moe_shared_expert_intermediate_size", {"moe_shared_expert_intermediate_size": 12}),  # 1.5 experts wide
    ("qk_layernorm", {"qk_layernorm": False}),  # MLA without its latents' norms
    ("moe_layer_freq", {"moe_layer_freq": [1, 0, 1]}), ("moe_layer_freq", {"moe_layer_freq": 2}),
    ("mtp_use_repeated_layer", {"mtp_use_repeated_layer": True}),
    ("rotary_scaling_factor", {"rope_type": "rope"})])  # YaRN's softmax scale beside plain rotary embeddings
def test_what_deepseek_v3_cannot_express_is_refused_by_name(key: str, change: dict) -> None:
    """Megatron's MLA models are DeepseekV3's; what its blocks or routing cannot follow is refused naming
    the argument, rather than exported with other logits."""
    from shardstore.export.hf import megatron

    config = megatron.config_from_args(DEEPSEEK_ARGS, "args")[0]
    assert (config["architectures"], config["first_k_dense_replace"], config["n_shared_experts"], config["n_group"],
            config["topk_group"], config["num_nextn_predict_layers"], config["rope_scaling"]["factor"]) == \
        (["DeepseekV3ForCausalLM"], 1, 2, 2, 1, 1, 4.0)
    with pytest.raises(shardstore.ExportError, match=f"^args: {key} is .*which DeepseekV3 cannot express$"):
        megatron.config_from_args({**DEEPSEEK_ARGS, **change}, "args")
    every = megatron.config_from_args({**DEEPSEEK_ARGS, "moe_router_group_topk": 2}, "args")[0]  # both groups: no limit
    assert (every["n_group"], every["topk_group"]) == (1, 1)
    dense = megatron.config_from_args({**DEEPSEEK_ARGS, "num_experts": None}, "args")[0]  # MLA without experts
    assert dense["first_k_dense_replace"] == 3 and "n_routed_experts" not in dense


def test_nemos_model_yaml_of_a_deepseek_v3_describes_it_as_megatron_lms_args_do() -> None:
    """NeMo 2's context/model.yaml holds Megatron-Core's TransformerConfig fields, a DeepSeek-V3's among
    them (MLA, its YaRN, the MoE's routing, MTP): the same DeepseekV3 config as Megatron-LM's args give."""
    import yaml

    from shardstore.export.hf import megatron

    fields = {**{k: v for k, v in DEEPSEEK_ARGS.items() if k != "num_experts"}, "num_moe_experts": 4,
              "normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
              "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
              "position_embedding_type": "rope", "share_embeddings_and_output_weights": False}
    args = megatron.args_from_yaml(yaml.safe_dump({"config": fields}).encode(), 100, "model.yaml")
    nemo = megatron.config_from_args(args, "model.yaml")[0]
    direct = megatron.config_from_args({**DEEPSEEK_ARGS, "swiglu": True, "normalization": "RMSNorm",
                                        "padded_vocab_size": 100, "untie_embeddings_and_output_weights": True,
                                        "params_dtype": "float32"}, "args")[0]
    assert nemo == direct and nemo["architectures"] == ["DeepseekV3ForCausalLM"]


@pytest.mark.parametrize("change, named", [
    ({"first_k_dense_replace": 0}, "decoder.layers.0.mlp.router.weight: not in the checkpoint, but "
                                   "model.layers.0.mlp.gate.weight needs it"),
    ({"num_nextn_predict_layers": 0}, "mtp.layers.0.eh_proj.weight: a tensor DeepseekV3ForCausalLM has no place for")])
def test_a_deepseek_v3_config_of_other_blocks_is_refused_naming_the_tensor(change: dict, named: str,
                                                                           tmp_path: Path) -> None:
    """A config whose first layer is MoE, or which has no MTP layer, for a checkpoint with a dense first
    layer and an MTP layer: refused in one line naming the tensor, nothing written."""
    from tests.refusals import assert_refused, cli

    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V3, **change}))
    assert_refused(cli("unshard", DATA / "tp1-pp1-dp2-dsv3", tmp_path / "out", "--format", "hf", "--hf-config",
                       tmp_path / "config.json", "-q"), named)
    assert not (tmp_path / "out").exists()


def test_mla_under_transformer_engines_names_and_without_q_lora_rank() -> None:
    """The latents' norms fused into the up-projections (Transformer Engine's spec), q in one projection
    (no q_lora_rank), the MTP layer under its in-memory name (mtp_model_layer, as --ckpt-format torch
    keeps it): each placed where the hub's DeepseekV3 has it."""
    from shardstore.export.hf import megatron

    shapes = {k: tuple(v.shape) for k, v in torch.load(DATA / "tp1-pp1-dp2-dsv3.expected.pt.ref",
                                                        weights_only=True)["model"].items()}
    te = {re.sub(r"self_attention\.(q|kv)_layernorm\.", r"self_attention.linear_\1_up_proj.layer_norm_", k): v
          for k, v in shapes.items()}
    sources = {t.key: t.source for t in megatron.plan(DEEPSEEK_V3, list(te), te, "ckpt", {}).tensors}
    assert sources["model.layers.2.self_attn.kv_a_layernorm.weight"] == \
        "decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight"
    assert sources["model.layers.3.self_attn.q_a_layernorm.weight"] == \
        "mtp.layers.0.mtp_model_layer.self_attention.linear_q_up_proj.layer_norm_weight"
    whole = {k: v for k, v in shapes.items() if not re.search(r"linear_q_(down|up)_proj|q_layernorm", k)}
    whole.update({f"{p}self_attention.linear_q_proj.weight": (32, 16) for p in
                  [f"decoder.layers.{i}." for i in range(3)] + ["mtp.layers.0.mtp_model_layer."]})
    model = megatron.plan({**DEEPSEEK_V3, "q_lora_rank": None}, list(whole), whole, "ckpt", {})
    assert {t.key: t.source for t in model.tensors}["model.layers.1.self_attn.q_proj.weight"] == \
        "decoder.layers.1.self_attention.linear_q_proj.weight"
