"""DeepSpeed ZeRO checkpoints written by DeepSpeed 0.19.8's own engine (tests/fixtures/deepspeed_zero.py;
the files are kept in tests/fixtures/data/deepspeed/), against what DeepSpeed itself reconstructs
(`get_fp32_state_dict_from_zero_checkpoint`) and what the live ranks gathered, bit for bit.

| kind | ZeRO stage | precision | optimizer | files |
|---|---|---|---|---|
| z1 | 1 | fp32 | DeepSpeedZeroOptimizer | mp_rank_00 + 3 optimizer files |
| z2 | 2 | fp32 | DeepSpeedZeroOptimizer | mp_rank_00 + 3 optimizer files |
| z3 | 3 | fp32 | DeepSpeedZeroOptimizer_Stage3 | 3 model-states + 3 optimizer files |
| z1-bf16 | 1 | bf16 | DeepSpeedZeroOptimizer (`bf16_` prefix) | mp_rank_00 + 3 optimizer files |
| z2-bf16 | 2 | bf16 | DeepSpeedZeroOptimizer | mp_rank_00 + 3 optimizer files |
| z3-bf16 | 3 | bf16 | DeepSpeedZeroOptimizer_Stage3 | 3 model-states + 3 optimizer files |
| z2-fp16 | 2 | fp16, dynamic loss scale | DeepSpeedZeroOptimizer | mp_rank_00 + 3 optimizer files |
| z3-fp16 | 3 | fp16, dynamic loss scale | DeepSpeedZeroOptimizer_Stage3 | 3 model-states + 3 optimizer files |
| z1-bf16-fp32acc | 1 | bf16, fp32 gradient accumulation | BF16_Optimizer (no `zero_stage`; `zero_to_fp32` fails on it) | mp_rank_00 + 3 optimizer files |
| z2-bf16-offload | 2 | bf16, optimizer offloaded to the CPU | DeepSpeedZeroOptimizer | mp_rank_00 + 3 optimizer files |
| z3-bf16-offload | 3 | bf16, optimizer and parameters offloaded | DeepSpeedZeroOptimizer_Stage3 | 3 model-states + 3 optimizer files |
| z3-bf16-dsadam | 3 | bf16 | DeepSpeed's FusedAdam, from the config | 3 model-states + 3 optimizer files |
| z2-bf16-offload-dsadam | 2 | bf16, optimizer offloaded | DeepSpeedCPUAdam, from the config | mp_rank_00 + 3 optimizer files |
| z2-bf16-rr | 2 | bf16, `round_robin_gradients` (param_shapes in round-robin order, flat vectors not: `zero_to_fp32` rebuilds 20 of 27 tensors wrong) | DeepSpeedZeroOptimizer | mp_rank_00 + 3 optimizer files |
| z1-elastic, z2-elastic | 1; 2, `elastic_checkpoint` (each group's state saved alone, moments unpadded, no hyperparameters) | fp32 | DeepSpeedZeroOptimizer, torch AdamW (step in the state) | mp_rank_00 + 3 optimizer files |
| z2-bf16-elastic-dsadam | 2, `elastic_checkpoint`, as DeepSpeed's own `ws4_model_checkpoint` saves | bf16 | DeepSpeed's FusedAdam (its groups' step saved as `base_optimizer_state_step`) | mp_rank_00 + 3 optimizer files |
| z0, z0-bf16 | 0 (no ZeRO) | fp32; bf16 | torch AdamW; FP16_UnfusedOptimizer around it | mp_rank_00 alone (`zero_to_fp32` fails on it) |
| shared-z2, shared-z3 | 2; 3 | fp32 | torch Adam | DeepSpeed's `test_shared_weights` model (`layer2.weight` is `layer1.weight`), tag `checkpoint` |
| ds0.14.4/z2-bf16, ds0.14.4/z3-bf16 | 2; 3 | bf16 (DeepSpeed 0.14.4, torch 2.6) | as above | as above |
| ds0.14.4/z0-bf16 | 0 (no ZeRO) | bf16 (DeepSpeed 0.14.4) | BF16_Optimizer: zero files though ZeRO is off (`zero_to_fp32` fails on them) | mp_rank_00 + 3 optimizer files |

All at W = 3 with vocab 97 (no part boundary falls on a parameter edge), tied embeddings, one frozen
norm weight and the HF Trainer's two parameter groups. Under ZeRO-1 DeepSpeed's own `zero_to_fp32`
drops the frozen parameter (it keeps no `frozen_param_shapes`), and it fails on BF16_Optimizer's and
ZeRO-0's files: the live ranks' values are the reference. ZeRO-0 partitions nothing: the reference is the
live engine's module and optimizer state as they are.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.errors import CheckpointError
from shardstore.read.discover import open_source
from tests.conftest import assert_bitwise_equal, exported, reference_logits
from tests.read.conformance import FormatTests

DATA = Path(__file__).parents[2] / "fixtures" / "data" / "deepspeed"
KINDS = ["z1", "z2", "z3", "z1-bf16", "z2-bf16", "z3-bf16", "z2-fp16", "z3-fp16", "z1-bf16-fp32acc",
         "z2-bf16-offload", "z3-bf16-offload", "z3-bf16-dsadam", "z2-bf16-offload-dsadam", "z2-bf16-rr",
         "z1-elastic", "z2-elastic", "z2-bf16-elastic-dsadam"]
# DeepSpeed's own zero_to_fp32 rebuilds these wrong: the live ranks' gather is the only reference
ZERO_TO_FP32_WRONG = ["z2-bf16-rr"]
# DeepSpeed 0.14.4 (torch 2.6, transformers 4.48): its bf16 without ZeRO is BF16_Optimizer's zero files
OLD = ["ds0.14.4/z2-bf16", "ds0.14.4/z3-bf16", "ds0.14.4/z0-bf16"]
TAG = "global_step2"


def _src(kind: str) -> Path:
    return DATA / f"{kind}-w3"


def _expected(kind: str) -> dict:
    return torch.load(f"{_src(kind)}.expected.pt.ref", weights_only=False)


@pytest.mark.parametrize("kind", KINDS + OLD)
def test_torch_export_is_deepspeeds_reconstruction_and_the_live_gather(kind: str, tmp_path: Path) -> None:
    """model.pt: DeepSpeed's fp32 state dict (tied names sharing one storage, as its own has them), and
    every parameter as the live ranks gathered it (the frozen one in its own dtype); optim.pt: each
    parameter's moments and step keyed by name, and the groups' hyperparameters with their names."""
    want = _expected(kind)
    assert open_source(_src(kind)).format == "deepspeed"
    shardstore.unshard(_src(kind), tmp_path / "out", format="torch", jobs=2)
    model = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    if kind in ZERO_TO_FP32_WRONG:
        assert any(not torch.equal(t, want["live"]["fp32"][n]) for n, t in want["fp32"].items())
    else:
        for name, tensor in want["fp32"].items():
            assert_bitwise_equal(model[name], tensor, name)
    for name, tensor in want["live"]["fp32"].items():
        assert_bitwise_equal(model[name], tensor, name)
    assert model["lm_head.weight"].untyped_storage().data_ptr() == \
        model["model.embed_tokens.weight"].untyped_storage().data_ptr()
    optim = torch.load(tmp_path / "out" / "optim.pt", weights_only=True)
    assert set(optim["state"]) == set(want["live"]["moments"])  # the frozen parameter has none
    for name, moments in want["live"]["moments"].items():
        for key, tensor in moments.items():
            assert_bitwise_equal(optim["state"][name][key], tensor, f"{name}/{key}")
    train = torch.load(tmp_path / "out" / "train.pt", weights_only=False)
    assert train["global_steps"] == 2 and train["ds_version"] == ("0.14.4" if kind in OLD else "0.19.8")
    for name in want["live"]["moments"]:  # an fp16 step that overflowed is skipped, and not counted
        step = optim["state"][name]["step"]  # a tensor under torch's AdamW, an int under DeepSpeed's Adams
        assert int(step) == train["global_steps"] - train["skipped_steps"]
    if "-elastic" in kind:  # no hyperparameters saved: each group's names, and the step if its groups keep one
        assert [g["params"] for g in optim["param_groups"]] == [g["params"] for g in want["param_groups"]]
        for got, live in zip(optim["param_groups"], want["param_groups"]):
            assert set(got) <= {"params", "step"} and got == {k: live[k] for k in got}
    else:
        assert optim["param_groups"] == want["param_groups"]


@pytest.mark.parametrize("kind", ["z0", "z0-bf16"])
def test_zero0_is_the_live_engines_module_and_optimizer_state(kind: str, tmp_path: Path) -> None:
    """Without ZeRO the one file holds everything whole: model.pt is the engine's module state dict (the
    tied name sharing the embedding's storage), optim.pt its optimizer's state as it saved it (under bf16
    DeepSpeed's wrapper, whose fp32 masters the file does not name); `--format hf` writes the module's
    weights in their own dtype and says so, and reproduces the module's logits."""
    from transformers import AutoModelForCausalLM

    from tests.fixtures.deepspeed_zero import IDS

    want = _expected(kind)
    assert "NoneType" in want["zero_to_fp32_error"]  # DeepSpeed's own tool fails on this folder
    shardstore.unshard(_src(kind), tmp_path / "pt", format="torch", jobs=2)
    model = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert_bitwise_equal(model, want["live"]["module"], "model", ordered=True)
    assert model["lm_head.weight"].untyped_storage().data_ptr() == \
        model["model.embed_tokens.weight"].untyped_storage().data_ptr()
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "optim.pt", weights_only=True), want["live"]["optimizer"],
                         "optim", ordered=True)
    assert torch.load(tmp_path / "pt" / "train.pt", weights_only=False)["global_steps"] == 2
    shardstore.unshard(_src(kind), tmp_path / "hf", format="hf", jobs=2)
    dtype = want["live"]["module"]["model.norm.weight"].dtype
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.dtype == dtype
    with torch.no_grad():
        assert torch.equal(hf(input_ids=IDS).logits, reference_logits(_src(kind), want["live"]["module"], IDS))


