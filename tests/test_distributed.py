"""Ingestion on a real Dask cluster (worker processes over TCP on loopback) into a store on S3."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import shardstore
from shardstore.errors import CheckpointError
from tests.conftest import Phases, assert_bitwise_equal, expected, upload


def test_eight_ranks_on_two_workers_one_killed_mid_run(cluster, checkpoints, tmp_path: Path) -> None:
    c, client = cluster
    src = checkpoints(8)
    url = upload(src, "s3://ckpt-c/run")
    killed: list[tuple[int, int]] = []  # (its pid, how many tasks it held when it died)

    def kill_a_busy_worker_once(result: object) -> None:
        if killed:
            return
        busy = {worker: keys for worker, keys in client.processing().items() if keys}
        if not busy:
            return  # nothing held by a worker right now: at the next completion
        worker = sorted(busy)[0]
        pid = client.run(os.getpid, workers=[worker])[worker]
        os.kill(pid, signal.SIGKILL)  # it holds tasks: they are lost with it, and must run again elsewhere
        killed.append((pid, len(busy[worker])))

    store = shardstore.ingest("s3://ckpt-c/store", [f"{url}/rank{r}.pt" for r in range(8)],
                              scheduler=c.scheduler_address, on_done=kill_a_busy_worker_once)
    assert killed and killed[0][1] > 0  # a worker died holding work: there was something to recover
    assert store.status().ok and store.status().ranks_done == list(range(8))
    shardstore.export(store, tmp_path / "out")
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])


def test_a_failing_task_names_the_rank_file_and_the_worker(cluster, checkpoints, tmp_path: Path) -> None:
    import s3fs

    c, _ = cluster
    src = checkpoints(3)
    url = upload(src, "s3://ckpt-d/run")
    s3fs.S3FileSystem().pipe(f"{url.removeprefix('s3://')}/rank1.pt", b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"rank1.pt: not a torch checkpoint.*on Dask worker tcp://127\.0\.0\.1"):
        shardstore.ingest("s3://ckpt-d/store", [f"{url}/rank{r}.pt" for r in range(3)], scheduler=c.scheduler_address)
    # Tasks already running on a worker when the run stopped still finish: wait until nothing changes.
    status, previous = shardstore.open("s3://ckpt-d/store").status(), None
    while previous is None or status.ranks_done != previous.ranks_done:
        time.sleep(2)
        previous, status = status, shardstore.open("s3://ckpt-d/store").status()
    assert 1 in status.ranks_missing
    upload(src, url)  # the real rank1.pt arrives; the rerun takes only what is missing
    done: list[int] = []
    store = shardstore.ingest("s3://ckpt-d/store", [f"{url}/rank{r}.pt" for r in range(3)],
                              scheduler=c.scheduler_address, on_done=lambda r: done.append(r.rank))
    assert store.status().ok and sorted(done) == status.ranks_missing
    assert_bitwise_equal(store["model/wte.weight"][0:400], expected(src)["model"]["wte.weight"][0:400])


def test_export_one_task_per_safetensors_file(cluster, checkpoints, tmp_path: Path) -> None:
    import json

    c, client = cluster
    src = checkpoints(3)
    url = upload(src, "s3://ckpt-e/run")
    store = shardstore.ingest("s3://ckpt-e/store", [f"{url}/rank{r}.pt" for r in range(3)], scheduler=c.scheduler_address)
    result = shardstore.export(store, tmp_path / "out", max_shard_size=400_000, scheduler=c.scheduler_address)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and [p.name for p in result.files] == shards + ["model.safetensors.index.json"]
    merged = {}
    for name in shards:
        merged.update(load_file(tmp_path / "out" / name))
    assert_bitwise_equal(merged, expected(src)["model"])
    tasks = client.run_on_scheduler(lambda dask_scheduler: [k for k in dask_scheduler.task_prefixes])
    assert "shardstore-export" in " ".join(tasks)


def test_unshard_on_a_dask_cluster_writes_in_one_pass(cluster, checkpoints, tmp_path: Path) -> None:
    """OUT on a file system every worker sees: the Dask workers write the shards straight into the
    output, as local workers do, and the output is what local workers write."""
    c, _ = cluster
    src = checkpoints(3)
    for fmt, name in (("safetensors", "model.safetensors"), ("torch", "model.pt")):
        phases = Phases()
        shardstore.unshard(src, tmp_path / fmt, format=fmt, scheduler=c.scheduler_address, progress=phases)
        assert phases.phases == ["ingest"], phases.phases  # no export from a store
        local = shardstore.unshard(src, tmp_path / f"{fmt}-local", format=fmt, jobs=2)
        if fmt == "safetensors":
            assert (tmp_path / fmt / name).read_bytes() == local.files[0].read_bytes()
        else:
            import torch

            assert_bitwise_equal(torch.load(tmp_path / fmt / name, weights_only=False), expected(src)["model"])
