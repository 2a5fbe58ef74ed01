"""safetensors export: the planned files are what gets written, and the index is the one transformers writes."""

from __future__ import annotations

import json
from pathlib import Path

import shardstore
from shardstore.export import model_subtree
from shardstore.export.registry import request
from shardstore.export.resolve import node_at
from shardstore.export.safetensors import plan_safetensors
from tests.conftest import expected, exported


def test_the_plan_names_exactly_the_files_written(checkpoints, tmp_path: Path) -> None:
    store = shardstore.ingest(tmp_path / "s", sorted(checkpoints(2).glob("rank*.pt")), jobs=1)
    node = node_at(store.manifest.tree, model_subtree(store))
    for limit in (600_000, 5_000_000_000):
        plan = plan_safetensors(store, node, request(max_shard_size=limit))
        result = shardstore.export(store, tmp_path / str(limit), max_shard_size=limit)
        assert [p.name for p in result.files] == plan.files
        assert exported(tmp_path / str(limit)) == sorted(plan.files)


def test_index_carries_total_size_and_total_parameters(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    store = shardstore.ingest(tmp_path / "s", sorted(src.glob("rank*.pt")), jobs=1)
    shardstore.export(store, tmp_path / "out", max_shard_size=600_000, dtype="bfloat16")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    model = expected(src)["model"]
    assert index["metadata"] == {"total_parameters": sum(t.numel() for t in model.values()),
                                 "total_size": sum(t.numel() * 2 for t in model.values())}
