"""End to end: real FSDP checkpoints -> shardstore -> both export formats, against torch's own gather."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardstore
from tests.conftest import Phases, assert_bitwise_equal, expected
from tests.fixtures.fsdp import trainer_state


@pytest.mark.parametrize("world_size", [1, 2, 3, 6, 8])
def test_unshard_matches_torch_gather_in_both_formats(checkpoints, tmp_path: Path, world_size: int) -> None:
    src = checkpoints(world_size)
    want = expected(src)

    shardstore.unshard(src, tmp_path / "st", store=tmp_path / "store", jobs=2)
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), want["model"], "safetensors")
    with safe_open(tmp_path / "st" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == sorted(want["model"])  # safetensors lists keys sorted

    shardstore.export(tmp_path / "store", tmp_path / "pt", format="torch")
    model = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    optim = torch.load(tmp_path / "pt" / "optim.pt", weights_only=True)
    assert type(model) is dict and list(model) == list(want["model"])  # OLMo writes plain dicts, in order
    assert_bitwise_equal(model, want["model"], "model.pt")
    assert_bitwise_equal(optim, want["optim"], "optim.pt")
    train = torch.load(tmp_path / "pt" / "train.pt", weights_only=False)
    assert train["global_train_tokens_seen"] == 12 * world_size and train["world_size"] == world_size
    assert "rng" not in train and "model" not in train  # the trainer state alone, as OLMo's unsharder writes it


def test_bfloat16_bits_survive(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(3, dtype="bfloat16")
    want = expected(src)
    shardstore.unshard(src, tmp_path / "out", store=tmp_path / "store", jobs=1)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert_bitwise_equal(got, want["model"])
    store = shardstore.open(tmp_path / "store")
    assert store["model/wte.weight"].dtype == torch.bfloat16
    assert_bitwise_equal(store["model/wte.weight"][10:20], want["model"]["wte.weight"][10:20])


def test_lazy_handles_and_values(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(3)
    want = expected(src)
    store = shardstore.ingest(tmp_path / "store", sorted(src.glob("rank*.pt")), jobs=1)
    wte = store["model/wte.weight"]
    assert wte.shape == torch.Size([1000, 300]) and wte.dtype == torch.float32 and len(wte) == 1000
    for sel in [slice(0, 4), slice(330, 340), (slice(995, 1000), slice(7, 9)), 999]:
        assert_bitwise_equal(wte[sel], want["model"]["wte.weight"][sel], str(sel))
    assert wte.ranks == [0, 1, 2]
    assert store["optim/state/wte.weight/step"].item() == want["optim"]["state"]["wte.weight"]["step"].item()
    assert store["optim/param_groups"] == want["optim"]["param_groups"]
    states = store.values("rng/python")  # differs per rank: every rank's value is kept
    assert states == {r: trainer_state(r, 3)["rng"]["python"] for r in range(3)} and states[0] != states[1]
    assert store["rng/python"] == states[0]  # the lowest rank's, as rank-0 writers do
    assert "model/wte.weight" in store.keys() and "rng/torch" in store


def test_safetensors_options(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    want = expected(src)["model"]
    store = shardstore.ingest(tmp_path / "store", sorted(src.glob("rank*.pt")), jobs=1)

    result = shardstore.export(store, tmp_path / "split", max_shard_size=600_000)
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "split").glob("model-*.safetensors"))
    assert len(shards) == len(set(index["weight_map"].values())) >= 2
    assert all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    merged = {}
    for name in shards:
        merged.update(load_file(tmp_path / "split" / name))
    assert_bitwise_equal(merged, want)
    assert {k: v for k, v in index["weight_map"].items()} == {
        k: n for n in shards for k in load_file(tmp_path / "split" / n)}
    assert result.files[-1].name == "model.safetensors.index.json"

    shardstore.export(store, tmp_path / "bf16", dtype="bfloat16", strip_prefix="wte.")
    got = load_file(tmp_path / "bf16" / "model.safetensors")
    assert set(got) == {"weight"} | {k for k in want if not k.startswith("wte.")}
    assert_bitwise_equal(got["weight"], want["wte.weight"].to(torch.bfloat16))
    assert_bitwise_equal(got["proj.bias"], want["proj.bias"].to(torch.bfloat16))

    shardstore.export(store, tmp_path / "optim", select="optim/state/wte.weight")
    got = load_file(tmp_path / "optim" / "model.safetensors")
    assert_bitwise_equal(got, {k: v for k, v in expected(src)["optim"]["state"]["wte.weight"].items()})


def test_unshard_to_safetensors_writes_no_tensor_into_its_scratch_store(checkpoints, tmp_path: Path, monkeypatch) -> None:
    """The model goes straight into the output (sink/, each format's `plan_direct`); the optimizer, which safetensors does
    not take, is never written anywhere."""
    import importlib

    ingest_module = importlib.import_module("shardstore.ingest")  # (shardstore.ingest is the API's function)
    src = checkpoints(2)
    seen: list[str] = []
    original = ingest_module.Session.ingest

    def spy(*args, **kwargs):  # the real ingest; we only look at the store it leaves before export
        store = original(*args, **kwargs)
        seen.append("<ingested>")
        seen.extend(p for p in store.manifest.arrays if store.cells_present(p))
        return store

    monkeypatch.setattr(ingest_module.Session, "ingest", spy)
    shardstore.unshard(src, tmp_path / "out")
    assert seen == ["<ingested>"]  # no tensor's bytes went into the scratch store
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])
    assert not (tmp_path / "out" / ".shardstore-scratch").exists()


def test_the_readme_api_examples_run_verbatim_as_a_plain_script(checkpoints, tmp_path: Path) -> None:
    """The README's Python block, unchanged, in a .py file with no main guard, on the quick start's
    checkpoint: every call works (worker processes do not re-run the script), and what it leaves is real."""
    import re
    import shutil
    import subprocess
    import sys

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## Python API\n.*?```python\n(.*?)```", readme, re.S).group(1)
    assert "__main__" not in block
    shutil.copytree(checkpoints(4, "hf"), tmp_path / "demo" / "ckpt")  # what the quick start makes
    (tmp_path / "example.py").write_text(block)
    run = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "refusing to load global pathlib.PosixPath" in run.stdout
    assert "bootstrapping" not in run.stderr
    assert (tmp_path / "demo" / "hf" / "config.json").exists() and (tmp_path / "demo" / "dcp" / ".metadata").exists()
    assert {p.name for p in (tmp_path / "demo" / "pt").iterdir()} >= {"model.pt", "optim.pt", "train.pt"}
    want = expected(tmp_path / "demo" / "ckpt")["model"]
    got = load_file(tmp_path / "demo" / "st" / "model.safetensors")  # the bf16 re-export, prefix stripped
    assert set(got) == {k.removeprefix("model.") for k in want}
    assert all(got[k.removeprefix("model.")].equal(v.to(torch.bfloat16)) for k, v in want.items())
    assert re.search(r"^ingest: .* in [0-9.]+ s$", run.stderr, re.M)  # progress=True, one line per phase


def test_mistakes_are_refused_before_anything_is_ingested(checkpoints, tmp_path: Path, monkeypatch) -> None:
    """Each of these is known once the checkpoint is planned: refused then, in one line, with no ingest
    begun and no scratch store left behind."""
    import os

    from shardstore.errors import ExportError

    src = checkpoints(2)  # OLMo's trainer layout with no config.yaml: nothing says which HF model it is
    out = tmp_path / "out"

    def refused(error: type[Exception], match: str, **options: object) -> None:
        phases = Phases()
        with pytest.raises(error, match=match):
            shardstore.unshard(src, out, jobs=1, progress=phases, **options)
        assert phases.phases == [] and not shardstore.scratch_location(out).exists()

    refused(TypeError, "unexpected keyword argument 'fromat'", fromat="hf")
    refused(ExportError, "no config.yaml .* give --hf-config PATH", format="hf")
    refused(ExportError, "no subtree", select="nowhere")
    shardstore.unshard(src, out, jobs=1)  # model.safetensors
    refused(ExportError, r"earlier export that this one would not replace \(model.safetensors\); use --overwrite",
            format="torch")
    real = os.statvfs

    def nearly_full(path: object) -> os.statvfs_result:
        fs = real(path)
        return os.statvfs_result((fs.f_bsize, 4096, fs.f_blocks, 10, 10) + tuple(fs)[5:])  # 40 KiB free

    monkeypatch.setattr(os, "statvfs", nearly_full)
    refused(ExportError, r"not enough disk space: this run needs about [0-9.]+ MiB for the output, "
                         r"but .* has 40.0 KiB free", format="dcp", overwrite=True)  # one pass: no store copy
    refused(ExportError, r"not enough disk space: this run needs about .* for the store \+ .* for the output, "
                         r"but .* has 40.0 KiB free", format="dcp", overwrite=True, verify_replicas=True)
    monkeypatch.undo()
    assert shardstore.unshard(src, out, jobs=1, format="torch", overwrite=True).replaced == [out / "model.safetensors"]


def test_options_are_taken_by_name_only(tmp_path: Path) -> None:
    """A call written for another signature (a store, a world size, a format given by place) is refused
    as Python refuses it, before anything is read; an export's format alone may be given by place."""
    with pytest.raises(TypeError, match="positional argument"):
        shardstore.unshard(tmp_path / "src", tmp_path / "out", tmp_path / "store")  # type: ignore[misc]
    with pytest.raises(TypeError, match="positional argument"):
        shardstore.watch(tmp_path / "store", tmp_path / "src", 3)  # type: ignore[misc]
    with pytest.raises(TypeError, match="positional argument"):
        shardstore.average([tmp_path / "a", tmp_path / "b"], tmp_path / "out", None, "torch")  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument 'fromat'"):
        shardstore.export(tmp_path / "store", tmp_path / "out", fromat="hf")
    assert not (tmp_path / "out").exists()
