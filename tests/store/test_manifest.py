"""The manifest is the contract: a store from a newer shardstore is refused, clearly, and left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardstore
from shardstore.errors import StoreError
from shardstore.store.manifest import FORMAT_VERSION, MANIFEST_KEY


def test_newer_store_format_is_refused(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    shardstore.ingest(tmp_path / "s", [src / "rank0.pt"], jobs=1)
    manifest = tmp_path / "s" / MANIFEST_KEY
    data = json.loads(manifest.read_text())
    data["version"] = FORMAT_VERSION + 1
    manifest.write_text(json.dumps(data))
    before = manifest.read_bytes()
    with pytest.raises(StoreError, match="newer shardstore"):
        shardstore.open(tmp_path / "s")
    proc = subprocess.run([sys.executable, "-m", "shardstore.cli", "ingest", str(tmp_path / "s"), str(src / "rank1.pt")],
                          capture_output=True, text=True)
    last = proc.stderr.strip().splitlines()[-1].split("\r")[-1]
    assert proc.returncode == 1 and last.startswith("shardstore: error: ") and "newer shardstore" in last
    assert manifest.read_bytes() == before and not (tmp_path / "s" / "__shardstore__" / "ranks" / "1.json").exists()


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_store_is_still_read_and_completed(checkpoints, tmp_path: Path, version: int) -> None:
    """Stores of format 1 name cells with Zarr's "/" separator, and commit records before format 3 never
    hold staged bytes (a shardstore of then reads them from staging files): this version finishes such a
    store in its own format and exports it."""
    import dataclasses

    import numpy as np
    import zarr

    from shardstore import values
    from shardstore.plan import plan_checkpoint
    from shardstore.read.discover import source_of_files, spec_of
    from shardstore.store.store import Store
    from tests.conftest import expected

    src = checkpoints(2)
    manifest = plan_checkpoint(spec_of(source_of_files([src / "rank0.pt"]), values.encode))
    Store.create(tmp_path / "s", dataclasses.replace(manifest, version=version))
    shardstore.ingest(tmp_path / "s", [src / "rank0.pt", src / "rank1.pt"], jobs=1)
    cell = ("c", "1", "0") if version == 1 else ("c.1.0",)
    assert (tmp_path / "s" / "model" / "wte.weight").joinpath(*cell).is_file()
    records = [json.loads((tmp_path / "s" / "__shardstore__" / "ranks" / f"{r}.json").read_text()) for r in (0, 1)]
    assert all(rec["staged"] and "staging" not in rec for rec in records)
    assert sorted(os.listdir(tmp_path / "s" / "__shardstore__" / "staging")) == ["0.bin", "1.bin"]
    want = expected(src)["model"]["wte.weight"].numpy()
    assert np.array_equal(zarr.open_array(tmp_path / "s" / "model" / "wte.weight", mode="r")[:], want)
    shardstore.export(tmp_path / "s", tmp_path / "out")
    from safetensors.numpy import load_file

    assert np.array_equal(load_file(tmp_path / "out" / "model.safetensors")["wte.weight"], want)


def test_the_checkpoint_facts_are_typed_and_versioned(checkpoints, tmp_path: Path) -> None:
    """A store written before the facts were typed (an untyped `extra`) reads as the same facts and is
    completed; facts of a newer version are refused, naming the store."""
    from shardstore.facts import FACTS_VERSION, CheckpointFacts

    src = checkpoints(2)
    shardstore.ingest(tmp_path / "s", [src / "rank0.pt"], jobs=1)
    manifest = tmp_path / "s" / MANIFEST_KEY
    data = json.loads(manifest.read_text())
    facts = data["facts"]
    assert facts["format"] == "torch-save" and facts["version"] == FACTS_VERSION and "skim" in facts["reader"]
    legacy = {k: v for k, v in data.items() if k != "facts"}
    legacy["extra"] = {"group_size": facts["group_size"], "replicas": facts["replicas"], "format": facts["format"],
                       **facts["reader"]}
    manifest.write_text(json.dumps(legacy))
    store = shardstore.open(tmp_path / "s")
    assert store.manifest.facts == CheckpointFacts.from_json(facts, "x")
    shardstore.ingest(tmp_path / "s", [src / "rank1.pt"], jobs=1)
    assert shardstore.open(tmp_path / "s").status().ok
    data["facts"]["version"] = FACTS_VERSION + 1  # the typed manifest, as written before, from a newer shardstore
    manifest.write_text(json.dumps(data))
    with pytest.raises(StoreError, match=f"checkpoint facts of version {FACTS_VERSION + 1}, written by a newer shardstore"):
        shardstore.open(tmp_path / "s")


def test_tied_names_round_trip_and_older_facts_have_none() -> None:
    """DeepSpeed's shared_params are a typed fact: (the tied name's keys, the store path of its tensor);
    facts written before it existed read as none."""
    from shardstore.facts import CheckpointFacts

    facts = CheckpointFacts.of("deepspeed", 1, 1, {"tied": [[["model", "lm_head.weight"], "model/wte"]], "x": 1})
    assert facts.tied == ((("model", "lm_head.weight"), "model/wte"),) and facts.reader == {"x": 1}
    again = CheckpointFacts.from_json(json.loads(json.dumps(facts.to_json())), "m")
    assert again == facts
    older = {k: v for k, v in facts.to_json().items() if k != "tied"}
    assert CheckpointFacts.from_json(older, "m").tied == ()


@pytest.mark.parametrize("format, flags", [("torch-save", (True, True, True)), ("dtensor-files", (True, False, True)),
                                           ("dcp", (False, False, False)), ("deepspeed", (False, False, True))])
def test_version_1_facts_read_as_the_flags_their_format_had(format: str, flags: tuple[bool, bool, bool]) -> None:
    """Exports read the input format's flags from the manifest, never from the read registry: a store
    planned before they were recorded gets the flags its format had then, and recorded ones win."""
    from shardstore.read.registry import get
    from shardstore.facts import CheckpointFacts

    old = {"version": 1, "format": format, "reader": {"megatron_args": {"num_layers": 2}}}
    facts = CheckpointFacts.from_json(old, "m")
    assert (facts.ranked, facts.group_claims, facts.keeps_empty_values) == flags
    fmt = get(format)
    assert flags == (fmt.ranked, fmt.group_claims, fmt.keeps_empty_values)  # what the registry says today
    assert facts.megatron_args == {"num_layers": 2} and "megatron_args" not in facts.reader
    recorded = CheckpointFacts.from_json({**old, "ranked": not flags[0]}, "m")
    assert recorded.ranked is not flags[0]
    with pytest.raises(StoreError, match="corrupt manifest"):
        CheckpointFacts.from_json({**old, "ranked": "yes"}, "m")


def test_a_tasks_part_of_the_manifest_holds_its_paths_alone(dcp_checkpoints, tmp_path: Path) -> None:
    """What a worker's task is sent instead of reading the manifest (`Manifest.part`): the arrays, values
    and non-tensors at its paths and below its subtrees, everything else as it was, and no tree."""
    src = dcp_checkpoints("fsdp1")
    shardstore.ingest(tmp_path / "store", sorted(str(p) for p in src.glob("*.distcp")), jobs=1)
    m = shardstore.open(tmp_path / "store").manifest
    leaves = m.tree.leaf_paths()
    arrays, values = [p for p in leaves if p in m.arrays], [p for p in leaves if p not in m.arrays]
    assert len(arrays) > 2 and len(values) > 2
    exact = arrays[1::2] + values[::2] + ["model/no.such.path"]
    part = m.part(reversed(exact))
    assert set(part.arrays) == set(arrays[1::2]) and set(part.objects) == set(values[::2])
    assert part.facts.not_tensors == m.facts.not_tensors & set(exact) and part.facts.not_tensors
    assert (part.world_size, part.layout, part.version) == (m.world_size, m.layout, m.version)
    assert part.facts.metadata == m.facts.metadata and part.facts.units == m.facts.units
    assert part.tree.leaf_paths() == [] and m.tree.leaf_paths() == leaves
    top = arrays[0].split("/")[0]
    below = m.part([], frozenset([top]))
    assert set(below.arrays) == {p for p in m.arrays if p.startswith(top + "/")} and below.arrays
    assert m.part([], frozenset([""])).arrays == m.arrays


@pytest.mark.parametrize("packed", [False, True])
def test_the_manifest_written_in_pieces_is_jsons_own_encoding(checkpoints, tmp_path: Path, packed: bool) -> None:
    """The manifest is written a few arrays at a time (`json_parts`): whatever the batch, its bytes are
    `json.dumps` of the whole (what stores written before it hold), and read back as the same manifest."""
    import dataclasses

    from shardstore.store.manifest import Manifest

    store = shardstore.ingest(tmp_path / "s", sorted(checkpoints(2).glob("rank*.pt")), jobs=1)
    manifest = dataclasses.replace(store.manifest, packed=packed)
    assert len(manifest.arrays) > 3
    whole = json.loads((tmp_path / "s" / MANIFEST_KEY).read_bytes())
    whole["packed"] = True
    if not packed:
        del whole["packed"]
    for batch in (1, 2, 1024):
        pieces = list(manifest.json_parts(batch))
        assert len(pieces) >= min(len(manifest.arrays), 1 + len(manifest.arrays) // batch)
        assert b"".join(pieces) == json.dumps(whole).encode()
        assert Manifest.from_json(json.loads(b"".join(pieces)), "m") == manifest
