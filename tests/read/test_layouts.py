"""Every cluster's layout, with no layout flag: OLMo, Composer with HSDP, odd world sizes, exotic dtypes,
two steps in one folder with latest-* symlinks, and a pickle as torch 1.x / numpy 1.x wrote it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.errors import CheckpointError
from shardstore.read.discover import open_source
from shardstore.read.formats.rankfile import read_rank_file
from shardstore.read.layouts import discover, name_rank
from shardstore.read.primitives import tensors
from tests.conftest import assert_bitwise_equal
from tests.fixtures import legacy
from tests.fixtures.layouts import expected


@pytest.fixture(scope="module")
def composer(layout_checkpoints) -> Path:
    # 8 ranks as 2 replica groups of 4, placements on cuda with 4 devices per node, two steps + latest links.
    return layout_checkpoints("composer-hsdp", 8, "composer", steps=(10, 20), replicas=2, device="cuda",
                              devices_per_node=4)


def test_olmo_layout_odd_world_size_bfloat16(layout_checkpoints, tmp_path: Path) -> None:
    src = layout_checkpoints("olmo-w3-bf16", 3, "olmo", dtype="bfloat16")
    want = expected("olmo", "bfloat16")
    shardstore.unshard(src, tmp_path / "st", store=tmp_path / "store")
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), want["model"])
    shardstore.export(tmp_path / "store", tmp_path / "pt", format="torch")
    optim = torch.load(tmp_path / "pt" / "optim.pt", weights_only=True)
    assert_bitwise_equal({k: {n: v[n] for n in ("exp_avg", "exp_avg_sq")} for k, v in optim["state"].items()},
                         want["optim"])
    assert shardstore.open(tmp_path / "store").manifest.layout == "olmo"


def test_two_steps_and_latest_links_are_never_mixed(composer: Path) -> None:
    assert [p.parent.name for p in discover(composer, tag="latest")] == ["ep0-ba20"] * 8
    assert discover(composer) == discover(composer, tag="latest")  # the links Composer points with
    assert [p.name for p in discover(composer, step=10)] == [f"ep0-ba10-rank{r}.pt" for r in range(8)]
    assert [p.name for p in discover(composer / "ep0-ba20")] == [f"ep0-ba20-rank{r}.pt" for r in range(8)]
    assert discover(composer, tag="ep0-ba20") == discover(composer / "ep0-ba20")


def test_composer_hsdp_unshards_bit_exactly(composer: Path, tmp_path: Path) -> None:
    want = expected("composer")
    shardstore.unshard(composer, tmp_path / "hf", store=tmp_path / "store", tag="latest", verify_replicas=True,
                       strip_prefix="model.", jobs=2)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert_bitwise_equal(got, {k.removeprefix("model."): v for k, v in want["model"].items()})

    ls = subprocess.run([sys.executable, "-m", "shardstore.cli", "ls", str(tmp_path / "store")], capture_output=True,
                        text=True)
    assert "layout: composer (Composer's nesting: state/model, state/optimizers)   world size: 8 (2 replica groups of 4)   ranks ingested: 8/8" in ls.stdout
    store = shardstore.open(tmp_path / "store")
    assert store.manifest.layout == "composer"
    # skimmed, each file decoding its own group's lists (no one list is every group's)
    facts = store.manifest.facts
    assert (facts.group_size, facts.replicas, facts.format, facts.reader) == (4, 2, "torch-save", {"skim": {}})
    assert store["state/timestamp"]["batch"] == 20  # the step --tag latest points at
    assert store.values("state/dataset_state")[5] == {"train": {"sample_in_epoch": 645}}

    shardstore.export(store, tmp_path / "pt", format="torch")
    ckpt = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=True)
    assert list(ckpt) == ["state", "rng"] and list(ckpt["state"])[:2] == ["model", "optimizers"]
    assert_bitwise_equal(ckpt["state"]["model"], want["model"])
    opt_state = ckpt["state"]["optimizers"]["DecoupledAdamW"]["state"]
    assert_bitwise_equal({k: {"exp_avg": v["exp_avg"]} for k, v in opt_state.items()}, want["optim"])
    assert [r["python"] for r in ckpt["rng"]] == list(range(8))  # every rank's RNG state, in rank order


@pytest.mark.parametrize("tasks", ["apart", "batched", "batched-packed"])
@pytest.mark.parametrize("name, width, rows, element", [
    ("wte.weight", 24, 25, [27, 7]),  # small: staged, compared at assembly
    ("head.big", 600, 150, [152, 7]),  # large: its own cells, compared when the second copy arrives
])
def test_replicas_that_differ_are_reported(composer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name,
                                           width, rows, element, tasks: str) -> None:
    """`batched`: tasks as large as the ingest would ever make them (ranks 1-7 in one), so the two copies
    would share a batch; every replica is still compared with the first copy. `packed`: in a packed store
    (store/packs.py), where the first copy is in the pack the task is still writing."""
    if tasks.startswith("batched"):
        import importlib

        monkeypatch.setattr(importlib.import_module("shardstore.ingest"), "TASKS_PER_WORKER", 1)
    if tasks.endswith("packed"):
        from shardstore.store import packs

        monkeypatch.setattr(packs, "ON_FILE_SYSTEMS", True)
    src = tmp_path / "src"
    shutil.copytree(composer / "ep0-ba10", src)
    victim = src / "ep0-ba10-rank5.pt"  # group 1's copy of the shard rank 1 holds in group 0
    rf = read_rank_file(victim)
    piece = rf.leaves[f"state/model/model.transformer.{name}"].pieces[0]
    assert piece.offsets[0] == rows
    start, _ = tensors.byte_range(piece.container, piece.tensor)
    rf.close()
    data = bytearray(victim.read_bytes())
    data[start + 4 * (width * 2 + 7)] ^= 0x01  # row 2 of the shard, column 7
    victim.write_bytes(bytes(data))
    shardstore.unshard(src, tmp_path / "ok", jobs=1)  # first arrival wins: group 0's copy (one pass: claims)
    shardstore.unshard(src, tmp_path / "ok2", jobs=1, store=tmp_path / "store")  # (two steps: the store's cells)
    shardstore.unshard(composer / "ep0-ba10", tmp_path / "untouched", jobs=1)
    oks = ["ok", "ok2"]
    if tasks.endswith("packed"):  # every copy compared, a task's records placing its cells in two packs
        shardstore.unshard(composer / "ep0-ba10", tmp_path / "verified", jobs=1, verify_replicas=True)
        oks.append("verified")
    for ok in oks:
        assert (tmp_path / ok / "model.safetensors").read_bytes() == \
            (tmp_path / "untouched" / "model.safetensors").read_bytes(), ok
    with pytest.raises(CheckpointError, match=rf"rank5.pt: replica of .*{name} differs .* element \[{element[0]}, 7\]"):
        shardstore.unshard(src, tmp_path / "bad", verify_replicas=True, jobs=1)


def test_exotic_dtypes_nesting_and_zero_d(layout_checkpoints, tmp_path: Path) -> None:
    src = layout_checkpoints("dtypes-w3", 3, "dtypes")
    want = expected("dtypes")
    shardstore.unshard(src, tmp_path / "pt", format="torch")
    ckpt = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=True)
    assert_bitwise_equal(ckpt, {
        "weights": {k: v for k, v in want.items() if k != "mask"},
        "nested": [want["mask"], (want["f16"], torch.tensor(7, dtype=torch.int64)), torch.tensor(2.5)],
        "counter": torch.tensor(123456789012, dtype=torch.int64)})
    shardstore.unshard(src, tmp_path / "st", select="weights")
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), {k: v for k, v in want.items() if k != "mask"})


def test_torch1_numpy1_pickle(tmp_path: Path) -> None:
    checked_in = Path(__file__).parents[1] / "fixtures" / "data" / "legacy"
    for path in legacy.write(tmp_path / "regenerated"):
        assert path.read_bytes() == (checked_in / path.name).read_bytes()
    shardstore.unshard(checked_in, tmp_path / "pt", format="torch", store=tmp_path / "store")
    ckpt = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=False)
    assert_bitwise_equal(ckpt["model"]["w"], torch.from_numpy(legacy.FULL))
    assert_bitwise_equal(ckpt["model"]["scale"], torch.from_numpy(legacy.BF16_BITS).view(torch.bfloat16))
    name, keys, pos = ckpt["rng"]["numpy"]
    assert (name, keys.dtype.str, keys.tolist(), pos) == ("MT19937", "<u4", [0, 1, 2, 3], 624)
    assert shardstore.open(tmp_path / "store").values("rng")[1]["numpy"][1].tolist() == [1, 2, 3, 4]


def test_file_name_and_content_must_agree(layout_checkpoints, tmp_path: Path) -> None:
    src = layout_checkpoints("olmo-w3-bf16", 3, "olmo", dtype="bfloat16")
    bad = tmp_path / "src"
    bad.mkdir()
    shutil.copy(src / "rank0.pt", bad / "rank0.pt")
    shutil.copy(src / "rank0.pt", bad / "rank1.pt")
    shutil.copy(src / "rank2.pt", bad / "rank2.pt")
    with pytest.raises(CheckpointError, match="rank1.pt: named rank 1 but holds rank 0"):
        shardstore.unshard(bad, tmp_path / "out", jobs=1)
    (bad / "rank1.pt").unlink()
    shutil.copy(src / "rank2.pt", bad / "other.pt")
    with pytest.raises(CheckpointError, match="two files hold rank 2"):
        shardstore.ingest(tmp_path / "store", [bad / "rank0.pt", bad / "rank2.pt", bad / "other.pt"], jobs=1)


@pytest.mark.parametrize("name", ["checkpoint-40", "epoch=1-step=40.ckpt", "step-40", "step40", "global_step40",
                                  "global_step_40", "iter_0000040", "ep1-ba40", "step_40", "checkpoint_40"])
def test_a_step_is_found_by_every_trainers_own_name_for_it(name: str) -> None:
    """--step N: the HF Trainer's checkpoint-N, Lightning's epoch=E-step=N.ckpt, torchtitan's step-N,
    DeepSpeed's global_stepN, veRL's global_step_N, Megatron-LM's iter_{N:07d}, Composer's ep{E}-ba{N},
    Accelerate's checkpoint_N (trainers/ `Steps`)."""
    from shardstore.read.source import names_step

    assert names_step(name, 40)
    assert not names_step(name, 4) and not names_step(name, 400)
    assert not names_step(name.replace("40", "140"), 40)


