"""A safetensors file read in place (read/primitives/safetensors_file.py): its header's names alone, as a
task's routing reads them, against safetensors' own reader, and bounded as a full open is."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from shardstore.errors import CheckpointError
from shardstore.read.primitives.safetensors_file import SafetensorsFile, tensor_names


def test_the_names_alone_are_the_files_tensors(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"b.weight": torch.ones(2, 3), "a.é": torch.zeros(1, dtype=torch.bfloat16), "c": torch.arange(4)},
              path, metadata={"format": "pt"})
    with safe_open(path, "pt") as f:
        want = set(f.keys())
    with SafetensorsFile(str(path)) as st:
        assert set(st.tensors) == want
    assert sorted(tensor_names(str(path))) == sorted(want) and len(want) == 3


@pytest.mark.parametrize("header", [b"", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 2) + b"[]"])
def test_a_forged_header_is_refused_by_the_names_as_by_the_whole(header: bytes, tmp_path: Path) -> None:
    """A header longer than the file (or than MAX_HEADER), a file shorter than its length field, a header
    that is no JSON object: one line naming the file, before anything the header says is used."""
    path = tmp_path / "forged.safetensors"
    path.write_bytes(header)
    with pytest.raises(CheckpointError, match="forged.safetensors: ") as whole:
        SafetensorsFile(str(path))
    with pytest.raises(CheckpointError, match="forged.safetensors: ") as names:
        tensor_names(str(path))
    assert str(whole.value) == str(names.value) and "\n" not in str(names.value)
