"""Hostile and broken input, as an attacker or a damaged copy would present it.

Every case runs the real command line in a child process whose address space is capped (RLIMIT_AS), and
asserts: exit status 1, exactly one `shardstore: error:` line naming the file (no traceback, no
MemoryError), nothing from the pickle run, and a store left exactly as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.export.origin import RECORD
from tests import refusals
from tests.fixtures import forge
from tests.fixtures.forge import Raw, Tensor, floats, plain_rank_file
from tests.refusals import assert_refused


def cli(*args: object, limit: bool = True) -> subprocess.CompletedProcess[str]:
    """The command line in a capped address space; an `unshard` runs as `--dry-run` too (tests/refusals.py)."""
    return refusals.cli(*args, limit=limit)


def snapshot(store: Path) -> dict[str, str]:
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genuine 2-rank checkpoint (rank0.pt, rank1.pt) and forged copies of rank 1 (and of rank 0)."""
    out = tmp_path_factory.mktemp("forged")
    return forge.forge_sharded(out, [("rank0.pt", 0, None), ("rank1.pt", 1, None), ("steal/rank1.pt", 1, "steal"),
                                     ("global/rank1.pt", 1, "global"), ("narrow/rank1.pt", 1, "narrow"),
                                     ("overlap/rank0.pt", 0, "overlap")])


@pytest.fixture
def half_store(forged: Path, tmp_path: Path) -> Path:
    """A store holding rank 0 of the genuine checkpoint, waiting for rank 1."""
    store = tmp_path / "store"
    proc = cli("ingest", store, forged / "rank0.pt", "-j", "1", "-q")
    assert proc.returncode == 0, proc.stderr
    return store


def _refused_into(store: Path, rank_file: Path, *needles: str) -> None:
    before = snapshot(store)
    assert_refused(cli("ingest", store, rank_file, "-j", "1", "-q"), str(rank_file), *needles)
    assert snapshot(store) == before


def _genuine_finishes(store: Path, forged: Path) -> None:
    assert cli("ingest", store, forged / "rank1.pt", "-j", "1", "-q").returncode == 0
    out = store.parent / "out"
    assert cli("export", store, out, "-q", limit=False).returncode == 0
    got = load_file(out / "model.safetensors")
    assert torch.equal(got["big"], forge.full("big", forge.BIG)) and torch.equal(got["small"], forge.full("small", forge.SMALL))


# ------------------------------------------------------------------------------------------ pickles
def _payload(module: str, name: str, *args: str) -> Raw:
    body = b"c" + module.encode() + b"\n" + name.encode() + b"\n("
    for a in args:
        body += b"X" + struct.pack("<I", len(a.encode())) + a.encode()
    return Raw(body + b"tR")


PICKLES = {
    "os.system": (lambda m: _payload("os", "system", f"touch {m}"), "refusing to load global os.system"),
    "posix.system": (lambda m: _payload("posix", "system", f"touch {m}"), "global posix.system"),
    "eval": (lambda m: _payload("builtins", "eval", f"open({str(m)!r}, 'w')"), "global builtins.eval"),
    "Popen": (lambda m: Raw(b"csubprocess\nPopen\n(]X\x05\x00\x00\x00touchaX" + struct.pack("<I", len(str(m)))
                            + str(m).encode() + b"atR"), "global subprocess.Popen"),
    "getattr": (lambda m: Raw(b"c__builtin__\ngetattr\ncpathlib\nPosixPath\nX\n\x00\x00\x00write_text\x86R"),
                "refusing getattr(PosixPath, 'write_text')"),
    "bytearray(2**30)": (lambda m: Raw(b"c__builtin__\nbytearray\nJ\x00\x00\x00\x40\x85R"), "refusing bytearray"),
    "memo 2**26": (lambda m: Raw(b"K\x01r\x00\x00\x00\x04"), "memo index 67108864"),
    "BINBYTES8 2**60": (lambda m: Raw(b"\x8e" + struct.pack("<Q", 2**60)), "runs past the end"),
    "FRAME 2**40": (lambda m: Raw(b"\x95" + struct.pack("<Q", 2**40) + b"N"), "runs past the end"),
    "ndarray 2**30": (lambda m: Raw(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ\x00\x00\x00\x40\x85"
                                    b"C\x01b\x87R"), "empty ndarray"),
    "unknown codec": (lambda m: Raw(b"c_codecs\nencode\nX\x01\x00\x00\x00bX\x05\x00\x00\x00bogus\x86R"),
                      "unknown encoding"),
    "deep nesting": (lambda m: Raw(b"]" * 100_000 + b"a" * 99_999), "nested too deeply"),
    "contains itself": (lambda m: Raw(b"]q\x63h\x63a"), "or containing"),
    "unknown opcode": (lambda m: Raw(b"\xfe"), "unknown opcode 0xfe"),
}


