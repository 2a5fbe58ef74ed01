"""`--format megatron` (export/megatron.py) against megatron-core's own files: a Hugging Face export of
each checkpoint megatron-core saved (tests/fixtures/data/megatron/), written back as a Megatron checkpoint,
holds every tensor megatron-core wrote, bit for bit as torch's DCP reader (megatron-core's) assembles it,
and every other item it wrote; and reads back as the same Hugging Face model.

megatron-core itself loads the output (tests/fixtures/megatron_load.py, out of CI: megatron-core 0.19.2 does
not install there) into GPTModels with the Hugging Face model's logits: run 2026-12-06 on this writer's
output of the fixtures' Hugging Face exports, vocabulary padded to 128, max abs difference of the logits
2.2e-05 at TP 2 × PP 2 and 3.2e-05 at TP 1 (Llama), 2.7e-05 at TP 2 (Qwen2), 4.3e-06 at EP 2 and 1.0e-05 at
TP 2 × EP 2 (Qwen3-MoE); run 2026-12-07 on DeepSeek-V3 models (tests/fixtures/deepseek_hf.py: with an MTP
layer, without, with one its files lack, without q LoRA), within 2.4e-05 at TP 1, TP 2, EP 2 and TP 2 × EP 2,
every loaded tensor bit for bit the Hugging Face one (`--values`); and 2026-12-07 on one of 4 layers with its MTP
layer (`deepseek_hf.py --layers 4`), written with `--transformer-impl local` (the spec that oracle builds), at
TP 2 × PP 2, PP 2 × EP 2 and TP 2 × PP 2 × EP 2: within 1.5e-05, 9.1e-06 and 1.7e-05; and 2026-12-07 on a
GptOss transformers saved (tests/fixtures/gpt_oss_hf.py `--layers 4 --dtype float32`: windowed every other
layer, YaRN, sinks and biases drawn), written with `--transformer-impl local`: within 8.9e-08 at TP 1,
7.5e-08 at TP 2 × PP 2 and at TP 2 × EP 2 (its experts' gate and up left interleaved, as a check that the
oracle sees it: 4.1e-02).

The output for Megatron-LM's default layer spec (Transformer Engine's: `--transformer-impl transformer_engine`,
the default) is checked the same way by tests/fixtures/megatron_te_spec.py (megatron-core's own TE-spec
GPTModel, TE's modules stood in for on the CPU): see test_the_default_output_is_what_megatron_cores_te_model_asks_for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardstore
from tests.conftest import assert_bitwise_equal
from tests.export.test_hf_megatron_inverse import DATA, GPT_OSS, LAYOUTS


def _dcp(folder: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """A DCP folder's tensors as torch's reader assembles them, and its other items' keys."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    tensors = {k: torch.full(tuple(v.size), 7, dtype=v.properties.dtype) for k, v in meta.items()
               if not isinstance(v, BytesStorageMetadata) and not k.startswith("optimizer.")}
    dcp.load(tensors, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return tensors, {k for k, v in meta.items() if isinstance(v, BytesStorageMetadata)}


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


# and a Transformer Engine model's grouped experts (TEGroupedMLP), whose torch_dist keys are SequentialMLP's, and
# GPT-OSS's (sinks, biases, its experts' stacked tensors taken apart)
@pytest.mark.parametrize("layout", LAYOUTS + ["tp2-pp1-ep2-etp1-te-grouped"] + GPT_OSS)
def test_a_megatron_checkpoint_written_from_its_hf_export_is_megatron_cores_own(layout: str, tmp_path: Path) -> None:
    src = DATA / layout
    shardstore.unshard(src, tmp_path / "hf", format="hf", jobs=1)
    rows = json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"]
    # (megatron-core saved them with its local layer spec)
    result = shardstore.unshard(tmp_path / "hf", tmp_path / "megatron", format="megatron", vocab_multiple=rows,
                                transformer_impl="local", jobs=2)
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert json.loads((tmp_path / "megatron" / "release" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    ours, our_items = _dcp(tmp_path / "megatron" / "release")
    theirs, their_items = _dcp(next(src.glob("iter_*")))
    assert_bitwise_equal(ours, theirs, layout)
    assert our_items == their_items  # each linear layer's _extra_state per layer, and the common state
    assert result.files[-1].name == "latest_checkpointed_iteration.txt"
    # and read back, the same Hugging Face model: described by the config.json beside it, or by the args of
    # its common state alone
    shardstore.unshard(tmp_path / "megatron", tmp_path / "hf2", format="hf", jobs=1)
    assert_bitwise_equal(_safetensors(tmp_path / "hf2"), _safetensors(tmp_path / "hf"), layout)
    (tmp_path / "megatron" / "config.json").unlink()
    shardstore.unshard(tmp_path / "megatron", tmp_path / "hf3", format="hf", jobs=1)
    assert_bitwise_equal(_safetensors(tmp_path / "hf3"), _safetensors(tmp_path / "hf"), layout)


@pytest.mark.parametrize("layout", LAYOUTS + GPT_OSS)
def test_the_default_output_is_what_megatron_cores_te_model_asks_for(layout: str, tmp_path: Path) -> None:
    """Megatron-LM's default layer spec is Transformer Engine's: the keys its GPTModel of the same config
    asks for (megatron-core 0.19.2's own model, TE stood in for on the CPU: tests/fixtures/megatron_te_spec.py,
    whose load of these outputs gave transformers' logits) are every tensor written, under its key with its
    global shape, and every object it asks for (TE's norms keep an `_extra_state`); beyond them only the
    attention's `_extra_state` that megatron-core < 0.15 asks for. For an MoE or MLA model these keys are not
    the local spec's (the test above). Read back, the same Hugging Face model."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from shardstore.export.megatron import COMMON_ITEM

    shardstore.unshard(DATA / layout, tmp_path / "hf", format="hf", jobs=1)
    shardstore.unshard(tmp_path / "hf", tmp_path / "megatron", format="megatron", jobs=2)
    meta = FileSystemReader(str(tmp_path / "megatron" / "release")).read_metadata().state_dict_metadata
    want = json.loads((DATA.parent / "te_spec" / f"{layout}.json").read_text())
    assert {k: list(v.size) for k, v in meta.items() if not isinstance(v, BytesStorageMetadata)} == want["tensors"]
    objects = {k for k, v in meta.items() if isinstance(v, BytesStorageMetadata)} - {COMMON_ITEM}
    assert set(want["objects"]) <= objects, sorted(set(want["objects"]) - objects)
    assert all(".self_attention.core_attention._extra_state/" in k for k in objects - set(want["objects"]))
    shardstore.unshard(tmp_path / "megatron", tmp_path / "hf2", format="hf", jobs=1)
    assert_bitwise_equal(_safetensors(tmp_path / "hf2"), _safetensors(tmp_path / "hf"), layout)


def test_the_vocabulary_is_padded_with_zero_rows_to_the_multiple_megatron_loads_at(tmp_path: Path) -> None:
    """Megatron-LM pads the vocabulary to a multiple of make_vocab_size_divisible_by times the TP size (128 by
    default): the padding rows are zeros, the args say the padded size, and the folder read back with the
    config.json written beside it drops them again."""
    shardstore.unshard(DATA / "tp1-pp1", tmp_path / "hf", format="hf", jobs=1)
    shardstore.unshard(tmp_path / "hf", tmp_path / "megatron", format="megatron", jobs=1)
    ours, _ = _dcp(tmp_path / "megatron" / "release")
    hf = _safetensors(tmp_path / "hf")
    for key, name in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                      ("output_layer.weight", "lm_head.weight")):
        assert ours[key].shape == (128, 16)
        assert torch.equal(ours[key][:100], hf[name]) and not ours[key][100:].any()
    # read back: the config.json written beside release/ gives the unpadded size; without it, the args do
    shardstore.unshard(tmp_path / "megatron", tmp_path / "hf2", format="hf", jobs=1)
    assert_bitwise_equal(_safetensors(tmp_path / "hf2"), hf, "padded")
    (tmp_path / "megatron" / "config.json").unlink()
    result = shardstore.unshard(tmp_path / "megatron", tmp_path / "hf3", format="hf", jobs=1)
    assert _safetensors(tmp_path / "hf3")["lm_head.weight"].shape == (128, 16)
    assert any("padded one (128 rows" in note for note in result.notes)


def test_a_transformers_model_becomes_a_megatron_checkpoint_with_its_logits(tmp_path: Path) -> None:
    """A Qwen2 model transformers saved (q, k and v biases, grouped-query attention, bf16): written as a
    Megatron checkpoint and read back as Hugging Face's, the same weights, bit for bit, and logits."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    shardstore.unshard(tmp_path / "hf", tmp_path / "megatron", format="megatron", jobs=1)
    written, items = _dcp(tmp_path / "megatron" / "release")
    assert written["decoder.layers.self_attention.linear_qkv.weight"].shape == (3, 64, 32)
    assert written["decoder.layers.self_attention.linear_qkv.bias"].dtype == torch.bfloat16
    assert "decoder.layers.mlp.linear_fc2._extra_state/shard_2_3" in items
    assert sorted(p.name for p in (tmp_path / "megatron").iterdir() if not p.name.startswith(".")) == \
        ["config.json", "generation_config.json", "latest_checkpointed_iteration.txt", "release"]
    shardstore.unshard(tmp_path / "megatron", tmp_path / "back", format="hf", jobs=1)
    assert_bitwise_equal(_safetensors(tmp_path / "back"), _safetensors(tmp_path / "hf"), "qwen2")
    ids = torch.tensor([[1, 5, 9, 77, 150, 3]])
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("via", ["one pass", "store"])
def test_a_transformers_gpt_oss_becomes_a_megatron_checkpoint_and_back_bit_for_bit(via: str, tmp_path: Path) -> None:
    """GptOss as transformers saves it (bf16; each layer's experts one stacked tensor, gate and up
    interleaved and transposed): each Megatron expert's linear_fc1 is [gate; up] as Megatron-Bridge's
    GPT-OSS mapping unstacks it, under Transformer Engine's keys (the MoE layer's pre-MLP norm a module of
    its own); read back, the same files bit for bit and the same logits."""
    from transformers import AutoModelForCausalLM

    from tests.fixtures.gpt_oss_hf import gpt_oss_folder

    gpt_oss_folder(tmp_path / "hf")  # (3 layers, hidden 32, 4 experts of 24)
    hf = _safetensors(tmp_path / "hf")
    store = {"store": tmp_path / "store"} if via == "store" else {}
    shardstore.unshard(tmp_path / "hf", tmp_path / "megatron", format="megatron", jobs=2, **store)
    written, _ = _dcp(tmp_path / "megatron" / "release")
    fc1, fc1_bias = written["decoder.layers.mlp.experts.experts.linear_fc1.weight"], \
        written["decoder.layers.mlp.experts.experts.linear_fc1.bias"]
    assert fc1.shape == (3, 4, 48, 32) and fc1.dtype == torch.bfloat16
    for layer in range(3):
        gate_up = hf[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # (experts, hidden, 2 x width)
        for e in range(4):  # Megatron-Bridge's GPTOSSMLPGateUpProjMapping: gate the even columns, up the odd
            assert torch.equal(fc1[layer, e], torch.cat([gate_up[e][:, 0::2].T, gate_up[e][:, 1::2].T]))
            bias = hf[f"model.layers.{layer}.mlp.experts.gate_up_proj_bias"][e]
            assert torch.equal(fc1_bias[layer, e], torch.cat([bias[0::2], bias[1::2]]))
            assert torch.equal(written["decoder.layers.mlp.experts.experts.linear_fc2.weight"][layer, e],
                               hf[f"model.layers.{layer}.mlp.experts.down_proj"][e].T)
        assert torch.equal(written["decoder.layers.self_attention.core_attention.softmax_offset"][layer],
                           hf[f"model.layers.{layer}.self_attn.sinks"])
    assert "decoder.layers.pre_mlp_layernorm.weight" in written
    shardstore.unshard(tmp_path / "megatron", tmp_path / "back", format="hf", jobs=1)
    assert_bitwise_equal(_safetensors(tmp_path / "back"), hf, "gpt-oss")
    ids = torch.tensor([[1, 5, 9, 77, 150, 3, 42, 8]])  # past the window of 4
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("name, heads, sizes", [("GptOss", 8, (64, 8)), ("Qwen3", 32, (128, 32)),
                                                ("Mistral", 16, (2, 8))])
def test_a_config_without_its_sizes_takes_its_classs_defaults(name: str, heads: int, sizes: tuple[int, int],
                                                               tmp_path: Path) -> None:
    """A config.json written by hand without head_dim and num_key_value_heads: transformers takes its class's
    defaults (GptOss 64 and 8, Qwen3 128 and 32, Mistral hidden / heads and 8 groups of 16 heads), not the
    Llama family's rules (hidden / heads, one group a head), and so does the writer, both ways."""
    import transformers

    torch.manual_seed(0)
    extra = {"num_local_experts": 2, "num_experts_per_tok": 1} if name == "GptOss" else {}
    config = getattr(transformers, f"{name}Config")(vocab_size=100, hidden_size=32, intermediate_size=16,
                                                   num_hidden_layers=2, num_attention_heads=heads,
                                                   max_position_embeddings=32, **extra)
    assert (config.head_dim, config.num_key_value_heads) == sizes
    getattr(transformers, f"{name}ForCausalLM")(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({k: v for k, v in written.items()
                                                             if k not in ("head_dim", "num_key_value_heads")}))
    shardstore.unshard(tmp_path / "hf", tmp_path / "megatron", format="megatron", jobs=1)
    tensors, _ = _dcp(tmp_path / "megatron" / "release")
    head_dim, groups = sizes
    qkv = tensors["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv.shape == (2, (heads + 2 * groups) * head_dim, 32)
    shardstore.unshard(tmp_path / "megatron", tmp_path / "back", format="hf", jobs=1)
    assert_bitwise_equal(_safetensors(tmp_path / "back"), _safetensors(tmp_path / "hf"), name)
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").config.head_dim == head_dim


def test_what_a_megatron_checkpoint_cannot_hold_is_refused_before_it_is_written(tmp_path: Path) -> None:
    shardstore.unshard(DATA / "tp1-pp1", tmp_path / "hf", format="hf", jobs=1)
    with pytest.raises(shardstore.ExportError, match="--dtype: --format megatron writes each tensor in its own"):
        shardstore.unshard(tmp_path / "hf", tmp_path / "a", format="megatron", dtype="bfloat16", jobs=1)
    with pytest.raises(shardstore.ExportError, match="--vocab-multiple .* goes with --format megatron"):
        shardstore.unshard(tmp_path / "hf", tmp_path / "b", format="hf", vocab_multiple=64, jobs=1)
    with pytest.raises(shardstore.ExportError, match="--transformer-impl .* goes with --format megatron"):
        shardstore.unshard(tmp_path / "hf", tmp_path / "b", format="hf", transformer_impl="local", jobs=1)
    with pytest.raises(shardstore.ExportError, match="--transformer-impl is transformer_engine or local"):
        shardstore.unshard(tmp_path / "hf", tmp_path / "b", format="megatron", transformer_impl="te", jobs=1)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(shardstore.ExportError, match="'GPT2LMHeadModel' has no Megatron-Core GPT equivalent"):
        shardstore.unshard(tmp_path / "hf", tmp_path / "c", format="megatron", jobs=1)
    # DeepSeek without a q latent: megatron-core's TE spec would normalise q's input twice
    from tests.export.test_renamed import DATA as TITAN
    dsv3 = json.loads((TITAN / "deepseek-v3" / "hf" / "config.json").read_text())
    src = _with(TITAN / "deepseek-v3" / "hf", tmp_path / "noq", {**dsv3, "q_lora_rank": None}, {})
    with pytest.raises(shardstore.ExportError, match="q_lora_rank is None: megatron-core's Transformer Engine spec"):
        shardstore.unshard(src, tmp_path / "d", format="megatron", jobs=1)
    # values a config.json may hold that are no values at all (Megatron-LM's args would carry them as they are)
    yarn = {"rope_type": "yarn", "factor": "40", "mscale": 1.0, "mscale_all_dim": 1.0}
    for name, change, said in [("e", {**dsv3, "rope_parameters": yarn}, "rope_parameters: factor is '40'; a number"),
                               ("f", {**dsv3, "n_group": "8"}, "n_group is '8'; a count"),
                               ("g", {**dsv3, "routed_scaling_factor": None, "rope_theta": []},
                                r"rope_theta is \[\]; a number")]:
        with pytest.raises(shardstore.ExportError, match=f"the model's config.json: {said}"):
            shardstore.unshard(_with(TITAN / "deepseek-v3" / "hf", tmp_path / f"src-{name}", change, {}),
                               tmp_path / name, format="megatron", jobs=1)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "llama3",
                                                                                         "factor": True}}))
    with pytest.raises(shardstore.ExportError, match="the model's config.json: rope_scaling: factor is True; a number"):
        shardstore.unshard(tmp_path / "hf", tmp_path / "h", format="megatron", jobs=1)
    assert not any((tmp_path / n).exists() for n in "abcdefgh")


def test_an_earlier_exports_files_are_refused_up_front_and_replaced_with_overwrite(tmp_path: Path) -> None:
    """What OUT may hold of a Megatron export is known by name before anything is planned: another
    export's files are one line (nothing written), replaced with --overwrite."""
    from tests.export.test_renamed import DATA as TITAN
    from tests.test_cli import error_line, run

    src, out = TITAN / "llama" / "hf", tmp_path / "out"
    shardstore.unshard(src, out, format="hf", jobs=1)
    line = error_line("unshard", src, out, "--format", "megatron")
    assert "model.safetensors" in line and not (out / "release").exists(), line
    proc = run("unshard", src, out, "--format", "megatron", "--overwrite", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "model.safetensors").exists() and (out / "latest_checkpointed_iteration.txt").read_text() == "release"


def test_verify_reads_a_megatron_output_back_and_catches_a_changed_element(tmp_path: Path) -> None:
    """`verify HF OUT` of a Megatron export: recognised by its iteration file, read back onto transformers'
    names and checked tensor by tensor; one element changed in a .distcp file is named with its tensor."""
    from tests.export.test_renamed import DATA as TITAN

    src, out = TITAN / "llama" / "hf", tmp_path / "out"
    shardstore.unshard(src, out, format="megatron", jobs=1)
    result = shardstore.verify(src, out)
    assert result.ok and result.format == "megatron" and result.tensors == 21, result.summary()
    # the first layer's q of the first query group, as the source holds it: changed where the output has it
    q = _safetensors(src)["model.layers.0.self_attn.q_proj.weight"]
    raw = q[0].numpy().tobytes()
    for distcp in (out / "release").glob("*.distcp"):
        data = distcp.read_bytes()
        at = data.find(raw)
        if at >= 0:
            distcp.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
            break
    else:
        raise AssertionError("the first row of q is in no .distcp file")
    result = shardstore.verify(src, out)
    assert not result.ok and [d.name for d in result.differences] == ["model.layers.0.self_attn.q_proj.weight"], \
        result.summary()


def test_a_deepseek_v3_saved_without_its_prediction_layer_is_written_without_one(tmp_path: Path) -> None:
    """transformers' save_pretrained leaves DeepSeek-V3's multi-token-prediction layer out while its config
    still counts it: the checkpoint is written without one, said, and config.json beside it says 0, so the
    Megatron checkpoint reads back as the source model."""
    from tests.export.test_renamed import DATA as TITAN

    src, out = TITAN / "deepseek-v3" / "hf", tmp_path / "out"
    assert json.loads((src / "config.json").read_text())["num_nextn_predict_layers"] == 1
    result = shardstore.unshard(src, out, format="megatron", jobs=2)
    assert any("no multi-token-prediction layer (model.layers.3)" in note for note in result.notes), result.notes
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    ours, _ = _dcp(out / "release")
    assert not any(k.startswith("mtp.") for k in ours) and "decoder.layers.0.mlp.linear_fc1.weight" in ours
    assert shardstore.verify(src, out).ok


def _with(src: Path, dst: Path, config: dict, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of the Hugging Face folder `src` with `config` as its config.json and `extra` tensors added."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    save_file({**load_file(src / "model.safetensors"), **(extra or {})}, dst / "model.safetensors",
              metadata={"format": "pt"})
    return dst


def test_the_common_states_rotary_arguments_read_either_spelling_of_transformers_config(tmp_path: Path) -> None:
    """transformers 5 writes rope_theta and the scaling inside rope_parameters, < 5 beside it: either way
    the args are the model's (megatron-core built from them has its rotary embeddings), and read back are
    the same config; a scaling Megatron-LM's arguments cannot say is refused before anything is written."""
    from shardstore.export.hf.megatron import config_from_args
    from shardstore.export.megatron import megatron_args
    from tests.export.test_renamed import DATA as TITAN

    dsv3 = json.loads((TITAN / "deepseek-v3" / "hf" / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 64}
    new = {**dsv3, "rope_parameters": {**yarn, "rope_theta": 50000.0}}
    old = {**{k: v for k, v in dsv3.items() if k != "rope_parameters"}, "rope_theta": 50000.0, "rope_scaling": yarn}
    for config in (new, old):
        args = vars(megatron_args(config, 128, 128))
        assert args["rotary_base"] == 50000.0 and args["rope_type"] == "yarn" and args["rotary_scaling_factor"] == 4.0
        back, _ = config_from_args(args, "args")
        assert back["rope_theta"] == 50000.0 and {k: back["rope_scaling"][k] for k in yarn} == yarn
    llama = json.loads((TITAN / "llama" / "hf" / "config.json").read_text())
    scaled = {**llama, "rope_parameters": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                           "rope_theta": 500000.0}}
    args = vars(megatron_args(scaled, 128, 128))
    assert (args["rotary_base"], args["use_rope_scaling"], args["rope_scaling_factor"]) == (500000.0, True, 32.0)
    src = _with(TITAN / "llama" / "hf", tmp_path / "linear", {**llama, "rope_scaling": {"rope_type": "linear",
                                                                                           "factor": 2.0}})
    with pytest.raises(shardstore.ExportError, match="rotary embeddings scaled as"):
        shardstore.unshard(src, tmp_path / "out", format="megatron")
    assert not (tmp_path / "out" / "release").exists()


def test_the_hubs_copies_in_a_prediction_layer_are_left_out_and_said(tmp_path: Path) -> None:
    """DeepSeek-V3's hub files keep the embedding and output layer again in its MTP layer: Megatron's MTP
    takes the model's, so they are not written, said; verify knows they are not there."""
    from safetensors.torch import load_file
    from tests.export.test_renamed import DATA as TITAN

    hf = load_file(TITAN / "deepseek-v3" / "hf" / "model.safetensors")
    config = json.loads((TITAN / "deepseek-v3" / "hf" / "config.json").read_text())
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in hf.items()
           if k.startswith("model.layers.2.")}
    mtp.update({"model.layers.3.enorm.weight": torch.ones(64), "model.layers.3.hnorm.weight": torch.ones(64),
                "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
                "model.layers.3.shared_head.norm.weight": torch.ones(64),
                "model.layers.3.embed_tokens.weight": hf["model.embed_tokens.weight"].clone(),
                "model.layers.3.shared_head.head.weight": hf["lm_head.weight"].clone()})
    src = _with(TITAN / "deepseek-v3" / "hf", tmp_path / "hf", config, mtp)
    result = shardstore.unshard(src, tmp_path / "out", format="megatron", jobs=1)
    assert any("model.layers.3.embed_tokens.weight, model.layers.3.shared_head.head.weight: the hub's copies" in n
               for n in result.notes), result.notes
    ours, _ = _dcp(tmp_path / "out" / "release")
    assert "mtp.layers.0.eh_proj.weight" in ours and not any("embed" in k for k in ours if k.startswith("mtp."))
    assert shardstore.verify(src, tmp_path / "out").ok