def test_composer_latest_links_out_of_the_run_are_refused(tmp_path: Path) -> None:
    """latest-rank{r}.pt linking to another run's files: refused in one line naming where the first leads,
    nothing left, whether the links are followed (--tag latest) or merely found; a rank named in other
    digits (`rank٩.pt`) is no rank file."""
    from tests.refusals import assert_refused, cli

    corpus = Path(__file__).parents[1] / "corpus" / "data" / "composer-t2.1-hsdp-w4" / "ep0-ba1"
    other, run = tmp_path / "other" / "ep0-ba1", tmp_path / "run"
    shutil.copytree(corpus, other)
    run.mkdir()
    for rank in range(4):
        (run / f"latest-rank{rank}.pt").symlink_to(other / f"ep0-ba1-rank{rank}.pt")
    for tag in (["--tag", "latest"], []):
        assert_refused(cli("unshard", run, tmp_path / "out", "-q", *tag),
                       f"{run / 'latest-rank0.pt'}: leads to {other / 'ep0-ba1-rank0.pt'}, outside {run}")
        assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="leads to"):
        discover(run, tag="latest")
    assert name_rank("rank٩.pt") is None and name_rank("ep0-ba1-rank٣.pt") is None


@pytest.mark.parametrize("writer, named", [("fsdp1", "step{}"), ("fsdp2", "checkpoint-{}")])
def test_a_run_of_per_rank_files_in_step_folders(writer: str, named: str, checkpoints, fsdp2_files,
                                                 tmp_path: Path) -> None:
    """A plain FSDP run saving `torch.save(state_dict, f"{folder}/model_rank{r}.pt")` per rank into a step
    folder per save (FSDP1 ShardedTensors, FSDP2 DTensors): the newest is taken and named, --step, --tag,
    latest_checkpointed_iteration.txt and a `latest` link take another, and two steps are never one rank
    set. The saves are the training scripts' (tests/fixtures/fsdp.py, fsdp2_files.py) at two settings, so
    that files of one step read as the other's could not match what the processes gathered."""
    from tests.conftest import expected as gathered
    from tests.refusals import cli

    if writer == "fsdp1":
        saves = {2: checkpoints(3), 4: checkpoints(3, dtype="bfloat16")}
        want = {step: gathered(folder)["model"] for step, folder in saves.items()}
    else:
        saves = {2: fsdp2_files("tp", 4), 4: fsdp2_files("hsdp", 4)}
        want = {step: torch.load(f"{folder}.expected.pt.ref", weights_only=True) for step, folder in saves.items()}
    run = tmp_path / "run"
    for step, folder in saves.items():
        (run / named.format(step)).mkdir(parents=True)
        for f in folder.glob("*rank*.pt"):
            shutil.copy(f, run / named.format(step) / f"model_rank{name_rank(f)}.pt")

    proc = cli("unshard", run, tmp_path / "newest", "-j", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == f"unshard: the checkpoint in {run / named.format(4)}"
    assert_bitwise_equal(load_file(tmp_path / "newest" / "model.safetensors"), want[4])
    shardstore.unshard(run, tmp_path / "two", step=2, jobs=1)
    assert_bitwise_equal(load_file(tmp_path / "two" / "model.safetensors"), want[2])

    def taken(**how: object) -> str:
        units = open_source(run, **how).units  # type: ignore[arg-type]
        assert len({Path(u).parent for u in units}) == 1
        return Path(units[0]).parent.name

    assert taken(tag=named.format(2)) == taken(tag="model", step=2) == named.format(2)
    (run / "latest_checkpointed_iteration.txt").write_text("2\n")
    assert taken() == named.format(2)
    (run / "latest_checkpointed_iteration.txt").unlink()
    (run / "latest").symlink_to(named.format(2))  # OLMo's pointer to its newest step folder
    assert taken() == taken(tag="latest") == named.format(2)
    (run / "latest").unlink()
    (run / named.format(4) / "model_rank1.pt").unlink()  # the newest save, one rank short: never filled from step 2
    with pytest.raises(CheckpointError, match="rank files are missing for ranks 1$"):
        shardstore.unshard(run, tmp_path / "short", jobs=1)


def test_what_is_not_a_sharded_checkpoint_is_named(checkpoints, tmp_path: Path) -> None:
    """What users give in place of a sharded checkpoint is refused in one line saying what it is, nothing
    left: a GGUF file, weights already saved whole (the Trainer's pytorch_model.bin, torch's own
    dcp_to_torch_save file: the file, or the folder it is in), an empty folder; a rank file of 0 bytes (a
    copy still being written) is named as empty, wherever it is in the rank order."""
    import struct

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.refusals import assert_refused, cli

    def refused(src: Path, *needles: str) -> None:
        assert_refused(cli("unshard", src, tmp_path / "out", "-q"), f"{src}: ", *needles)
        assert not (tmp_path / "out").exists()

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # version 3, no tensors, no metadata
    refused(gguf, "a GGUF file")
    hf = tmp_path / "hf"
    hf.mkdir()
    torch.save(torch.nn.Linear(4, 3).state_dict(), hf / "pytorch_model.bin")  # as the Trainer saves a model whole
    refused(hf, "holds pytorch_model.bin and no shards", "already unsharded: nothing to do")
    with pytest.raises(CheckpointError, match="model.bin: one file, not a folder of shards: .* already unsharded"):
        discover(hf / "pytorch_model.bin")
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    (tmp_path / "whole").mkdir()
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "whole" / "model.pt")
    with pytest.raises(CheckpointError, match="whole: holds model.pt and no shards: .* already unsharded"):
        discover(tmp_path / "whole")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty: an empty folder: no checkpoint in it$"):
        discover(tmp_path / "empty")

    run = tmp_path / "run"
    shutil.copytree(checkpoints(3), run, ignore=shutil.ignore_patterns("*.ref"))
    (run / "rank0.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"rank0.pt: an empty file \(0 bytes\): truncated, or still being"):
        shardstore.unshard(run, tmp_path / "out", jobs=1)
    shutil.copy(checkpoints(3) / "rank0.pt", run / "rank0.pt")
    (run / "rank2.pt").write_bytes(b"")
    assert_refused(cli("unshard", run, tmp_path / "out", "-q"), f"{run / 'rank2.pt'}: an empty file (0 bytes)")
    assert not (tmp_path / "out" / "model.safetensors").exists()
