"""The HF Trainer's and Accelerate's FSDP `SHARDED_STATE_DICT` checkpoints: `checkpoint-N/` holding
`pytorch_model_fsdp_0/` and `optimizer_0/`, two DCP folders side by side, written by accelerate's own
saving code (tests/fixtures/accelerate_fsdp.py; kept in tests/fixtures/data/accelerate/), read as one
checkpoint without --tag, against what the live FSDP2 ranks gathered.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.read.discover import open_source
from tests.conftest import exported
from tests.export.conformance import OutputTests, PartialOutputTests
from tests.read.conformance import FormatTests

DATA = Path(__file__).parents[2] / "fixtures" / "data" / "accelerate"
CONFIG = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 32}  # the fixtures' tiny Llama
LAYOUTS = ["fsdp2-w2", "fsdp2-w3", "fsdp1-w3"]  # an odd world size: uneven shards; FSDP1 (accelerate's default)


def _want(layout: str) -> dict:
    return torch.load(DATA / f"{layout}.expected.pt.ref", weights_only=True)


def by_number(optimizer: dict) -> dict:
    """An optimizer state dict keyed by parameter name (FSDP's) as Optimizer.state_dict() keys it."""
    names = [n for group in optimizer["param_groups"] for n in group["params"]]
    return {names.index(name): moments for name, moments in optimizer["state"].items()}


def same_optimizer(got: dict, want: dict) -> None:
    """`got` (keyed by parameter number) holds bit for bit the moments of `want` (keyed by name)."""
    state, saved = got["state"], by_number(want)
    assert set(state) == set(saved) and all(torch.equal(state[k][n], saved[k][n]) for k in saved for n in saved[k])
    sizes = [len(g["params"]) for g in want["param_groups"]]
    assert [g["params"] for g in got["param_groups"]] == [list(range(sum(sizes[:i]), sum(sizes[:i + 1])))
                                                           for i in range(len(sizes))]
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]


def _as_gathered(src: Path, want: dict, tmp_path: Path, optimizer: str, resume: dict[str, str]) -> None:
    """--format torch: the trainer's own files to resume from, the model and the optimizer's state bit for
    bit what the live ranks gathered, its scheduler, RNG and trainer state byte for byte; safetensors: the
    model alone."""
    from safetensors.torch import load_file

    shardstore.unshard(src, tmp_path / "pt", format="torch", jobs=2)
    assert exported(tmp_path / "pt") == sorted(["pytorch_model.bin", optimizer, *resume])
    model = torch.load(tmp_path / "pt" / "pytorch_model.bin", weights_only=True)
    assert set(model) == set(want["model"]) and all(torch.equal(model[k], v) for k, v in want["model"].items())
    same_optimizer(torch.load(tmp_path / "pt" / optimizer, weights_only=True), want["optimizer"])
    for name, saved in resume.items():
        assert (tmp_path / "pt" / name).read_bytes() == (src / "checkpoint-4" / saved).read_bytes(), name
    shardstore.unshard(src, tmp_path / "st", jobs=2)
    assert exported(tmp_path / "st") == ["model.safetensors"]
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert set(st) == set(want["model"]) and all(torch.equal(st[k], v) for k, v in want["model"].items())


