"""`.metadata` written without torch (export/dcp_metadata.py), against torch's own classes and reader."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

import shardstore
from shardstore.export import dcp as dcp_export
from shardstore.export.dcp_metadata import metadata


def _torch_metadata(described, mappings, results):
    """`.metadata` as torch's own classes build it from the same description (the reference)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    chunks, storage = {}, {}
    for name, written in results:
        for item, offset, length in written:
            if item.chunk is None:
                storage[MetadataIndex(item.fqn)] = _StorageInfo(name, offset, length)
                continue
            index = len(chunks.setdefault(item.fqn, []))
            chunks[item.fqn].append(ChunkStorageMetadata(torch.Size(item.chunk[0]), torch.Size(item.chunk[1])))
            storage[MetadataIndex(item.fqn, torch.Size(item.chunk[0]), index)] = _StorageInfo(name, offset, length)
    state = {fqn: BytesStorageMetadata() if what[0] == "bytes" else
             TensorStorageMetadata(TensorProperties(dtype=getattr(torch, what[1])), torch.Size(what[2]), chunks.get(fqn, []))
             for fqn, what in described.items()}
    return Metadata(state, planner_data=mappings, storage_data=storage, version="1.0.0")


def test_metadata_written_without_torch_loads_as_torch_builds_it(checkpoints, tmp_path: Path) -> None:
    """The `.metadata` shardstore pickles from stand-ins loads (with torch) as the Metadata torch's own
    classes make of the same items, field for field, for tensors of several dtypes and for bytes items."""
    src = checkpoints(2)
    store = shardstore.ingest(tmp_path / "store", sorted(src.glob("rank*.pt")), jobs=1)
    plan = dcp_export.plan_dcp(store)
    results = [dcp_export.write_items(store, tmp_path / name, items, False) for name, items in zip(plan.names, plan.files)]
    dtypes = {what[1] for what in plan.described.values() if what[0] == "tensor"}
    assert len(dtypes) >= 1 and any(what[0] == "bytes" for what in plan.described.values())
    ours = pickle.loads(metadata(plan.described, plan.mappings, results))
    assert ours == _torch_metadata(plan.described, plan.mappings, results)
    assert metadata(plan.described, plan.mappings, list(reversed(results))) == \
        metadata(plan.described, plan.mappings, results)  # the same bytes however the files came


def test_every_encoding_pickle_chooses_loads_as_torch_builds_it() -> None:
    """Past the cases a small checkpoint reaches: more than 1,000 entries (pickle's batches), more than 256
    remembered strings (a long reference), a key of more than 255 bytes, non-ASCII keys, offsets past 2**31
    and 2**62, a tensor of one chunk and of none, bytes items, planner data with list indices."""
    described, results, mappings = {}, [], {}
    files: dict[str, list] = {"__1_0.distcp": [], "__0_0.distcp": []}
    for i in range(1_203):
        fqn = f"model.layers.{i}.wéight" + ("x" * 300 if i == 7 else "")
        described[fqn] = ("tensor", ("bfloat16", "float32", "float8_e4m3fn")[i % 3], (2**40 + i, 3))
        mappings[fqn] = ("model", "layers", i, "wéight")
        chunks = [] if i % 11 == 0 else [((0, 0), (2**31 + i, 3))] if i % 2 else [((0, 0), (5, 3)), ((2**62 + i, 0), (2**40, 3))]
        for n, chunk in enumerate(chunks):
            files[f"__{n % 2}_0.distcp"].append((dcp_export.Item(fqn, chunk, None, 6), 1000 * i + n, 17 + i))
    for i in range(3):
        described[f"step.{i}"] = ("bytes",)
        files["__0_0.distcp"].append((dcp_export.Item(f"step.{i}", None, None, 8), 2**33 + i, 8))
    results = list(files.items())  # not in the files' order: the chunks are indexed in it all the same
    ours = pickle.loads(metadata(described, mappings, results))
    assert ours == _torch_metadata(described, mappings, sorted(results, key=lambda r: r[0]))
    assert len(ours.state_dict_metadata) == 1_206 and len(ours.storage_data) > 1_000