@pytest.mark.parametrize("case", list(PICKLES))
def test_hostile_pickles(case: str, half_store: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    make, needle = PICKLES[case]
    src = tmp_path / "rank1.pt"
    plain_rank_file(src, {"model": {"w": Tensor("0", 4)}, "extra": make(marker)}, {"0": floats(4)})
    _refused_into(half_store, src, needle)
    assert not marker.exists()


# --------------------------------------------------------------------------------- tensors vs storages
TENSORS = {
    "offset past the end": (Tensor("0", 4, offset=10**6), "runs past its storage"),
    "negative offset": (Tensor("0", 4, offset=-1), "negative"),
    "1 GB through stride 0": (Tensor("0", 4, shape=(2**28,), stride=(0,)), "expanded view"),
    "missing storage": (Tensor("7", 4), "storage record data/7 is missing"),
    "storage size disagrees": (Tensor("0", 400), "its pickle declares 400"),
    "negative size": (Tensor("0", 4, shape=(-1,)), "negative"),
    "fractional size": (Tensor("0", 4, shape=(1.5,)), "malformed shape"),
}


@pytest.mark.parametrize("case", list(TENSORS))
def test_tensor_views_are_checked_against_their_storage(case: str, tmp_path: Path) -> None:
    tensor, needle = TENSORS[case]
    src = plain_rank_file(tmp_path / "rank0.pt", {"model": {"w": tensor}}, {"0": floats(4)})
    assert_refused(cli("ingest", tmp_path / "store", src, "-j", "1", "-q"), str(src), needle)
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("c/*"))


@pytest.mark.parametrize("world, needle", [(10**9, "impossible process group"), (0, "impossible process group")])
def test_impossible_world_sizes(world: int, needle: str, forged: Path, tmp_path: Path) -> None:
    src = forge.patch_pickle(forged / "rank1.pt", tmp_path / "rank1.pt", lambda d: forge.set_world_size(d, world))
    assert_refused(cli("ingest", tmp_path / "store", src, "-j", "1", "-q"), str(src), needle)


# ------------------------------------------------------------------------------- forged shard metadata
def test_a_file_cannot_write_another_ranks_rows(forged: Path, half_store: Path) -> None:
    _refused_into(half_store, forged / "steal" / "rank1.pt", "are not the shards the metadata gives rank 1")
    _refused_into(half_store, forged / "global" / "rank1.pt", "sharded differently")
    _refused_into(half_store, forged / "narrow" / "rank1.pt", "torch.float16, metadata says torch.float32")
    _genuine_finishes(half_store, forged)


def test_overlapping_shards_are_refused_by_the_planner(forged: Path, tmp_path: Path) -> None:
    src = forged / "overlap" / "rank0.pt"
    assert_refused(cli("ingest", tmp_path / "store", src, "-j", "1", "-q"), str(src), "overlap")
    assert not (tmp_path / "store" / "__shardstore__" / "manifest.json").exists()


