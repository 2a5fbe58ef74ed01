"""Shared fixtures: real FSDP checkpoints, made once per test session and cached on disk."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import shardstore
from tests.fixtures.layouts import make_layout_checkpoint

CACHE = Path(os.environ.get("SHARDSTORE_TEST_CACHE", "")) if os.environ.get("SHARDSTORE_TEST_CACHE") else None


def session_base(factory: pytest.TempPathFactory, name: str) -> Path:
    """Where a session fixture keeps its checkpoints: SHARDSTORE_TEST_CACHE if set, else a folder of this
    run's, which every pytest-xdist worker of the run shares (under a lock, `one_at_a_time`, the first worker
    that needs a checkpoint makes it, the others wait and read it)."""
    if CACHE:
        return CACHE
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = factory.getbasetemp().parent / name
        base.mkdir(exist_ok=True)
        return base
    return factory.mktemp(name)


def one_at_a_time(path: Path) -> Any:
    """A lock on `path` (`<path>.lock`) across processes: held while a checkpoint is looked for and made."""
    from filelock import FileLock

    return FileLock(f"{path}.lock")


def cached(base: Path, name: str, make: Callable[[Path], object]) -> Path:
    """Checkpoint `name` under `base`, made by `make(folder)` unless a finished one (its expected.pt.ref,
    written last) is already there."""
    out = base / name
    with one_at_a_time(out):
        if not (out / "expected.pt.ref").exists():
            make(out)
    return out


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """checkpoints(world_size, kind="tiny", dtype="float32") -> folder of rank files + expected.pt.ref."""
    from tests.fixtures import fsdp

    tiny, hf = ("tiny", "float32"), ("hf", "float32")
    get = kinds_by_world(session_base(tmp_path_factory, "checkpoints"), "", fsdp.save,
                         {2: [tiny, hf], 3: [tiny, ("tiny", "bfloat16")], 4: [tiny, hf]},
                         done=lambda out: (out / "expected.pt.ref").exists())
    return lambda world_size, kind="tiny", dtype="float32": get(kind, dtype, world_size)


@pytest.fixture(scope="session")
def layout_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """layout_checkpoints(name, world_size, layout, **options) -> folder (see tests/fixtures/layouts.py)."""
    base = session_base(tmp_path_factory, "layouts")
    made: dict[str, Path] = {}

    def get(name: str, world_size: int, layout: str, steps: tuple[int, ...] = (10,), **options: Any) -> Path:
        if name not in made:
            out = base / f"layout-{name}"
            with one_at_a_time(out):
                if not (out / ".done").exists():
                    make_layout_checkpoint(out, world_size, layout, steps=steps, **options)
                    (out / ".done").touch()
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="session")
def dcp_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """dcp_checkpoints(kind, world_size=4) -> a DCP folder (tests/fixtures/dcp.py); torch's own unsharded
    copy is `<folder>.expected.pt.ref` beside it."""
    from tests.fixtures import dcp

    get = kinds_by_world(session_base(tmp_path_factory, "dcp"), "dcp-", dcp.save,
                         {4: ["fsdp1", "fsdp2", "hsdp", "tp"]}, dcp.unsharded_beside)
    return lambda kind, world_size=4: get(kind, world_size)


def kinds_by_world(base: Path, prefix: str, save: Callable[..., None], together: dict[int, list[Any]],
                   finish: Callable[[Path], object] = lambda out: None,
                   done: Callable[[Path], bool] = lambda out: Path(f"{out}.expected.pt.ref").exists(),
                   ) -> Callable[..., Path]:
    """get(*kind, world_size) -> folder `base/<prefix><kind, "-"-joined>-w<world_size>`, unless finished
    before (`done(folder)`: its expected.pt.ref, written last, is there) made by `save(rank, world, str(folder),
    *kind)` in a gloo world of that size, then `finish(folder)`. That world also makes every kind
    `together[world_size]` lists not made yet (gloo_jobs: its processes start once for them all; the suite
    uses them all)."""
    from tests.fixtures.fsdp import gloo_jobs

    def folder(kind: tuple[str, ...], world: int) -> Path:
        return base / f"{prefix}{'-'.join(kind)}-w{world}"

    def get(*args: Any) -> Path:
        *parts, world = args
        kind = tuple(parts)
        with one_at_a_time(base / f"{prefix}w{world}"):
            if not done(folder(kind, world)):
                others = [k if isinstance(k, tuple) else (k,) for k in together.get(world, [])]
                kinds = [kind] + [k for k in others if k != kind and not done(folder(k, world))]
                gloo_jobs(save, world, [(str(folder(k, world)), *k) for k in kinds])
                for k in kinds:
                    finish(folder(k, world))
        return folder(kind, world)

    return get


@pytest.fixture
def cluster(s3):
    """A real Dask cluster: two worker processes over TCP on loopback (and the S3 server)."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as c, Client(c) as client:
        yield c, client


