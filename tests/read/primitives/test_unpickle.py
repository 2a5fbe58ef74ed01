"""The safe unpickler: a checkpoint never runs code; what exists to run code is refused in one line naming the
global; a trainer's own objects become inert records."""

from __future__ import annotations

import importlib
import io
import operator
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy
import pytest
import torch

from shardstore.errors import CheckpointError, UnsafePickleError
from shardstore.read.formats.rankfile import read_rank_file
from shardstore.read.primitives import tensors
from shardstore.read.primitives.unpickle import load
from shardstore.records import GlobalRef, Opaque, TensorRef, as_record


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
    (os.system, ("touch {marker}",), "posix.system"),
    (eval, ("open({marker!r}, 'w')",), "builtins.eval"),
    (exec, ("open({marker!r}, 'w')",), "builtins.exec"),
    (subprocess.Popen, (["touch", "{marker}"],), "subprocess.Popen"),
    (shutil.rmtree, ("{marker}",), "shutil.rmtree"),
    (numpy.load, ("{marker}",), "numpy.load"),
    (torch.load, ("{marker}",), "torch.serialization.load"),
    (operator.attrgetter, ("system",), "operator.attrgetter"),
    (importlib.import_module, ("os",), "importlib.import_module"),
])
def test_code_running_globals_are_refused_before_anything_runs(tmp_path: Path, func, args, name) -> None:
    marker = tmp_path / "pwned"
    filled = tuple([a[0].format(marker=str(marker))] if isinstance(a, list) else a.format(marker=str(marker))
                   for a in args)
    path = _rank_file(tmp_path / "rank0.pt", _Payload(func, filled))
    with pytest.raises(UnsafePickleError) as info:
        read_rank_file(path)
    message = str(info.value)
    assert f"refusing to load global {name} " in message and message.startswith(str(path))
    assert "nothing was run" in message and "\n" not in message
    assert not marker.exists()


def _raw_pickle(body: bytes) -> bytes:
    """{"model": <body>} as a pickle written opcode by opcode (protocol 4)."""
    return b"\x80\x04}\x8c\x05model" + body + b"s."