# ------------------------------------------------------------------------------------------ the zip
def _zip_cases(genuine: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    entries = forge.records(genuine)
    pkl = next(e for e in entries if e[0].endswith("/data.pkl"))
    data = genuine.read_bytes()
    eocd = data.rindex(b"PK\x05\x06")

    def case(name: str) -> Path:
        (tmp_path / name).mkdir()
        return tmp_path / name / "rank1.pt"

    dup = forge.write_zip(case("dup"), [pkl] + entries)  # a second data.pkl: readers disagree on which
    renamed = bytearray(data)
    at = renamed.index(pkl[0].encode())  # the first local header's copy of the name; the directory keeps its own
    renamed[at + len(pkl[0]) - 5] ^= 0x20
    case("renamed").write_bytes(bytes(renamed))
    with zipfile.ZipFile(case("squeezed"), "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in entries:
            z.writestr(n, d)
    cd = data.index(b"PK\x01\x02")
    case("cd").write_bytes(data[:cd] + b"PK\x01\x03" + data[cd + 4:])  # a central directory entry's signature
    locator = b"PK\x06\x07" + struct.pack("<IQI", 0, 2**63, 1)  # a zip64 locator pointing nowhere
    case("zip64").write_bytes(data[:eocd] + locator + data[eocd:])
    return {"duplicate record": (dup, "appears twice"), "local header renamed": (tmp_path / "renamed" / "rank1.pt", "disagrees"),
            "compressed": (tmp_path / "squeezed" / "rank1.pt", "compressed"),
            "central directory entry": (tmp_path / "cd" / "rank1.pt", "not a torch checkpoint"),
            "zip64 locator": (tmp_path / "zip64" / "rank1.pt", "not a torch checkpoint")}


def test_damaged_and_forged_zips(forged: Path, half_store: Path, tmp_path: Path) -> None:
    for case, (path, needle) in _zip_cases(forged / "rank1.pt", tmp_path).items():
        _refused_into(half_store, path, needle)
    _genuine_finishes(half_store, forged)


# ------------------------------------------------------------------------------------------ keys
def test_odd_keys_stay_distinct_and_round_trip(tmp_path: Path) -> None:
    keys = ["a\x00b", "k" * 1000, "zarr.json", ".hidden", "caf\u00e9", "cafe\u0301", "\udcc3\udca9", "\u00c3\u00a9",
            "x/y", "%2F", "__metadata__"]  # (a lone surrogate's bytes are those of "é" under surrogateescape)
    storages = {str(i): floats(4) for i in range(len(keys))}
    state = {"model": {k: Tensor(str(i), 4) for i, k in enumerate(keys)}}
    src = plain_rank_file(tmp_path / "rank0.pt", state, storages)
    assert cli("ingest", tmp_path / "store", src, "-j", "1", "-q").returncode == 0
    store = shardstore.open(tmp_path / "store")
    assert len(set(store.manifest.objects)) == len(keys)  # no two keys share a path
    assert cli("export", tmp_path / "store", tmp_path / "pt", "--format", "torch", "-q", limit=False).returncode == 0
    got = torch.load(tmp_path / "pt" / "checkpoint.pt", weights_only=True)
    assert list(got["model"]) == keys and all(torch.equal(t, torch.arange(4.0)) for t in got["model"].values())
    assert_refused(cli("export", tmp_path / "store", tmp_path / "st", limit=False), "\\udcc3", "not valid Unicode")
    assert not (tmp_path / "st" / "model.safetensors").exists()
    (tmp_path / "meta").mkdir()
    src = plain_rank_file(tmp_path / "meta" / "rank0.pt", {"model": {"__metadata__": Tensor("0", 4), "w": Tensor("0", 4)}},
                          {"0": floats(4)})
    assert cli("ingest", tmp_path / "meta-store", src, "-j", "1", "-q").returncode == 0
    assert_refused(cli("export", tmp_path / "meta-store", tmp_path / "st", limit=False), "'__metadata__'", "reserves")


def test_a_key_and_its_digits_in_one_container(tmp_path: Path) -> None:
    src = plain_rank_file(tmp_path / "rank0.pt", {"model": {1: Tensor("0", 4), "1": Tensor("0", 4)}}, {"0": floats(4)})
    assert_refused(cli("ingest", tmp_path / "store", src, "-j", "1", "-q"), str(src), "map to the same path")


# ------------------------------------------------------------------------------------------ the store
def test_stray_and_damaged_store_files(forged: Path, half_store: Path) -> None:
    ranks = half_store / "__shardstore__" / "ranks"
    (ranks / "notes.json").write_text("{}")
    (ranks / "0.json.bak").write_text("garbage")
    (ranks / "99999.json").write_text("{}")  # beyond the world size
    status = cli("status", half_store)
    assert status.returncode == 1 and "ranks ingested: 1/2; missing: 1" in status.stdout
    (ranks / "1.json").write_text("{not json")
    assert_refused(cli("status", half_store), "1.json", "damaged commit record")
    (ranks / "1.json").unlink()
    manifest = half_store / "__shardstore__" / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["arrays"]
    manifest.write_text(json.dumps(data))
    assert_refused(cli("ls", half_store), str(half_store), "corrupt manifest")


def test_a_cell_no_commit_covers_never_wins(tmp_path: Path) -> None:
    """World size 1: the plain tensor is replicated, so the first copy *committed* is kept. A writer that
    wrote its cell and died (or was refused) before committing must not keep the genuine copy out."""
    big = (torch.arange(40_000, dtype=torch.float32) * 3).numpy().tobytes()  # 160 KB: an array of its own
    genuine = plain_rank_file(tmp_path / "rank0.pt", {"model": {"w": Tensor("0", 40_000, shape=(40_000,))}}, {"0": big})
    store_dir = tmp_path / "store"
    from shardstore.ingest import create_store
    from shardstore.read.source import Source

    store = create_store(store_dir, Source("torch-save", [str(genuine)]))
    entry = store.manifest.arrays["model/w"]
    store.write_cell(entry, (0,), [bytes(len(big))], 40_000)  # a dead writer's zeros, never committed
    assert cli("ingest", store_dir, genuine, "-j", "1", "-q").returncode == 0
    assert cli("export", store_dir, tmp_path / "out", "-q", limit=False).returncode == 0
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], torch.arange(40_000.0) * 3)


