"""Skimming rank files (read/primitives/skim.py): a worker that cuts every rank's shard list out of its file gets
exactly what reading the whole file gives; anything the skimmer cannot vouch for is read whole."""

from __future__ import annotations

import pickle
import random
import re
import zipfile
from pathlib import Path

import pytest

from shardstore import values
from shardstore.errors import CheckpointError
from shardstore.read.formats.rankfile import RankFile, ShardedLeaf, read_rank_file, spec_of
from shardstore.read.primitives import skim
from shardstore.read.primitives.unpickle import load
from tests.fixtures import forge

native = pytest.mark.skipif(not skim.NATIVE, reason="the C extension was not built (CI requires it: "
                                                   "tests/read/primitives/test_pickle_scan.py)")


def _same(a: RankFile, b: RankFile) -> None:
    assert a.skeleton == b.skeleton and (a.rank, a.world_size) == (b.rank, b.world_size)
    assert a.leaves.keys() == b.leaves.keys()
    for path, leaf in a.leaves.items():
        other = b.leaves[path]
        if isinstance(leaf, ShardedLeaf):
            assert (leaf.dtype, leaf.shape) == (other.dtype, other.shape)
            assert [(p.offsets, p.sizes, p.tensor) for p in leaf.pieces] == \
                [(p.offsets, p.sizes, p.tensor) for p in other.pieces]
        else:  # plain values, and the tensor views inside them
            assert values.encode(leaf, tensor=repr) == values.encode(other, tensor=repr), path


def _planned(first: Path) -> dict[str, str]:
    rf = read_rank_file(first, values.encode, digests=True)
    try:
        return spec_of(rf).facts.reader["skim"]
    finally:
        rf.close()


@native
def test_a_skimmed_rank_file_reads_as_the_whole_file(checkpoints):
    """Real FSDP files (gloo, 3 ranks, model + optimizer + trainer state): every rank's lists match rank
    0's digests, and what the worker gets is what reading the whole file gives."""
    folder = checkpoints(3)
    planned = _planned(folder / "rank0.pt")
    assert len(planned) == 21 and len(set(planned.values())) > 1
    for rank in range(3):
        skimmed = read_rank_file(folder / f"rank{rank}.pt", values.encode, planned=planned)
        whole = read_rank_file(folder / f"rank{rank}.pt", values.encode)
        assert all(leaf.planned for leaf in skimmed.leaves.values() if isinstance(leaf, ShardedLeaf))
        assert not any(leaf.planned for leaf in whole.leaves.values() if isinstance(leaf, ShardedLeaf))
        _same(skimmed, whole)
        skimmed.close(), whole.close()


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("skim")
    return forge.forge_sharded(out, [("rank0.pt", 0, None), ("rank1.pt", 1, None), ("steal/rank1.pt", 1, "steal"),
                                     ("global/rank1.pt", 1, "global"), ("keys/rank0.pt", 0, "trainer keys")])


@native
def test_a_forged_list_is_read_whole_and_a_stolen_shard_refused(forged: Path):
    planned = _planned(forged / "rank0.pt")
    # the global list rewritten: its digest differs, so the file is read whole (and ingest refuses it by
    # its layout digest, tests/test_hostile.py)
    rf = read_rank_file(forged / "global" / "rank1.pt", values.encode, planned=planned)
    assert not any(leaf.planned for leaf in rf.leaves.values() if isinstance(leaf, ShardedLeaf))
    rf.close()
    # the lists untouched but the local shard moved to rank 0's rows: held to the chunk layout
    with pytest.raises(CheckpointError, match=r"steal/rank1.pt: model/big: local shards \[\[0, 0\]\] are not the "
                                              r"shards the metadata gives rank 1 \(\[\[300, 0\]\]\)"):
        read_rank_file(forged / "steal" / "rank1.pt", values.encode, planned=planned)


