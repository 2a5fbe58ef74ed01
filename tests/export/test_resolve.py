"""Resolving a store back into a state dict: the original nesting and container types, tensors still on
disk, per-rank values from the rank asked for."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

import shardstore
from shardstore.errors import ExportError
from shardstore.export.resolve import ArrayRef, build, leaves, node_at, object_value
from tests.conftest import expected
from tests.fixtures.fsdp import trainer_state


@pytest.fixture
def store(checkpoints, tmp_path: Path) -> shardstore.Store:
    return shardstore.ingest(tmp_path / "s", sorted(checkpoints(2).glob("rank*.pt")), jobs=1)


def test_build_keeps_nesting_and_container_types(store: shardstore.Store, checkpoints) -> None:
    model = build(store, node_at(store.manifest.tree, "model"))
    want = expected(checkpoints(2))["model"]
    assert type(model) is collections.OrderedDict and list(model) == list(want)
    assert model["wte.weight"] == ArrayRef("model/wte.weight", "float32", (1000, 300))
    assert model["wte.weight"].nbytes == 1000 * 300 * 4
    assert type(build(store, node_at(store.manifest.tree, "model"), plain_dicts=True)) is dict
    optim = build(store, node_at(store.manifest.tree, "optim"))
    assert optim["param_groups"] == want_groups(checkpoints)


def want_groups(checkpoints) -> list:
    return expected(checkpoints(2))["optim"]["param_groups"]


def test_per_rank_values_come_from_the_rank_asked_for(store: shardstore.Store) -> None:
    lowest = object_value(store, "rng/python")
    assert lowest == trainer_state(0, 2)["rng"]["python"]
    assert object_value(store, "rng/python", rank=1) == trainer_state(1, 2)["rng"]["python"] != lowest
    with pytest.raises(ExportError, match="rank 5 has not been ingested"):
        object_value(store, "rng/python", rank=5)


def test_leaves_give_keys_in_state_dict_order(store: shardstore.Store, checkpoints) -> None:
    got = list(leaves(node_at(store.manifest.tree, "optim/state")))
    state = expected(checkpoints(2))["optim"]["state"]
    assert [keys for keys, _ in got] == [[p, k] for p in state for k in state[p]]
    assert got[0][1] == f"optim/state/{next(iter(state))}/{next(iter(state[next(iter(state))]))}"


def test_node_at_names_what_is_missing(store: shardstore.Store) -> None:
    assert node_at(store.manifest.tree, "/model/").path == "model"
    assert node_at(store.manifest.tree, "").path == ""
    with pytest.raises(ExportError, match="no subtree 'model/nope'"):
        node_at(store.manifest.tree, "model/nope")