def test_model_and_pipeline_parallel_checkpoints_are_refused_by_name(tmp_path: Path) -> None:
    """Megatron-DeepSpeed's: tensor-parallel ranks (mp_rank_01) and pipeline stages (layer_*-model_states.pt)."""
    for extra, says in (("mp_rank_01_model_states.pt", "a model-parallel rank's file"),
                        ("layer_01-model_00-model_states.pt", "a pipeline-parallel checkpoint")):
        src = shutil.copytree(_src("z1"), tmp_path / extra)
        shutil.copy(src / TAG / "mp_rank_00_model_states.pt", src / TAG / extra)
        with pytest.raises(CheckpointError, match=f"{extra}: {says}"):
            open_source(src)


def test_a_zero_checkpoint_without_its_optimizer_files_is_refused_by_name(tmp_path: Path) -> None:
    """A ZeRO-2 folder left with its model-states file alone is not read as ZeRO-0's."""
    src = shutil.copytree(_src("z2"), tmp_path / "src")
    for f in (src / TAG).glob("*optim_states.pt"):
        f.unlink()
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt: a ZeRO checkpoint, but its optimizer "
                                              "files .* are missing"):
        shardstore.unshard(src, tmp_path / "out", jobs=1)
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("kind", ["z1", "z3-bf16"])
def test_safetensors_and_dcp_exports(kind: str, tmp_path: Path) -> None:
    """safetensors cannot share a tensor between names: the tied name is left out (the model ties it, as
    transformers' own files leave it out); a DCP folder holds every key of the state, the tied one too."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    want = _expected(kind)
    weights = {**want["fp32"], **want["live"]["fp32"]}
    shardstore.unshard(_src(kind), tmp_path / "dcp", format="dcp", jobs=2)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    got = torch.load(tmp_path / "dcp.pt", weights_only=False)
    assert_bitwise_equal(got["model"], weights, "dcp")
    del weights["lm_head.weight"]
    shardstore.unshard(_src(kind), tmp_path / "st", jobs=2)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), weights, "safetensors")
    assert_bitwise_equal(got["optim"]["state"]["model.norm.weight"]["exp_avg"],
                         want["live"]["moments"]["model.norm.weight"]["exp_avg"], "dcp moments")


@pytest.mark.parametrize("kind", ["shared-z2", "shared-z3"])
def test_a_tied_weight_is_every_outputs_key(kind: str, tmp_path: Path) -> None:
    """DeepSpeed's test_shared_weights model, whose state dict names one parameter twice (`layer2.weight`
    is `layer1.weight`): `--format torch` keeps both names on one storage as zero_to_fp32 does; the DCP
    folder holds both keys, so torch's own `dcp.load` of the model's full state dict succeeds (its tied
    tensor stored once, both keys reading the same bytes); safetensors leaves the alias out, as
    safetensors' own `save_model` does, and its `load_model` fills it in. Each equals zero_to_fp32's bit for
    bit, and `verify` passes each."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, load_model
    from torch.distributed.checkpoint import FileSystemReader

    from tests.fixtures.deepspeed_zero import SharedWeights

    want = _expected(kind)
    src = DATA / f"{kind}-w3"
    assert set(want["fp32"]) == set(want["keys"]) and want["keys"] == list(SharedWeights().state_dict())
    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=2)
    model = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert_bitwise_equal(model, want["fp32"], "torch")
    assert model["layer2.weight"].untyped_storage().data_ptr() == model["layer1.weight"].untyped_storage().data_ptr()
    shardstore.unshard(src, tmp_path / "dcp", format="dcp", jobs=2)
    state = SharedWeights().state_dict()
    dcp.load({"model": state}, checkpoint_id=tmp_path / "dcp")
    assert_bitwise_equal(state, want["fp32"], "dcp.load")
    storage = FileSystemReader(str(tmp_path / "dcp")).read_metadata().storage_data
    places = {i.fqn: (s.relative_path, s.offset, s.length) for i, s in storage.items() if i.fqn.endswith(".weight")}
    assert places["model.layer2.weight"] == places["model.layer1.weight"]  # one tensor, written once
    shardstore.unshard(src, tmp_path / "st", jobs=2)
    assert set(load_file(tmp_path / "st" / "model.safetensors")) == set(want["keys"]) - {"layer2.weight"}
    tied = SharedWeights()
    load_model(tied, tmp_path / "st" / "model.safetensors", strict=True)
    assert_bitwise_equal(tied.state_dict(), want["fp32"], "safetensors' load_model")
    for out, fmt in (("pt", "torch"), ("dcp", "dcp"), ("st", "safetensors")):  # each as its export writes it
        result = shardstore.verify(src, tmp_path / out, format=fmt)
        assert result.ok, (fmt, result.differences)


