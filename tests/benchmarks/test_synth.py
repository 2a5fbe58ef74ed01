"""The benchmark's one-process rank files are the files a real process group writes, byte for byte."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import synth  # noqa: E402

from tests.fixtures.fsdp import spawn_gloo  # noqa: E402

SPEC = synth.ModelSpec(d_model=64, layers=2, vocab=1000)


def _real_rank(rank: int, world: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    synth.write_rank(Path(out), SPEC, rank, world, dist.group.WORLD, torch.device("cpu"))
    dist.barrier()
    dist.destroy_process_group()


def records(path: Path) -> dict[str, bytes]:
    """Every record but the random serialization id."""
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def test_fake_process_group_files_equal_real_ones(tmp_path: Path) -> None:
    world = 3
    (tmp_path / "real").mkdir()
    spawn_gloo(_real_rank, (world, str(tmp_path / "real")), world)
    synth.generate(tmp_path / "fake", world, SPEC, jobs=1)
    for rank in range(world):
        real, fake = records(tmp_path / "real" / f"rank{rank}.pt"), records(tmp_path / "fake" / f"rank{rank}.pt")
        assert real.keys() == fake.keys() and len(real) > 10
        for name in real:
            assert real[name] == fake[name], f"rank{rank}.pt: {name} differs"