@native
@pytest.mark.parametrize("world", [1001, 2])
def test_lists_of_any_length_are_skimmed(world: int, tmp_path: Path):
    """pickle writes a list in batches of 1000 (MARK ... APPENDS), and a last single item with APPEND: at
    world size 1001 the list ends with one. Both ends of the world are read as from the whole file."""
    folder = forge.forge_sharded(tmp_path, [("rank0.pt", 0, "tall"), ("last.pt", world - 1, "tall")], world=world)
    planned = _planned(folder / "rank0.pt")
    skimmed = read_rank_file(folder / "last.pt", values.encode, planned=planned)
    whole = read_rank_file(folder / "last.pt", values.encode)
    assert skimmed.leaves["model/tall"].planned and skimmed.leaves["model/tall"].pieces[0].offsets == (world - 1, 0)
    _same(skimmed, whole)
    skimmed.close(), whole.close()


@native
def test_trainer_values_named_like_the_lists_are_kept(forged: Path):
    """A trainer's own "shards_metadata" and "placements" entries would be cut with the lists: such a file
    is read whole, its values intact, and its checkpoint gets no skim facts."""
    rf = read_rank_file(forged / "keys" / "rank0.pt", values.encode, digests=True)
    assert rf.digests == {} and "skim" not in spec_of(rf).facts.reader
    assert rf.leaves["trainer"] == {"shards_metadata": [1, 2, 3], "placements": ["a", "b"]}
    rf.close()


def _pickle_of(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


@native
def test_pickles_without_lists_pass_through_and_others_are_left_alone():
    value = {"a": [1, 2.5, "x", b"y", (None, True)], "b": {"c": "x"}, "shared": ["z"] * 3}
    cut = skim.skim(pickle.dumps(value, protocol=2))
    assert cut is not None and cut.digests == [] and pickle.loads(cut.data) == value
    assert skim.skim(pickle.dumps(value, protocol=4)) is None  # framing and implicit memo: read whole


def test_without_the_extension_files_are_read_whole(checkpoints, monkeypatch):
    folder = checkpoints(2)
    planned = _planned(folder / "rank0.pt") if skim.NATIVE else {"model/wte.weight": "from a build that has it"}
    monkeypatch.setattr(skim, "_skim_c", None)
    rf = read_rank_file(folder / "rank1.pt", values.encode, planned=planned)
    assert not any(leaf.planned for leaf in rf.leaves.values() if isinstance(leaf, ShardedLeaf))
    whole = read_rank_file(folder / "rank1.pt", values.encode)
    _same(rf, whole)
    rf.close(), whole.close()


def _damaged(data: bytes, rng: random.Random) -> bytes:
    """`data` with one to four bytes flipped or inserted, or cut short."""
    raw = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(raw))
        kind = rng.random()
        if kind < 0.6:
            raw[at] = rng.randrange(256)
        elif kind < 0.8:
            raw.insert(at, rng.randrange(256))
        else:
            del raw[at:]
            break
    return bytes(raw)


@native
def test_the_skimmer_survives_damage(forged: Path):
    """Flipped, inserted and truncated bytes: the C skimmer returns a pickle or gives up, never reads past
    its input; what it returns goes through the same safe unpickler."""
    data = _pickle_of(forged / "rank1.pt")
    rng = random.Random(7)
    outcomes = set()
    for trial in range(1500):
        cut = skim.skim(_damaged(data, rng), reference=None)
        if cut is None:
            outcomes.add("read whole")
            continue
        try:
            load(cut.data, "fuzz", placeholders=cut.globals)
            outcomes.add("skimmed")
        except CheckpointError:
            outcomes.add("refused")
    assert outcomes == {"read whole", "skimmed", "refused"}


def _memoised_after_items(data: bytes, read_back: bool) -> bytes:
    """data.pkl with the first shard list memoised after its items (`] ( ... e PUT n`, not `] PUT n ( ... e`),
    and, with `read_back`, a trainer value `leak` that reads the list back through the memo (`GET n`)."""
    import pickletools

    ops = list(pickletools.genops(data))
    i = next(i for i, (_, arg, _) in enumerate(ops) if arg == "shards_metadata")
    assert [op.name for op, _, _ in ops[i + 2:i + 5]] == ["EMPTY_LIST", "BINPUT", "MARK"]
    put, mark = ops[i + 3][2], ops[i + 4][2]
    depth = 0
    for op, _, pos in ops[i + 4:]:
        depth += (op.name == "MARK") - (pickletools.markobject in op.stack_before)
        if depth == 0:
            end = pos + 1
            break
    memo = data[put:mark]  # BINPUT n
    data = data[:put] + data[mark:end] + memo + data[end:]
    if not read_back:
        return data
    assert data.endswith(b"u.")  # the top-level dict's last SETITEMS: add `leak` to it
    return data[:-1] + b"X\x04\x00\x00\x00leakh" + memo[1:] + b"s."