@pytest.fixture(scope="session")
def verl_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """verl_checkpoints(kind, world_size) -> a veRL run folder (tests/fixtures/verl.py); what the processes
    gathered is `<folder>.expected.pt.ref` beside it."""
    from tests.fixtures import verl

    return kinds_by_world(session_base(tmp_path_factory, "verl"), "verl-", verl.save,
                          {4: ["fsdp1-hsdp", "fsdp2", "fsdp2-hsdp", "fsdp1-hsdp-orig"], 3: ["fsdp1", "fsdp1-orig"]})


@pytest.fixture(scope="session")
def fsdp2_files(tmp_path_factory: pytest.TempPathFactory):
    """fsdp2_files(kind, world_size) -> a folder of per-rank `torch.save`d FSDP2 state dicts
    (tests/fixtures/fsdp2_files.py), the processes' gather in `<folder>.expected.pt.ref`."""
    from tests.fixtures import fsdp2_files

    return kinds_by_world(session_base(tmp_path_factory, "fsdp2-files"), "", fsdp2_files.save, {4: ["hsdp", "tp"]})


@pytest.fixture(scope="session")
def dcp_hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with DCP's Hugging Face safetensors, sharded/ and consolidated/ (tests/fixtures/dcp_hf.py),
    what the processes gathered in its expected.pt.ref."""
    from tests.fixtures.dcp_hf import make_dcp_hf_checkpoint

    return cached(session_base(tmp_path_factory, "dcp-hf"), "dcp-hf-w3", make_dcp_hf_checkpoint)


@pytest.fixture(scope="session")
def olmo_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """olmo_checkpoints(kind, variant, world_size) -> a checkpoint folder as OLMo wrote it
    (tests/fixtures/olmo.py: "local" 2.2/2.0, "olmo_core" flat/dtensor), torch's gather in expected.pt.ref."""
    from tests.fixtures import olmo

    return kinds_by_world(session_base(tmp_path_factory, "olmo"), "", olmo.save,
                          {3: [("local", "2.2"), ("olmo_core", "flat"), ("olmo_core", "dtensor")],
                           4: [("local", "2.0"), ("local", "hsdp"), ("olmo_core", "dtensor"),
                               ("olmo_core", "dtensor-hsdp")]},
                          done=lambda out: (out / "expected.pt.ref").exists())


@pytest.fixture(scope="session")
def s3():
    """A real S3 API server (moto, its own process) on loopback; AWS_* set so everything here uses it."""
    from tests.fixtures.servers import S3Server

    server = S3Server()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_ENDPOINT_URL")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=server.url)
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def upload(folder: Path, url: str, pattern: str = "rank*.pt") -> str:
    """Copy a folder's rank files (or other files matching `pattern`) to an s3:// URL (bucket created if
    needed); returns the URL."""
    import s3fs

    fs = s3fs.S3FileSystem()
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for f in sorted(folder.glob(pattern)):
        fs.put_file(str(f), f"{url.removeprefix('s3://')}/{f.name}")
    fs.invalidate_cache()
    return url


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a fixture checkpoint to alter (its expected answer left behind)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("expected.pt.ref"))
    return dst


def expected(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "expected.pt.ref", weights_only=True)


def exported(folder: Path) -> list[str]:
    """The names of the files of the export in `folder`, sorted: all but the record of which checkpoint it
    came from (export/origin.py), which a finished export always leaves."""
    from shardstore.export.origin import RECORD

    names = sorted(p.name for p in folder.iterdir())
    assert RECORD in names, f"{folder}: no {RECORD}"
    return [n for n in names if n != RECORD]


