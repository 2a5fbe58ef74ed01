"""The benchmark's one-process FSDP2 DCP checkpoint is the one W real gloo processes save: every .distcp
file byte for byte, the .metadata but for what each save draws anew (its random save id, its folder), and
the same tensors loaded."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import synth  # noqa: E402
import synth_dcp  # noqa: E402
import synth_dcp_world  # noqa: E402

# at W=3 the 2-row norms and attn_out leave the last rank empty (0,) and (0, 2) shards, wte's 50 rows an uneven one
WORLD, SPEC = 3, synth.ModelSpec(d_model=2, layers=1, vocab=50)


def _metadata(folder: Path) -> bytes:
    """.metadata pickled again with what every save (and every read) draws anew blanked."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(folder)).read_metadata()
    if meta.storage_meta is not None:
        meta.storage_meta.save_id = meta.storage_meta.load_id = meta.storage_meta.checkpoint_id = ""
    return pickle.dumps(meta, protocol=4)


def _loaded(folder: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state


def test_one_process_files_equal_a_real_saves(tmp_path: Path) -> None:
    from tests.conftest import assert_bitwise_equal

    synth_dcp.generate(tmp_path / "real", WORLD, SPEC)
    real = sorted(p.name for p in (tmp_path / "real").glob("*.distcp"))
    assert len(real) == WORLD
    for exact in (False, True):  # other ranks' state dicts from rank 0's, or each torch's own
        fake = tmp_path / f"fake-{exact}"
        synth_dcp_world.generate(fake, WORLD, SPEC, log=False, exact=exact)
        assert real == sorted(p.name for p in fake.glob("*.distcp"))
        for name in real:
            assert (tmp_path / "real" / name).read_bytes() == (fake / name).read_bytes(), name
        assert _metadata(tmp_path / "real") == _metadata(fake)
        assert_bitwise_equal(_loaded(fake), _loaded(tmp_path / "real"), "loaded")