@native
def test_a_list_read_back_through_the_memo_is_read_whole(forged: Path, tmp_path: Path):
    """A shard list memoised after its items is skimmed; one that a trainer value also reads back through
    the memo makes the file read whole, so that value is what the whole file holds, never a placeholder."""
    first = forge.patch_pickle(forged / "rank0.pt", tmp_path / "rank0.pt", lambda d: _memoised_after_items(d, False))
    planned = _planned(first)
    assert len(planned) == 2  # the form is skimmed: every list has its digest
    src = forge.patch_pickle(forged / "rank1.pt", tmp_path / "rank1.pt", lambda d: _memoised_after_items(d, True))
    skimmed = read_rank_file(src, values.encode, planned=planned)
    whole = read_rank_file(src, values.encode)
    assert not any(leaf.planned for leaf in skimmed.leaves.values() if isinstance(leaf, ShardedLeaf))
    shards = [[(v.shard_offsets, v.shard_sizes) for v in rf.leaves.pop("leak")] for rf in (skimmed, whole)]
    assert shards[0] == shards[1] == [([0, 0], [300, 600]), ([300, 0], [300, 600])]
    _same(skimmed, whole)
    skimmed.close(), whole.close()


@native
@pytest.mark.parametrize("member", ["composer-t2.13-hsdp-w4", "composer-t2.1-hsdp-w4"])
def test_hybrid_sharded_files_are_skimmed_and_read_as_the_whole_file(member: str):
    """Genuine HSDP rank files (torch 2.13 names global ranks, 2.1 ranks within the group): every replica
    group's lists differ, so no one list can be planned, but each file's are decoded from its skim (one per
    distinct list) instead of built with the whole file, and the worker gets what the whole file gives."""
    files = sorted((Path(__file__).parents[2] / "corpus" / "data" / member / "ep0-ba1").glob("*rank*.pt"))
    first = read_rank_file(files[0], values.encode, digests=True)
    planned = spec_of(first).facts.reader["skim"]
    first.close()
    assert planned == {}
    for f in files:
        decoded = read_rank_file(f, values.encode, planned=planned)
        whole = read_rank_file(f, values.encode)
        assert decoded.digests and not whole.digests  # the lists came from the skim
        _same(decoded, whole)
        decoded.close(), whole.close()


@native
def test_a_shard_groups_next_file_takes_the_lists_the_last_file_decoded():
    """Under hybrid sharding no plan holds the lists, and the files of one shard group hold the same ones:
    the next file takes the last one's decoded lists (the same objects) where their normal forms are the
    same bytes, and a file of another group decodes its own. Either way each file reads, and checks its
    own shards against its lists, as the whole file does."""
    files = _hsdp_files("composer-t2.13-hsdp-w4")  # ranks 0, 1 hold one group's lists; 2, 3 the other's
    lists = []
    for f in files:
        decoded = read_rank_file(f, values.encode, planned={})
        whole = read_rank_file(f, values.encode)
        _same(decoded, whole)
        sharded = {p: leaf for p, leaf in decoded.leaves.items() if isinstance(leaf, ShardedLeaf)}
        for p, leaf in sharded.items():
            other = whole.leaves[p]
            assert (leaf._global(), leaf.layout_digest()) == (other._global(), other.layout_digest()), p
        lists.append({p: leaf._metadata.shards_metadata for p, leaf in sharded.items()})
        decoded.close(), whole.close()
    taken = [all(lists[i][p] is lists[i - 1][p] for p in lists[i]) for i in range(1, len(files))]
    fresh = [not any(lists[i][p] is lists[i - 1][p] for p in lists[i]) for i in range(1, len(files))]
    assert (taken, fresh) == ([True, False, True], [False, True, False])


