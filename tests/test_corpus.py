"""Every member of the corpus (tests/corpus/data/, README.md there), unsharded in every output format and
compared bit for bit with what the processes that wrote it gathered themselves (`expected.json`: each
tensor's SHA-256, from FSDP's FULL_STATE_DICT or DTensor's full_tensor()).

The members were written once by the torch version each names (1.13.1 to 2.13) with the trainers' own
code paths (tests/corpus/make.py); this test only reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from tests.conftest import assert_bitwise_equal
from tests.corpus.make import digests

DATA = Path(__file__).parent / "corpus" / "data"
MEMBERS = sorted(p.name for p in DATA.iterdir() if (p / "member.json").exists()) if DATA.exists() else []


def member(name: str) -> dict[str, Any]:
    return json.loads((DATA / name / "member.json").read_text())


def expected(name: str) -> dict[str, Any]:
    return json.loads((DATA / name / "expected.json").read_text())


def test_corpus_is_there() -> None:
    """The corpus covers what it claims (README.md there): torch 2.0, 2.1 and 2.13 at least."""
    written = {member(n)["torch"] for n in MEMBERS}
    assert {"2.0", "2.1", "2.13"} <= written, written


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory):
    """member -> (store, safetensors export): one ingest per member, through the one-shot API."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            base = tmp_path_factory.mktemp(name)
            shardstore.unshard(DATA / name, base / "safetensors", store=base / "store", jobs=2)
            made[name] = base / "store", base / "safetensors"
        return made[name]

    return get


def _optim_by_name(optim: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter id (OLMo `local`'s optim.pt) keyed by name instead.
    Read back from DCP the ids are "17", not 17: DCP names every dict key by its str()."""
    names = {str(pid): n for g in optim["param_groups"] for pid, n in zip(g["params"], g["param_names"])}
    return {"state": {names[str(pid)]: s for pid, s in optim["state"].items()}}


def _unflatten_optim(flat: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's flattened optimizer state ("state.<fqn>.<key>") as {"state": {fqn: {key: value}}}."""
    state: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("state."):
            fqn, _, k = key.removeprefix("state.").rpartition(".")
            state.setdefault(fqn, {})[k] = value
    return {"state": state}


def as_gathered(trainer: str, sd: dict[str, Any]) -> dict[str, Any]:
    """A state dict in the checkpoint's own nesting, as {"model": ..., "optim": ...} like the gather."""
    if trainer in ("composer", "composer-dcp"):
        return {"model": sd["state"]["model"], "optim": sd["state"]["optimizers"]["DecoupledAdamW"]}
    if trainer == "torchtitan-dcp":
        return {"model": {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)},
                "optim": _unflatten_optim(sd["optimizer"])}
    if trainer == "olmo-local":
        return {"model": sd["model"], "optim": _optim_by_name(sd["optim"])}
    return {"model": sd["model"], "optim": sd["optim"]}


def assert_matches(name: str, got: dict[str, Any], what: str, optim: bool = True) -> None:
    """Every tensor of the gather (model, and optimizer state with `optim`) is in `got`, bit for bit."""
    want = {k: v for k, v in expected(name).items() if "sha256" in v and (optim or k.startswith("model/"))
            and not k.startswith("optim/param_groups")}
    have = digests(got)
    missing = sorted(set(want) - set(have))
    assert not missing, f"{name} {what}: missing {missing[:5]}"
    wrong = [k for k in want if have[k] != want[k]]
    assert not wrong, f"{name} {what}: {wrong[:5]} differ from the gather: {[(have[k], want[k]) for k in wrong[:2]]}"


@pytest.mark.parametrize("name", MEMBERS)
def test_safetensors(name: str, stores) -> None:
    _, out = stores(name)
    files = sorted(out.glob("*.safetensors"))
    assert files, f"{name}: no safetensors written"
    weights = {k: v for f in files for k, v in load_file(f).items()}
    assert_matches(name, {"model": weights}, "safetensors", optim=False)


def _torch_export(name: str, store: Path, out: Path) -> dict[str, Any]:
    shardstore.export(shardstore.open(store), out, format="torch")
    if (out / "model.pt").exists():
        return {"model": torch.load(out / "model.pt", weights_only=True),
                "optim": torch.load(out / "optim.pt", weights_only=True)}
    return torch.load(out / "checkpoint.pt", weights_only=False)


@pytest.mark.parametrize("name", MEMBERS)
def test_torch(name: str, stores, tmp_path: Path) -> None:
    store, _ = stores(name)
    sd = _torch_export(name, store, tmp_path / "torch")
    assert_matches(name, as_gathered(member(name)["trainer"], sd), "--format torch")


@pytest.mark.parametrize("name", MEMBERS)
def test_dcp(name: str, stores, tmp_path: Path) -> None:
    """DCP out, read back by torch's own dcp_to_torch_save: the state dict in the input's nesting."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    store, _ = stores(name)
    shardstore.export(shardstore.open(store), tmp_path / "dcp", format="dcp")
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    sd = torch.load(tmp_path / "back.pt", weights_only=False)
    assert_matches(name, as_gathered(member(name)["trainer"], sd), "--format dcp")


DCP_MEMBERS = [n for n in MEMBERS if member(n)["trainer"].endswith("-dcp")]


@pytest.mark.parametrize("name", DCP_MEMBERS)
def test_dcp_torch_is_dcp_to_torch_save(name: str, stores, tmp_path: Path) -> None:
    """For a DCP input, `--format torch` is exactly torch's own dcp_to_torch_save of it: every value,
    the trainer's io.BytesIO buffers and Composer's every-rank rng list included."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    store, _ = stores(name)
    (folder,) = [p.parent for p in (DATA / name).glob("*/.metadata")]
    dcp_to_torch_save(folder, tmp_path / "torch-own.pt")
    want = torch.load(tmp_path / "torch-own.pt", weights_only=False)
    assert_bitwise_equal(_torch_export(name, store, tmp_path / "torch"), want, name, ordered=True)
