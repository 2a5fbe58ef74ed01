"""The manifest is the contract: a store from a newer shardstore is refused, clearly, and left alone."""

from __future__ import annotations

import json
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