def test_staged_pieces_that_overlap_and_leave_a_gap_never_export(forged: Path, half_store: Path) -> None:
    assert cli("ingest", half_store, forged / "rank1.pt", "-j", "1", "-q").returncode == 0
    (half_store / "model" / "small" / "c.0.0").unlink()  # not assembled yet, as before the last rank
    record = half_store / "__shardstore__" / "ranks" / "1.json"
    data = json.loads(record.read_text())
    data["staged"]["model/small"][0][0] = [3, 0]  # rank 1's rows 5-9 claimed at 3-7: overlap 3-4, gap 8-9
    record.write_text(json.dumps(data))
    assert_refused(cli("ingest", half_store, forged / "rank1.pt", "-q"), "model/small", "overlaps another")
    assert not (half_store / "model" / "small" / "c.0.0").exists()
    assert_refused(cli("export", half_store, half_store.parent / "out", limit=False), "incomplete")
    assert not (half_store.parent / "out" / "model.safetensors").exists()


# ------------------------------------------------------------------------------------------ output
def test_export_into_a_path_under_a_file(forged: Path, half_store: Path, tmp_path: Path) -> None:
    assert cli("ingest", half_store, forged / "rank1.pt", "-j", "1", "-q").returncode == 0
    (tmp_path / "afile").write_text("x")
    assert_refused(cli("export", half_store, tmp_path / "afile" / "out", limit=False), "a part of the path is a file")
    usage = cli("export", half_store, tmp_path / "afile", limit=False)  # the option parser's own check: exit 2
    assert usage.returncode == 2 and "is a file" in usage.stderr and "Traceback" not in usage.stderr