@pytest.mark.parametrize("kind", ["z1-bf16", "z2", "z3-bf16", "z2-fp16", "z1-bf16-fp32acc", "ds0.14.4/z0-bf16"])
def test_hf_export_loads_with_the_gathered_models_logits(kind: str, tmp_path: Path) -> None:
    """Config, generation config and tokenizer from beside the tag folder, no flag; the fp32 masters are
    the weights, and config.json says float32 though the Trainer's says bfloat16 for a bf16 run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fixtures.deepspeed_zero import IDS

    shardstore.unshard(_src(kind), tmp_path / "hf", format="hf", jobs=2)
    def dtype(config: Path) -> str:  # transformers 4 calls it torch_dtype
        saved = json.loads(config.read_text())
        return saved.get("dtype", saved.get("torch_dtype"))

    assert dtype(tmp_path / "hf" / "config.json") == "float32"
    if "-" in kind:  # the Trainer's config says the run's half precision
        assert dtype(_src(kind) / "config.json") in ("bfloat16", "float16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    live = _expected(kind)["live"]  # the masters the live engine gathered (without zero files: its module's)
    partitioned = any((_src(kind) / TAG).glob("*optim_states.pt"))
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits,
                           reference_logits(_src(kind), live["fp32"] if partitioned else live["module"], IDS))
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("w1 w5")["input_ids"] == \
        AutoTokenizer.from_pretrained(_src(kind))("w1 w5")["input_ids"]
    shardstore.unshard(_src(kind), tmp_path / "hf16", format="hf", dtype="bfloat16", jobs=2)
    assert dtype(tmp_path / "hf16" / "config.json") == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf16").dtype == torch.bfloat16


def test_the_save_folder_the_tag_folder_and_a_run_of_checkpoints(tmp_path: Path) -> None:
    """The Trainer's checkpoint-N/ (its `latest` names the tag), the tag folder itself, and a run folder of
    several checkpoint-N/ picked by --step (or, without it, the newest) name the same files."""
    units = open_source(_src("z2")).units
    assert len(units) == 4 and units[0].endswith(f"{TAG}/mp_rank_00_model_states.pt")
    assert open_source(_src("z2") / TAG).units == units
    run = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(_src("z2"), run / f"checkpoint-{step}")
    assert open_source(run, step=4).units[0].startswith(str(run / "checkpoint-4"))
    assert open_source(run).units[0].startswith(str(run / "checkpoint-4"))  # the newest, as the Trainer takes it


def test_the_trainers_own_files_in_checkpoint_n_are_not_the_models(tmp_path: Path) -> None:
    """The HF Trainer's checkpoint-N/ also holds the 16-bit weights it saved itself (model.safetensors,
    here sharded with its index), its state, arguments and RNG states, DeepSpeed's zero_to_fp32.py, and
    (a PEFT run) adapter_config.json: the DeepSpeed checkpoint is read, and only the model's config,
    generation config and tokenizer go beside the export; no index or adapter config describing other
    weights."""
    from safetensors.torch import load_file, save_file

    src = shutil.copytree(_src("z2-bf16"), tmp_path / "checkpoint-2")
    module = {k: v.to(torch.bfloat16) for k, v in _expected("z2-bf16")["live"]["module"].items() if "lm_head" not in k}
    save_file(module, src / "model.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "model.safetensors" for k in module}}))
    (src / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (src / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    for name in ("training_args.bin", "rng_state_0.pth", "zero_to_fp32.py"):
        (src / name).write_bytes(b"not the model")
    assert open_source(src).format == "deepspeed"
    model = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    for fmt in ("hf", "safetensors"):
        shardstore.unshard(src, tmp_path / fmt, format=fmt, jobs=2)
        assert set(exported(tmp_path / fmt)) == model | {"model.safetensors"}, fmt
    want = {**_expected("z2-bf16")["fp32"]}
    del want["lm_head.weight"]
    assert_bitwise_equal(load_file(tmp_path / "hf" / "model.safetensors"), want, "the fp32 masters")


@pytest.mark.parametrize("kind", ["z1-bf16", "z1-bf16-fp32acc", "z0-bf16"])
def test_strict_reads_deepspeeds_own_records(kind: str, tmp_path: Path) -> None:
    """ZeroStageEnum, LossScaler and fragment_address are inert records even under --strict (nothing of
    DeepSpeed is imported); any other class is still refused."""
    shardstore.unshard(_src(kind), tmp_path / "out", format="torch", strict=True, jobs=1)
    assert (tmp_path / "out" / "model.pt").exists()


def test_a_missing_optimizer_file_is_named_before_anything_is_read(tmp_path: Path) -> None:
    src = shutil.copytree(_src("z3"), tmp_path / "src")
    (src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt: missing"):
        open_source(src)


@pytest.mark.parametrize("copied, over, says", [
    ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_2_mp_rank_00_optim_states.pt",
     "group 0's padding is 0, not"),  # the last rank alone holds the end padding
    ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
     "holds the slices of other parameters than rank 1's"),  # the same lengths: told apart by its slices
])
def test_a_rank_file_copied_over_another_is_refused_by_name(copied: str, over: str, says: str,
                                                           tmp_path: Path) -> None:
    src = shutil.copytree(_src("z2"), tmp_path / "src")
    shutil.copy(src / TAG / copied, src / TAG / over)
    with pytest.raises(CheckpointError, match=f"{over}: {says}"):
        shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)
    assert not (tmp_path / "out" / "model.pt").exists()


def test_a_zero3_optimizer_file_copied_over_another_is_refused_by_name(tmp_path: Path) -> None:
    """ZeRO-3 files say nothing of their rank, and a copy has every length right: it is the same file twice."""
    src = shutil.copytree(_src("z3"), tmp_path / "src")
    over = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(src / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt", src / TAG / over)
    with pytest.raises(CheckpointError, match=f"{over}: the same file as zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)
    assert not (tmp_path / "out").exists()


def test_a_zero2_frozen_fragment_of_another_shape_is_refused_by_name(tmp_path: Path) -> None:
    src = shutil.copytree(_src("z2"), tmp_path / "src")
    path = src / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    (name, whole), = state["frozen_param_fragments"].items()
    state["frozen_param_fragments"][name] = whole[:8].clone()
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=rf"frozen parameter {name} is \[8\] in frozen_param_fragments but "
                                              rf"\[16\] in frozen_param_shapes"):
        shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)


def test_from_object_storage_on_a_dask_cluster(cluster, tmp_path: Path) -> None:
    """ZeRO-3 on S3, unsharded by Dask workers (one task per file): what local workers write."""
    from safetensors.torch import load_file

    from tests.conftest import upload

    c, _ = cluster
    url = upload(_src("z3"), "s3://ds-zero/checkpoint-2", "*.json")
    upload(_src("z3"), url, "latest")
    upload(_src("z3") / TAG, f"{url}/{TAG}", "*.pt")
    shardstore.unshard(url, tmp_path / "st", scheduler=c.scheduler_address)
    shardstore.unshard(_src("z3"), tmp_path / "local", jobs=2)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"),
                         load_file(tmp_path / "local" / "model.safetensors"), "safetensors")


class TestDeepSpeedConformance(FormatTests):
    @pytest.fixture(params=["z2", "z3-bf16", "z1-bf16-fp32acc", "z0-bf16", "z2-bf16-rr", "z2-elastic"])
    def checkpoint(self, request) -> Path:
        return _src(request.param)

    @pytest.fixture
    def foreign(self, checkpoint: Path) -> Path:
        other = "z3" if checkpoint.name.startswith("z2") else "z2"
        return _src(other) / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def test_the_flat_order_is_read_from_as_many_ranks_mappings_as_it_takes() -> None:
    """Rank 0's part may lie within the first parameter (a large embedding, many ranks), where both
    orders agree: later ranks' mappings decide, and no more are read than that."""
    from types import SimpleNamespace

    from shardstore.read.formats.deepspeed import Layout, _flat_order

    saved = [("emb", (10,)), ("b", (5,)), ("a", (5,))]  # param_shapes, in round-robin order
    layout = Layout(2, 4, [saved], {}, {}, [[0, 0, 0]], [5])
    module = {"emb": None, "a": None, "b": None}  # the order the flat vector keeps
    truth = [("emb", 0, 10), ("a", 10, 5), ("b", 15, 5)]

    def mappings(rank: int) -> list[dict[str, SimpleNamespace]]:
        asked.append(rank)
        lo, hi = rank * 5, rank * 5 + 5
        return [{n: SimpleNamespace(state={"start": max(s, lo) - lo, "numel": min(s + k, hi) - max(s, lo)})
                 for n, s, k in truth if s < hi and s + k > lo}]

    asked: list[int] = []
    assert _flat_order(layout, module, mappings).groups == [[("emb", (10,)), ("a", (5,)), ("b", (5,))]]
    assert asked == [0, 1, 2]  # ranks 0 and 1 hold only the embedding
    asked.clear()
    assert _flat_order(Layout(2, 4, [saved[:1]], {}, {}, [[0]], [5]), {"emb": None}, mappings).groups == [saved[:1]]
    assert asked == []  # one order only: nothing to read