def assert_bitwise_equal(actual: Any, want: Any, where: str = "", ordered: bool = False) -> None:
    """Same structure, same container types, and every tensor identical bit for bit; io.BytesIO buffers
    by content. With `ordered`, dict keys in the same order too."""
    if isinstance(want, io.BytesIO):
        assert isinstance(actual, io.BytesIO) and actual.getvalue() == want.getvalue(), f"{where}: buffers differ"
    elif isinstance(want, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}, want a tensor"
        assert actual.dtype == want.dtype and actual.shape == want.shape, \
            f"{where}: {actual.dtype}{list(actual.shape)} != {want.dtype}{list(want.shape)}"
        a = actual.contiguous().reshape(-1).view(torch.uint8)
        b = want.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(want, np.ndarray):  # an RNG state
        assert isinstance(actual, np.ndarray) and actual.dtype == want.dtype and actual.shape == want.shape \
            and actual.tobytes() == want.tobytes(), f"{where}: arrays differ"
    elif isinstance(want, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__}, want a dict"
        assert set(actual) == set(want), f"{where}: keys {sorted(map(str, set(actual) ^ set(want)))} differ"
        assert not ordered or list(actual) == list(want), f"{where}: keys in order {list(actual)}, want {list(want)}"
        for k in want:
            assert_bitwise_equal(actual[k], want[k], f"{where}/{k}", ordered)
    elif isinstance(want, (list, tuple)):
        assert type(actual) is type(want) and len(actual) == len(want), f"{where}: {actual!r:.200} != {want!r:.200}"
        for i, (a, b) in enumerate(zip(actual, want)):
            assert_bitwise_equal(a, b, f"{where}/{i}", ordered)
    else:
        assert actual == want, f"{where}: {actual!r} != {want!r}"


def reference_logits(config_dir: Path, weights: dict[str, torch.Tensor], ids: torch.Tensor,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """The logits of the checkpoint's own model (its Hugging Face config, the weights its ranks gathered),
    computed here, in `dtype` (default: the weights'). A fixture's stored logits were computed on the machine that made
    it, and another CPU's kernels (AVX-512 against AVX2) round the last digit differently; an export's
    logits must equal these bit for bit on any machine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or next(iter(weights.values())).dtype).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set()), \
        (missing, unexpected)
    model.tie_weights()
    with torch.no_grad():
        return model(input_ids=ids).logits


class Phases(shardstore.Progress):
    """A progress that records which phases ran (ingest, export): what tells the one-pass unshard apart."""

    def __init__(self) -> None:
        self.phases: list[str] = []

    def start(self, phase: str, total: int | None, done: int = 0) -> None:
        self.phases.append(phase)


def sigkill_mid_way(cmd: list[str], store: Path, units: int, commits: int, reset: Path | None = None,
                    delay: Callable[[int], float] = lambda attempt: 0.0) -> int:
    """Run `cmd` (an ingest into `store`, or an unshard whose scratch store it is) and SIGKILL it once the
    store exists with `commits` units committed, `delay(attempt)` seconds later. A busy machine can let every
    unit commit before the kill lands: `reset` (default: the store) is then removed and the run tried
    again, up to 5 times. Asserts the kill landed mid-way; returns how many units were committed by then."""
    manifest, ranks = store / "__shardstore__" / "manifest.json", store / "__shardstore__" / "ranks"
    for attempt in range(5):
        proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline and not (
                manifest.exists() and len(list(ranks.glob("*.json"))) >= commits):
            time.sleep(0.002)
        time.sleep(delay(attempt))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        committed = len(list(ranks.glob("*.json")))
        if proc.returncode == -signal.SIGKILL and manifest.exists() and committed < units:
            break
        shutil.rmtree(reset or store, ignore_errors=True)
    # the kill landed where it was meant to: the store exists and the run had not finished
    assert proc.returncode == -signal.SIGKILL, f"the run ended ({proc.returncode}) before the kill"
    assert manifest.exists() and commits <= committed < units, (commits, committed)
    return committed


@pytest.fixture(scope="session")
def olmo_models(tmp_path_factory: pytest.TempPathFactory):
    """olmo_models(arch, fmt, world_size) -> a checkpoint folder (tests/fixtures/olmo_model.py)."""
    from tests.fixtures import olmo_model

    return kinds_by_world(session_base(tmp_path_factory, "olmo-models"), "", olmo_model.save,
                          {3: [("olmo2", "legacy"), ("olmo2", "olmo_core")], 2: [("olmo1", "local"), ("olmo1", "torch_new")]},
                          done=lambda out: (out / "expected.pt.ref").exists())