@pytest.mark.parametrize("options, needle", [("size=256k", "no space left on device"), ("ro", "read-only")])
def test_export_onto_a_full_or_read_only_disk(options: str, needle: str, forged: Path, half_store: Path,
                                               tmp_path: Path) -> None:
    assert cli("ingest", half_store, forged / "rank1.pt", "-j", "1", "-q").returncode == 0
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here; needs root")
    try:
        assert_refused(cli("export", half_store, disk / "out" if options == "ro" else disk, limit=False), needle)
        assert not [p for p in disk.rglob("*") if p.is_file()]  # nothing half-written left
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ------------------------------------------------------------------------------------------ leftovers
def test_a_killed_exports_temporaries_are_swept_and_zombies_count_as_dead(forged: Path, half_store: Path,
                                                                            tmp_path: Path) -> None:
    assert cli("ingest", half_store, forged / "rank1.pt", "-j", "1", "-q").returncode == 0
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, and is not waited for: a zombie
    for _ in range(100):
        if open(f"/proc/{zombie.pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0] == b"Z":
            break
        __import__("time").sleep(0.05)
    live = os.getpid()
    for pid in (gone.pid, zombie.pid, live):
        (out / f".model.safetensors.{pid}.0123abcd.tmp").write_bytes(b"half")
    assert cli("export", half_store, out, "-q", limit=False).returncode == 0
    left = sorted(p.name for p in out.iterdir())
    assert left == [f".model.safetensors.{live}.0123abcd.tmp", RECORD, "model.safetensors"]  # a live writer is left alone
    zombie.wait()


def test_a_planted_scratch_link_is_refused(forged: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / ".shardstore-scratch").symlink_to(elsewhere)
    src = tmp_path / "src"
    src.mkdir()
    for r in (0, 1):
        shutil.copy(forged / f"rank{r}.pt", src)
    assert_refused(cli("unshard", src, out, "-j", "1"), "symbolic link")
    assert not list(elsewhere.iterdir())


def test_a_rank_file_that_is_a_symbolic_link_loop(forged: Path, tmp_path: Path) -> None:
    (tmp_path / "a.pt").symlink_to(tmp_path / "b.pt")
    (tmp_path / "b.pt").symlink_to(tmp_path / "a.pt")
    assert_refused(cli("ingest", tmp_path / "s", tmp_path / "a.pt", "-j", "1"), "a.pt: cannot read",
                   "symbolic links")
    assert not (tmp_path / "s").exists()


def test_unshard_into_a_path_under_a_file_is_refused_before_any_ingest(forged: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    assert_refused(cli("unshard", forged, tmp_path / "afile" / "out", limit=False),
                   "afile/out: a part of the path is a file")
    assert (tmp_path / "afile").read_text() == "x"


def test_a_distcp_file_the_metadata_names_but_the_folder_lacks(tmp_path: Path) -> None:
    """Refused by name before a store is made: no traceback, no scratch store left behind."""
    src = tmp_path / "ckpt"
    shutil.copytree(Path(__file__).parent / "corpus" / "data" / "torchtitan-dcp-t2.13-w2" / "step-2", src)
    (src / "__1_0.distcp").unlink()
    out = tmp_path / "out"
    assert_refused(cli("unshard", src, out, limit=False), "__1_0.distcp: no such file (the checkpoint names it)")
    assert not shardstore.scratch_location(out).exists()


@pytest.mark.parametrize("json", [False, True])
def test_a_distcp_file_truncated_mid_item_is_refused_up_front_by_the_dry_run_too(json: bool, tmp_path: Path) -> None:
    """Its size against the end of the last item .metadata places in it: known before any unit is read."""
    src = shutil.copytree(Path(__file__).parent / "corpus" / "data" / "torchtitan-dcp-t2.13-w2" / "step-2",
                          tmp_path / "step-2")
    data = (src / "__1_0.distcp").read_bytes()
    (src / "__1_0.distcp").write_bytes(data[:len(data) - 100])
    out = tmp_path / "out"
    needles = ("__1_0.distcp", "run past the end", f"up to byte {len(data)}", f"has {len(data) - 100} bytes")
    if json:
        assert_refused(cli("unshard", src, out, "--dry-run", "--json", limit=False), *needles)
    else:
        proc = cli("unshard", src, out, limit=False)
        assert_refused(proc, *needles)
        assert_refused(proc.dry, *needles)  # type: ignore[attr-defined]
    assert not out.exists()


def test_json_nested_too_deeply_is_refused_by_name(tmp_path: Path) -> None:
    """A safetensors header or an OLMo-core metadata.json of a hundred thousand brackets: one line."""
    from shardstore.errors import CheckpointError
    from shardstore.read.formats.olmo_core import _read_json
    from shardstore.read.primitives.safetensors_file import SafetensorsFile

    deep = b"[" * 100_000 + b"]" * 100_000
    header = b'{"a":' + deep + b"}"
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match=r"x\.safetensors: safetensors header nested too deeply"):
        SafetensorsFile(tmp_path / "x.safetensors")
    (tmp_path / "metadata.json").write_bytes(deep)
    with pytest.raises(CheckpointError, match=r"metadata\.json: JSON nested too deeply"):
        _read_json(str(tmp_path / "metadata.json"), None)


# ------------------------------------------------------------------------------------ own output
def _genuine_copy(forged: Path, src: Path) -> Path:
    src.mkdir()
    for r in (0, 1):
        shutil.copy(forged / f"rank{r}.pt", src)
    return src


@pytest.mark.parametrize("where", ["SRC", "SRC/out", "--store SRC/store"])
def test_an_output_or_store_inside_the_checkpoint_folder_is_refused_up_front(where: str, forged: Path,
                                                                             tmp_path: Path) -> None:
    src = _genuine_copy(forged, tmp_path / "src")
    before = snapshot(src)
    args = (["unshard", src, tmp_path / "out", "--store", src / "store"] if where.startswith("--store")
            else ["unshard", src, src if where == "SRC" else src / "out"])
    assert_refused(cli(*args, "-j", "1", limit=False), "inside the checkpoint's folder", str(src))
    assert snapshot(src) == before and sorted(p.name for p in src.iterdir()) == ["rank0.pt", "rank1.pt"]


def test_an_export_beside_the_rank_files_is_never_taken_for_the_checkpoint(forged: Path, tmp_path: Path) -> None:
    """An export a user moved into the checkpoint's folder: discovery names both, and takes neither."""
    src = _genuine_copy(forged, tmp_path / "src")
    assert cli("unshard", src, tmp_path / "out", "-j", "1", "-q", limit=False).returncode == 0
    shutil.copy(tmp_path / "out" / "model.safetensors", src)
    assert_refused(cli("unshard", src, tmp_path / "again", "--format", "torch", "-q", limit=False),
                   "holds two checkpoints", "rank0.pt")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("case", ["missing rank", "no model description"])
def test_up_front_refusals_leave_no_out_folder(case: str, forged: Path, tmp_path: Path) -> None:
    src = _genuine_copy(forged, tmp_path / "src")
    if case == "missing rank":
        (src / "rank1.pt").unlink()
    out = tmp_path / "new" / "out"
    args = ["--format", "hf"] if case == "no model description" else []
    assert_refused(cli("unshard", src, out, *args, "-j", "1", limit=False),
                   "rank files are missing" if case == "missing rank" else "hf-config")
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------- structure, bounded
DEEPSPEED = Path(__file__).parent / "fixtures" / "data" / "deepspeed"


def _with_key(opcodes: bytes) -> Callable[[bytes], bytes]:
    """A data.pkl patch: one more key, "extra", in the top-level dict (on the stack just before STOP)."""
    return lambda data: data[:-1] + b"X\x05\x00\x00\x00extra" + opcodes + b"s."


def _dag(levels: int) -> bytes:
    """A list of two references to a list of two references to ... : `levels` objects, 2**levels paths."""
    out = b"]q\x00"
    for i in range(levels):  # each level memoised, and popped once the next one holds it
        out += b"0](h" + bytes([i]) + b"h" + bytes([i]) + b"eq" + bytes([i + 1])
    return out


@pytest.mark.parametrize("case, opcodes", [("100,000 deep", b"]" * 100_000 + b"a" * 99_999), ("a DAG of 2**40 paths", _dag(40))])
def test_deepspeed_model_states_with_hostile_structure_end_in_one_line(case: str, opcodes: bytes,
                                                                       tmp_path: Path) -> None:
    src = shutil.copytree(DEEPSPEED / "z2-w3", tmp_path / "src")
    states = src / "global_step2" / "mp_rank_00_model_states.pt"
    forge.patch_pickle(states, states, _with_key(opcodes))
    line = assert_refused(cli("unshard", src, tmp_path / "out", "-j", "1", "-q"), "too")
    assert "nested too deeply" in line or "too many paths" in line, line
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_config_json_nested_too_deeply_is_refused_by_name(tmp_path: Path) -> None:
    src = shutil.copytree(DEEPSPEED / "z2-w3", tmp_path / "src")
    (src / "config.json").write_text('{"a":' + "[" * 100_000 + "]" * 100_000 + "}")
    assert_refused(cli("unshard", src, tmp_path / "out", "--format", "hf", "-j", "1", "-q", limit=False),
                   "config.json", "nested too deeply")


def test_dcp_sharding_info_nested_too_deeply_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    deep = "[" * 100_000 + "]" * 100_000
    save_file({"w": torch.ones(4)}, src / "shard-00001-model-00001-of-00001.safetensors",
              metadata={"DCP_SHARDING_INFO": deep, "DCP_VERSION": "1.0"})
    assert_refused(cli("unshard", src, tmp_path / "out", "-j", "1"), "shard-00001-model-00001-of-00001.safetensors",
                   "DCP_SHARDING_INFO metadata nested too deeply")


def test_a_file_larger_than_the_file_system_allows_is_one_line(tmp_path: Path) -> None:
    from shardstore.errors import ExportError
    from shardstore.sink.layout import Layout, prepare

    with pytest.raises(ExportError, match=r"huge\.pt: cannot write the export: a file larger than its file system allows"):
        prepare(None, Layout(str(tmp_path), ("huge.pt",), (1 << 62,), {}), [[]])  # type: ignore[arg-type]


def test_rank_files_of_another_format_are_refused_by_a_store(forged: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert cli("ingest", store, DEEPSPEED / "z2-w3", "-j", "1", "-q").returncode == 0
    before = snapshot(store)
    assert_refused(cli("ingest", store, forged / "rank0.pt", "-j", "1", "-q"), "rank0.pt",
                   "holds a DeepSpeed ZeRO checkpoint")
    dtensor = Path(__file__).parent / "fixtures" / "data" / "fsdp2-tp" / "t2.6" / "model_rank1.pt"
    assert_refused(cli("ingest", store, dtensor, "-j", "1", "-q"), "model_rank1.pt",
                   "holds a DeepSpeed ZeRO checkpoint, and this is a file of a DTensor one")
    assert snapshot(store) == before


def test_a_dcp_folder_without_its_metadata_says_so(tmp_path: Path) -> None:
    src = shutil.copytree(Path(__file__).parent / "corpus" / "data" / "torchtitan-dcp-t2.13-w2" / "step-2",
                          tmp_path / "step-2")
    (src / ".metadata").unlink()
    assert_refused(cli("unshard", src, tmp_path / "out", "-q"), "step-2", ".distcp files without the .metadata")