class _StandIn:
    """Pickles back as it was unpickled: called with arguments (an enum's value), or built from state."""

    def __init__(self, *args: object) -> None:
        self.__dict__["_args"] = args

    def __reduce_ex__(self, protocol: int):  # type: ignore[override]
        if "_args" in self.__dict__:
            state = {k: v for k, v in self.__dict__.items() if k != "_args"}
            return (type(self), self._args) + ((state,) if state else ())
        return object.__reduce_ex__(self, protocol)


def _edit(path: Path, change, monkeypatch) -> None:
    """`path` loaded, changed and saved again by torch, DeepSpeed's own classes in it (its loss scaler) kept
    as they were named: DeepSpeed is not installed here, so stand-ins are put where a save finds them."""
    import pickle
    import types

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                parts = module.split(".")
                for i in range(1, len(parts) + 1):  # a save imports every package on the way
                    if ".".join(parts[:i]) not in sys.modules:
                        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
                if not hasattr(sys.modules[module], name):
                    setattr(sys.modules[module], name, type(name, (_StandIn,), {"__module__": module, "__qualname__": name}))
                return getattr(sys.modules[module], name)

    loader = types.ModuleType("loader")
    loader.Unpickler, loader.load = Unpickler, pickle.load
    state = torch.load(path, weights_only=False, pickle_module=loader)
    change(state)
    torch.save(state, path)