def _result(cut: skim.Skimmed | None) -> tuple[bytes, list[str], dict[str, bytes]] | None:
    """What a skim gives, its placeholders' module (fresh in every call) named alike."""
    return None if cut is None else (re.sub(rb"shardstore_elided_[0-9a-f]{16}", b"M", cut.data), cut.digests, cut.forms)


def _hsdp_files(member: str) -> list[Path]:
    return sorted((Path(__file__).parents[2] / "corpus" / "data" / member / "ep0-ba1").glob("*rank*.pt"))


@native
def test_lists_another_file_repeats_are_compared_not_walked(checkpoints):
    """One save's rank files repeat the same lists byte for byte: each is compared with the reference
    file's and takes its digest, and the file skims to exactly what walking every list gives."""
    data = [_pickle_of(checkpoints(3) / f"rank{r}.pt") for r in range(3)]
    first = skim.skim(data[0], forms=True, reference=None)
    assert first.matched == 0 and first.reference is not None and first.cut == 2 * len(first.digests) > 0
    for d in data:
        fast, slow = skim.skim(d, forms=True, reference=first.reference), skim.skim(d, forms=True, reference=None)
        assert (fast.matched, slow.matched) == (fast.cut, 0) and fast.reference is None
        assert _result(fast) == _result(slow)


@native
def test_another_replica_groups_lists_are_walked():
    """Under hybrid sharding each group's lists name its own ranks: a file of the other group matches none
    of the reference's lists, and is walked to the same result as without one."""
    files = _hsdp_files("composer-t2.13-hsdp-w4")
    ref = skim.skim(_pickle_of(files[0]), reference=None).reference
    matched = []
    for f in files:
        data = _pickle_of(f)
        fast = skim.skim(data, forms=True, reference=ref)
        assert _result(fast) == _result(skim.skim(data, forms=True, reference=None))
        matched.append(fast.matched == fast.cut)
    assert matched == [True, True, False, False]  # ranks 0, 1 are group 0; 2, 3 group 1


@native
def test_the_same_list_bytes_reading_another_atom_are_walked(forged: Path):
    """A list's bytes say `GET n`, not what n holds: the field names its entries read back from outside
    the list are set earlier in the file. Renamed there, the same list bytes mean another list, so they
    are walked and get another digest."""
    data = _pickle_of(forged / "rank1.pt")
    ref = skim.skim(_pickle_of(forged / "rank0.pt"), reference=None).reference
    at = data.index(b"shard_sizes")
    assert data.index(b"shards_metadata") > at  # set in the local shard, before any list
    renamed = data[:at] + b"shard_sizez" + data[at + 11:]
    fast, slow = skim.skim(renamed, forms=True, reference=ref), skim.skim(renamed, forms=True, reference=None)
    assert fast.matched < fast.cut and _result(fast) == _result(slow)
    assert fast.digests != skim.skim(data, reference=None).digests


@native
def test_damage_gets_the_same_result_with_a_reference_as_without(forged: Path):
    """Flipped, inserted and truncated bytes, mostly inside the lists (most of the pickle): whatever the
    reference, the skimmer gives up, or gives the pickle and digests that walking every list gives."""
    data = _pickle_of(forged / "rank1.pt")
    ref = skim.skim(_pickle_of(forged / "rank0.pt"), reference=None).reference
    rng = random.Random(11)
    matched = set()
    for trial in range(600):
        raw = _damaged(data, rng)
        fast, slow = skim.skim(raw, forms=True, reference=ref), skim.skim(raw, forms=True, reference=None)
        assert _result(fast) == _result(slow), trial
        if fast is not None:
            matched.add(fast.matched == fast.cut)
    assert matched == {True, False}  # damage both outside the lists (still the reference's) and inside


@native
def test_each_process_keeps_the_last_files_lists(monkeypatch):
    """By default the reference is the last file this process walked in full; a file that is not all the
    reference's lists drops it, and the next file becomes the reference."""
    monkeypatch.setattr(skim, "_LAST", [])
    data = [_pickle_of(f) for f in _hsdp_files("composer-t2.13-hsdp-w4")]
    compared = [(lambda c: c.matched == c.cut)(skim.skim(d)) for d in (data[0], data[1], data[2], data[3], data[2])]
    assert compared == [False, True, False, False, True]