def _raw_rank_file(path: Path, body: bytes) -> Path:
    """A torch-style zip whose data.pkl is `_raw_pickle(body)`."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("rank0/data.pkl", _raw_pickle(body))
        z.writestr("rank0/version", "3\n")
    return path


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


@pytest.mark.parametrize("body, needle", [
    # getattr(pathlib.PosixPath, "write_text")(...): a method reached through getattr
    (_global("builtins", "getattr") + _global("pathlib", "PosixPath") + _str("write_text") + b"\x86R", "getattr"),
    # the same through a dotted name (protocol 4's STACK_GLOBAL)
    (_str("pathlib") + _str("Path.write_text") + b"\x93", "pathlib.Path.write_text"),
    # builtins.__import__("os") via REDUCE
    (_global("builtins", "__import__") + _str("os") + b"\x85R", "builtins.__import__"),
    # a global whose name would read as two lines when written back
    (_str("olmo_data") + _str("Thing\nos") + b"\x93", "olmo_data.Thing"),
])
def test_getattr_chains_and_odd_names_are_refused(tmp_path: Path, body: bytes, needle: str) -> None:
    with pytest.raises(UnsafePickleError) as info:
        read_rank_file(_raw_rank_file(tmp_path / "rank0.pt", body))
    assert needle in str(info.value) and str(info.value).startswith(str(tmp_path / "rank0.pt"))


def _save(tmp_path: Path, obj: object) -> None:
    torch.save({"model": {"w": torch.ones(2)}, "extra": obj}, tmp_path / "rank0.pt")


def _read_value(tmp_path: Path, obj: object = None, strict: bool = False) -> object:
    """Save {"model": {"w": tensor}, "extra": obj} with torch.save (unless `obj` is None: saved already) and
    read `extra` back through shardstore."""
    if obj is not None:
        _save(tmp_path, obj)
    rf = read_rank_file(tmp_path / "rank0.pt", strict=strict)
    try:
        return as_record(rf.leaves["extra"])
    finally:
        rf.close()


def test_trainer_objects_become_opaque_records_without_importing_their_module(tmp_path: Path, monkeypatch) -> None:
    from tests.fixtures.olmo_data import MixtureCheckpoint

    _save(tmp_path, MixtureCheckpoint(4, ["c4"], torch.zeros(1)))
    monkeypatch.setitem(sys.modules, "tests.fixtures.olmo_data", None)  # any import of it now fails
    record = _read_value(tmp_path)
    assert isinstance(record, Opaque) and (record.module, record.name) == ("tests.fixtures.olmo_data", "MixtureCheckpoint")
    assert record.newobj and record.args == () and record.state["world_size"] == 4
    assert record.state["sources"] == ["c4"] and isinstance(record.state["weights"], TensorRef)
    assert repr(record).startswith("<tests.fixtures.olmo_data.MixtureCheckpoint {world_size: 4, sources: ['c4'], ")


def test_reduce_list_and_dict_subclasses_and_class_references(tmp_path: Path) -> None:
    body = (_global("olmo_data", "Schedule") + _str("cosine") + b"K\x07\x86R"  # Schedule("cosine", 7)
            + b"(K\x01K\x02e"  # APPENDS 1, 2
            + b"(" + _str("k") + b"K\x03u"  # SETITEMS k=3
            + b"}" + _str("warmup") + b"K\x05sb")  # BUILD {"warmup": 5}
    record = as_record(load(_raw_pickle(body), "data.pkl")["model"])
    assert record == Opaque("olmo_data", "Schedule", ("cosine", 7), {"warmup": 5}, items=[1, 2],
                            dictitems=[("k", 3)], newobj=False)
    assert as_record(load(_raw_pickle(_global("olmo_data", "Schedule")), "data.pkl")["model"]) == \
        GlobalRef("olmo_data", "Schedule")


def test_paths_and_torch_version_are_what_they_are_and_strict_refuses_them(tmp_path: Path) -> None:
    got = _read_value(tmp_path, [pathlib.PosixPath("/scratch/run/step50"), torch.__version__])
    assert got == [pathlib.PurePosixPath("/scratch/run/step50"), str(torch.__version__)]
    assert got[0].kind == "PosixPath" and type(got[1]).__name__ == "TorchVersion"
    with pytest.raises(UnsafePickleError, match="pathlib.PosixPath .*strict"):
        _read_value(tmp_path, [pathlib.PosixPath("/x")], strict=True)


def test_distinct_opaque_globals_are_bounded(tmp_path: Path, monkeypatch) -> None:
    from shardstore.read.primitives import unpickle

    monkeypatch.setattr(unpickle, "MAX_OPAQUE_GLOBALS", 3)
    body = b"(" + b"".join(_global("olmo_data", f"C{i}") for i in range(4)) + b"l"
    three = b"(" + b"".join(_global("olmo_data", f"C{i}") for i in range(3)) + b"l"
    assert [g.name for g in map(as_record, load(_raw_pickle(three), "ok.pkl")["model"])] == ["C0", "C1", "C2"]
    with pytest.raises(CheckpointError, match="data.pkl: names more than 3 distinct classes"):
        load(_raw_pickle(body), "data.pkl")


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
            raw = tensors.array(rf.zip, ref)
            want = tensor.contiguous().view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
            got = torch.from_numpy(raw.copy()).reshape(-1).view(torch.uint8)
            assert torch.equal(got, want.reshape(-1)), key
        assert tensors.byte_range(rf.zip, rf.leaves["view"]) is None  # strided: must not be copied as one run
        assert tensors.byte_range(rf.zip, rf.leaves["b"]) is not None
    finally:
        rf.close()


def test_an_in_memory_buffer_is_built_and_the_rest_of_io_stays_refused(tmp_path: Path) -> None:
    """torchtitan's TrainState torch.saves loss histories into io.BytesIO, and DCP pickles them as
    `_io.BytesIO` (NEWOBJ, then its state): an inert buffer of the pickle's own bytes, in strict mode
    too. Anything else of io (a file, open) is still refused by name, and nothing runs."""
    buf = io.BytesIO(b"history")
    buf.seek(3)
    for strict in (False, True):
        loaded = load(pickle.dumps(buf, protocol=2), "train_state", strict=strict)
        assert type(loaded) is io.BytesIO and loaded.getvalue() == b"history" and loaded.tell() == 3
    target = tmp_path / "made-by-pickle"
    for payload in (_Payload(io.FileIO, (str(target), "w")), _Payload(io.open, (str(target), "w"))):
        with pytest.raises(UnsafePickleError, match=r"refusing to load global _?io\.(FileIO|open)"):
            load(pickle.dumps(payload, protocol=2), "train_state")
    assert not target.exists()
