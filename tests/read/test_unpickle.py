"""The allowlist: a checkpoint can never run code, and every refusal names the global."""

from __future__ import annotations

import os
import pickle
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from shardstore.errors import UnsafePickleError
from shardstore.read.rankfile import read_rank_file


class _Payload:
    def __init__(self, func: object, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


def _rank_file(path: Path, obj: object) -> Path:
    """A torch-style zip whose data.pkl is `obj` pickled (protocol 2, as torch.save does)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("rank0/data.pkl", pickle.dumps({"model": obj}, protocol=2))
        z.writestr("rank0/version", "3\n")
    return path


@pytest.mark.parametrize("func, args, name", [
    (os.system, ("touch {marker}",), "system"),
    (eval, ("open({marker!r}, 'w')",), "builtins.eval"),
    (subprocess.Popen, (["touch", "{marker}"],), "subprocess.Popen"),
])
def test_malicious_pickle_is_refused_before_running(tmp_path: Path, func, args, name) -> None:
    marker = tmp_path / "pwned"
    filled = tuple([a[0].format(marker=str(marker))] if isinstance(a, list) else a.format(marker=str(marker))
                   for a in args)
    path = _rank_file(tmp_path / "rank0.pt", _Payload(func, filled))
    with pytest.raises(UnsafePickleError) as info:
        read_rank_file(path)
    assert name in str(info.value) and "rank0.pt" in str(info.value) and "allowlist" in str(info.value)
    assert not marker.exists()


def test_plain_tensor_views_read_exactly(tmp_path: Path) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {"view": base[2:5, 1:7], "t": base.t(), "step": torch.tensor(3.0), "b": torch.ones(3, dtype=torch.bfloat16),
             "f8": torch.arange(4, dtype=torch.float32).to(torch.float8_e4m3fn)}
    torch.save(state, tmp_path / "rank0.pt")
    rf = read_rank_file(tmp_path / "rank0.pt")
    try:
        for key, tensor in state.items():
            ref = rf.leaves[key]
            assert ref.dtype == str(tensor.dtype).removeprefix("torch.")
            raw = rf.array(ref)
            want = tensor.contiguous().view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
            got = torch.from_numpy(raw.copy()).reshape(-1).view(torch.uint8)
            assert torch.equal(got, want.reshape(-1)), key
        assert rf.byte_range(rf.leaves["view"]) is None  # strided: must not be copied as one run
        assert rf.byte_range(rf.leaves["b"]) is not None
    finally:
        rf.close()