TRAINER_FILES = {"scheduler.pt": "scheduler.pt", "rng_state.pth": "rng_state_0.pth",
                 "trainer_state.json": "trainer_state.json", "training_args.bin": "training_args.bin"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_model_and_optimizer_folders_are_one_checkpoint(layout: str, tmp_path: Path) -> None:
    """Given the run folder or checkpoint-4/, no --tag: --format torch writes what the Trainer resumes
    from without FSDP, bit for bit what the live ranks gathered; safetensors takes the model alone,
    --select the optimizer (its state keyed by parameter name, as saved)."""
    from safetensors.torch import load_file

    want = _want(layout)
    for given in (DATA / layout, DATA / layout / "checkpoint-4"):
        assert open_source(given).format == "dcp"
    _as_gathered(DATA / layout, want, tmp_path, "optimizer.pt", TRAINER_FILES)
    shardstore.unshard(DATA / layout, tmp_path / "opt", select="optimizer", jobs=2)
    opt = load_file(tmp_path / "opt" / "model.safetensors")
    moments = want["optimizer"]["state"]["model.norm.weight"]
    assert torch.equal(opt["state.model.norm.weight.exp_avg"], moments["exp_avg"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_export_of_the_trainers_checkpoint_gives_the_models_logits(layout: str, tmp_path: Path) -> None:
    """The Trainer writes no config.json for sharded checkpoints: without --hf-config the export asks for
    one before any ingest; with it, transformers loads the folder and gives the live model's logits."""
    from transformers import AutoModelForCausalLM

    want = _want(layout)
    with pytest.raises(shardstore.ExportError, match="--hf-config"):
        shardstore.unshard(DATA / layout, tmp_path / "none", format="hf")
    assert not (tmp_path / "none").exists()
    (tmp_path / "config.json").write_text(json.dumps(want["config"]))
    shardstore.unshard(DATA / layout, tmp_path / "hf", format="hf", hf_config=tmp_path / "config.json", jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(input_ids=want["ids"]).logits
    assert torch.equal(logits, want["logits"])  # the same weights, the same code, the same machine


def test_a_run_of_trainer_checkpoints_is_picked_by_step_or_the_newest(tmp_path: Path) -> None:
    """A Trainer run folder of checkpoint-N/ folders: --step picks one, and without it the newest is taken,
    as the Trainer's get_last_checkpoint takes it (by number: checkpoint-12 after checkpoint-8)."""
    run = tmp_path / "run"
    for step in (4, 8, 12):
        shutil.copytree(DATA / "fsdp2-w2" / "checkpoint-4", run / f"checkpoint-{step}")
        state = json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({**state, "global_step": step}))
    assert open_source(run, step=8).units[0].startswith(str(run / "checkpoint-8" / "pytorch_model_fsdp_0"))
    assert open_source(run).units[0].startswith(str(run / "checkpoint-12" / "pytorch_model_fsdp_0"))


def test_a_trainer_state_of_another_step_is_refused(tmp_path: Path) -> None:
    """checkpoint-8/ whose trainer_state.json says global_step 4: files of two saves, refused up front."""
    shutil.copytree(DATA / "fsdp2-w2" / "checkpoint-4", tmp_path / "checkpoint-8")
    with pytest.raises(shardstore.CheckpointError, match=r"trainer_state.json: records global_step 4, but its "
                                                         r"folder is checkpoint-8"):
        shardstore.unshard(tmp_path / "checkpoint-8", tmp_path / "out", format="torch")
    assert not (tmp_path / "out").exists()


def test_one_of_the_folders_given_alone_is_that_folder(tmp_path: Path) -> None:
    """optimizer_0/ given itself is a DCP checkpoint of its own: the optimizer's state alone. --format hf
    of it is refused before any ingest, naming what it holds, and leaves no OUT behind."""
    optimizer = DATA / "fsdp2-w2" / "checkpoint-4" / "optimizer_0"
    shardstore.unshard(optimizer, tmp_path / "pt", format="torch")
    got = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=False)
    assert list(got) == ["optimizer"]
    (tmp_path / "config.json").write_text(json.dumps(_want("fsdp2-w2")["config"]))
    with pytest.raises(shardstore.ExportError, match="holds no model weights, only optimizer"):
        shardstore.unshard(optimizer, tmp_path / "hf", format="hf", hf_config=tmp_path / "config.json")
    assert not (tmp_path / "hf").exists()


def test_a_file_of_another_part_is_refused(tmp_path: Path) -> None:
    """A model .distcp file copied over the optimizer's: its items are not where the optimizer's metadata
    places them, and the worker that opens it refuses it by name."""
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(DATA / "fsdp2-w2" / "checkpoint-4", ckpt)
    shutil.copy(ckpt / "pytorch_model_fsdp_0" / "__1_0.distcp", ckpt / "optimizer_0" / "__1_0.distcp")
    with pytest.raises(shardstore.CheckpointError, match=r"optimizer_0/__1_0.distcp"):
        shardstore.unshard(ckpt, tmp_path / "out", format="torch", jobs=1)


def test_hf_export_takes_the_config_the_trainers_final_save_left_in_output_dir(tmp_path: Path) -> None:
    """The Trainer's save_model at the end of the run writes config.json into output_dir, above its
    checkpoint-N/ folders: --format hf of a checkpoint finds it there with no flag, and leaves the metrics
    train() wrote beside it (all_results.json, train_results.json) out. Without it there, a checkpoint-M/
    of the run saved whole (with its config.json) describes the model."""
    from transformers import AutoModelForCausalLM

    want = _want("fsdp2-w2")
    run = tmp_path / "output_dir"
    shutil.copytree(DATA / "fsdp2-w2" / "checkpoint-4", run / "checkpoint-4")
    (run / "config.json").write_text(json.dumps(want["config"]))
    for metrics in ("all_results.json", "train_results.json"):
        (run / metrics).write_text(json.dumps({"train_loss": 4.6, "epoch": 0.4}))
    shardstore.unshard(run / "checkpoint-4", tmp_path / "hf", format="hf", jobs=2)
    assert exported(tmp_path / "hf") == ["config.json", "model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=want["ids"]).logits, want["logits"])
    (run / "checkpoint-2").mkdir()
    (run / "config.json").rename(run / "checkpoint-2" / "config.json")
    shardstore.unshard(run / "checkpoint-4", tmp_path / "hf2", format="hf", jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=want["ids"]).logits, want["logits"])


def test_a_model_saved_at_the_top_level_beside_its_trainers_parts_is_what_safetensors_takes(tmp_path: Path) -> None:
    """torchtitan's CheckpointManager: dcp.save of the model's keys at the top level (its ModelWrapper
    flattens them) beside `optimizer`, `train_state`, `lr_scheduler`, `dataloader` (here written by torch's
    dcp.save in that shape, not by torchtitan). safetensors and hf take the model's keys alone; --select
    names any part."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = {"tok_embeddings.weight": torch.randn(10, 4), "layers.0.attention.wq.weight": torch.randn(4, 4),
             "norm.weight": torch.randn(4)}
    moments = {"step": torch.tensor(3.0), "exp_avg": torch.randn(10, 4)}
    dcp.save({**model, "optimizer": {"state": {"tok_embeddings.weight": moments},
                                     "param_groups": [{"lr": 0.1, "params": ["tok_embeddings.weight"]}]},
              "train_state": {"step": 3}, "lr_scheduler": {"last_epoch": 3}, "dataloader": {"pos": 7}},
             checkpoint_id=tmp_path / "run" / "step-3", no_dist=True)
    shardstore.unshard(tmp_path / "run", tmp_path / "st", step=3)
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert list(st) == list(model) and all(torch.equal(st[k], v) for k, v in model.items())
    shardstore.unshard(tmp_path / "run", tmp_path / "named", select="model")  # the model at the top, by name
    assert load_file(tmp_path / "named" / "model.safetensors").keys() == st.keys()
    shardstore.unshard(tmp_path / "run", tmp_path / "opt", select="optimizer")
    assert torch.equal(load_file(tmp_path / "opt" / "model.safetensors")["state.tok_embeddings.weight.exp_avg"],
                       moments["exp_avg"])
    shardstore.unshard(tmp_path / "run", tmp_path / "pt", format="torch")
    got = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=False)
    assert got["train_state"] == {"step": 3} and set(got) == {*model, "optimizer", "train_state", "lr_scheduler",
                                                               "dataloader"}


BIN = DATA / "fsdp2-w3-bin"  # accelerate's use_dcp=False save: each rank's torch.save of its shards


@pytest.mark.parametrize("layout", ["fsdp2-w3-bin", "fsdp1-w3-bin"])  # DTensors; FSDP1's ShardedTensors
def test_accelerates_per_rank_files_are_one_checkpoint(layout: str, tmp_path: Path) -> None:
    """pytorch_model_fsdp_0_rank{r}.bin beside optimizer_0_rank{r}.bin (W=3): found without --tag from the
    run folder or checkpoint-4/; --format torch writes what Accelerate's load_state takes without FSDP, bit
    for bit what the live ranks gathered; safetensors takes the model."""
    want = _want(layout)
    assert open_source(DATA / layout).format == open_source(DATA / layout / "checkpoint-4").format == "accelerate"
    _as_gathered(DATA / layout, want, tmp_path, "optimizer.bin", {"scheduler.bin": "scheduler.bin",
                                                                   "random_states_0.pkl": "random_states_0.pkl"})


def test_an_fsdp1_rank_file_renamed_to_another_rank_is_refused(tmp_path: Path) -> None:
    """FSDP1's ShardedTensor metadata places each shard on a rank: a file copied over another rank's name
    holds the shard of its own rank, and the worker that opens it refuses it by name."""
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(DATA / "fsdp1-w3-bin" / "checkpoint-4", ckpt)
    shutil.copy(ckpt / "pytorch_model_fsdp_0_rank1.bin", ckpt / "pytorch_model_fsdp_0_rank2.bin")
    with pytest.raises(shardstore.CheckpointError, match=r"pytorch_model_fsdp_0_rank2.bin: .*local shard is not "
                                                         r"the one its metadata places on rank 2"):
        shardstore.unshard(ckpt, tmp_path / "out", format="torch", jobs=1)


def test_accelerates_per_rank_files_refuse_a_missing_rank_and_a_file_in_anothers_place(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(BIN / "checkpoint-4", ckpt)
    (ckpt / "optimizer_0_rank2.bin").unlink()
    with pytest.raises(shardstore.CheckpointError, match="optimizer's files of ranks 2 are missing"):
        shardstore.unshard(ckpt, tmp_path / "out", format="torch")
    shutil.copy(ckpt / "optimizer_0_rank1.bin", ckpt / "optimizer_0_rank2.bin")
    with pytest.raises(shardstore.CheckpointError, match="optimizer_0_rank2.bin"):
        shardstore.unshard(ckpt, tmp_path / "out", format="torch", jobs=1)


class TestAccelerateConformance(FormatTests):
    @pytest.fixture(params=["fsdp2-w3-bin", "fsdp1-w3-bin"])
    def checkpoint(self, request: pytest.FixtureRequest) -> Path:
        return DATA / request.param / "checkpoint-4"

    @pytest.fixture
    def foreign(self, tmp_path: Path) -> Path:
        return DATA / "fsdp2-w2-bin" / "checkpoint-4" / "pytorch_model_fsdp_0_rank1.bin"  # a save at W=2


def _tiny_llama(layout: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)  # other weights than the checkpoint's: the resume must replace them
    return LlamaForCausalLM(LlamaConfig(**_want(layout)["config"]))


def test_the_trainers_files_of_an_earlier_export_are_refused_or_replaced(tmp_path: Path) -> None:
    """The torch export's files for the Trainer, left in OUT, are an earlier export's: a safetensors export
    into OUT refuses them by name before any ingest, and --overwrite removes them once it is whole."""
    shardstore.unshard(DATA / "fsdp2-w2", tmp_path / "out", format="torch")
    with pytest.raises(shardstore.ExportError, match=r"optimizer\.pt.*pytorch_model\.bin|earlier export"):
        shardstore.unshard(DATA / "fsdp2-w2", tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    shardstore.unshard(DATA / "fsdp2-w2", tmp_path / "out", overwrite=True)
    assert exported(tmp_path / "out") == ["model.safetensors"]


class TestAccelerateOutputs(OutputTests, PartialOutputTests):
    """FSDP1's per-rank files: every output format, one pass against two steps."""

    hf_config = CONFIG

    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        return DATA / "fsdp1-w3-bin" / "checkpoint-4"
