"""The streaming torch writer: torch.load reads it (also mmap'd), zip tools find every CRC right."""

from __future__ import annotations

import collections
import zipfile
from pathlib import Path

import pytest
import torch

from shardstore.export.torch import save


@pytest.mark.parametrize("zip64", [False, True])
def test_torch_reads_what_we_write(tmp_path: Path, zip64: bool) -> None:
    state = collections.OrderedDict(
        a=torch.randn(33, 7), b=torch.arange(5, dtype=torch.bfloat16), c=torch.tensor(2.5),
        d=torch.arange(4, dtype=torch.float32).to(torch.float8_e5m2), e=[torch.ones(2, dtype=torch.int64), (1, "x")])
    save(None, state, tmp_path / "f.pt", force_zip64=zip64)  # type: ignore[arg-type]
    with zipfile.ZipFile(tmp_path / "f.pt") as z:
        assert z.testzip() is None
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "f.pt", weights_only=True, mmap=mmap)
        assert type(loaded) is collections.OrderedDict and list(loaded) == list(state)
        for k in "abcd":
            assert loaded[k].dtype == state[k].dtype and loaded[k].shape == state[k].shape
            assert torch.equal(loaded[k].reshape(-1).view(torch.uint8), state[k].reshape(-1).view(torch.uint8))
        assert torch.equal(loaded["e"][0], state["e"][0]) and loaded["e"][1] == (1, "x")