@pytest.mark.parametrize("kind, name, change", [
    ("z3", "zero_pp_rank_1_mp_rank_00_model_states.pt", lambda s: s.__setitem__("global_samples", 7)),
    ("z3", "zero_pp_rank_2_mp_rank_00_optim_states.pt",
     lambda s: s["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][0].__setitem__("lr", 0.5)),
    ("z2", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
     lambda s: [st.__setitem__("step", st["step"] + 5) for st in s["optimizer_state_dict"]["base_optimizer_state"]["state"].values()]),
])
def test_a_file_of_another_save_is_refused_naming_the_value(kind: str, name: str, change, tmp_path: Path,
                                                            monkeypatch) -> None:
    """A file of the same run at another step (what a job that crashed while saving over its folder
    leaves): every length is right; its step, param_groups or engine counters give it away."""
    src = shutil.copytree(_src(kind), tmp_path / "src")
    path = src / TAG / name
    _edit(path, change, monkeypatch)
    with pytest.raises(CheckpointError, match=f"{name} and .* are from two different saves"):
        shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)
    assert not (tmp_path / "out" / "model.pt").exists()


@pytest.mark.parametrize("kind, name", [
    ("z2", "mp_rank_00_model_states.pt"),
    ("z3", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ("z3", "zero_pp_rank_2_mp_rank_00_model_states.pt"),
    ("z0", "mp_rank_00_model_states.pt"),
    ("ds0.14.4/z2-bf16", "mp_rank_00_model_states.pt"),
])
def test_a_model_states_file_recording_another_step_than_its_folder_is_refused(kind: str, name: str, tmp_path: Path,
                                                                              monkeypatch) -> None:
    """DeepSpeed names a tag folder by the engine's step (`global_step{global_steps}`), which every
    model-states file records: a file of another save copied in (every length right, and under ZeRO-1/2
    the only one) is refused naming it; the genuine folder passes, as do the shared-* saves, whose tag
    (DeepSpeed's test_shared_weights's "checkpoint") names no step."""
    src = shutil.copytree(_src(kind), tmp_path / "src")
    shardstore.unshard(src, tmp_path / "genuine", format="torch", jobs=1)
    assert torch.load(tmp_path / "genuine" / "train.pt", weights_only=False)["global_steps"] == 2
    _edit(src / TAG / name, lambda s: s.__setitem__("global_steps", 3), monkeypatch)
    with pytest.raises(CheckpointError, match=rf"{name}: records global_steps 3, but its folder is {TAG}"):
        shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)
    assert not (tmp_path / "out" / "model.pt").exists()
