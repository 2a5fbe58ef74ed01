"""A rank file's own shards against its own global shard list, on genuine hybrid-sharded files from the
corpus: torch <= 2.1 numbers placements within the shard group, torch 2.13 by global rank."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardstore.errors import CheckpointError
from shardstore.read.formats.rankfile import ShardedLeaf, read_rank_file
from tests.read.conformance import FormatTests

CORPUS = Path(__file__).parents[2] / "corpus" / "data"


def _files(member: str) -> list[Path]:
    return sorted((CORPUS / member / "ep0-ba1").glob("*-rank*.pt"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))


@pytest.mark.parametrize("member,numbering", [("composer-t2.0-hsdp-w4", [0, 1, 0, 1]),
                                              ("composer-t2.1-hsdp-w4", [0, 1, 0, 1]),
                                              ("composer-t2.13-hsdp-w4", [0, 1, 2, 3])])
def test_placements_are_read_in_the_numbering_the_file_uses(member: str, numbering: list[int]) -> None:
    """Every genuine file is accepted as the rank it is, and refused as the other rank of its group: the
    numbering within the group is taken only where every placement lies inside it, so a file cannot
    pass for another rank's shards either way."""
    for rank, path in enumerate(_files(member)):
        rf = read_rank_file(path)  # checks every ShardedTensor against its own list
        assert (rf.rank, rf.world_size, rf.group_rank, rf.group_size) == (rank, 4, rank % 2, 2)
        leaves = [leaf for leaf in rf.leaves.values() if isinstance(leaf, ShardedLeaf)]
        placed = {r for leaf in leaves for _, _, r in leaf._global()}
        assert placed == {numbering[rank - rank % 2], numbering[rank - rank % 2 + 1]}, placed
        other = rank ^ 1  # the other rank of the same shard group
        held = [leaf for leaf in leaves if any(all(p.sizes) for p in leaf.pieces)]
        assert held, f"{path.name} holds no shard"
        for leaf in held:
            with pytest.raises(CheckpointError, match=rf"{path.name}: .* are not the shards the metadata gives "
                                                      rf"rank {other} \(.*\); forged or damaged"):
                leaf.check_own_pieces(other, 4, other % 2, 2)
        rf.close()


class TestRankFilesConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, checkpoints) -> Path:
        return checkpoints(3)

    @pytest.fixture
    def foreign(self, checkpoints) -> Path:
        return checkpoints(2) / "rank1.pt"


def _renamed(member: str, batch: int, out: Path) -> Path:
    """A copy of a corpus Composer checkpoint whose folder and files name batch `batch`."""
    folder = out / f"ep0-ba{batch}"
    folder.mkdir(parents=True)
    for path in _files(member):
        shutil.copy(path, folder / path.name.replace("ep0-ba1-", f"ep0-ba{batch}-"))
    return folder


@pytest.mark.parametrize("member", ["composer-t2.0-hsdp-w4", "composer-t2.13-hsdp-w4"])
def test_a_composer_file_of_another_batch_is_refused(member: str, tmp_path: Path) -> None:
    """Composer names ep{E}-ba{B}-rank{r}.pt by the timestamp it records: files of batch 1 named batch 2
    are refused in one line naming the file, nothing left; named batch 1, they unshard."""
    from tests.refusals import assert_refused, cli

    folder = _renamed(member, 2, tmp_path / "two")
    assert_refused(cli("unshard", folder, tmp_path / "out", "-q"), str(folder / "ep0-ba2-rank0.pt"),
                   "records timestamp batch 1, but its name is ep0-ba2-rank0.pt")
    assert not (tmp_path / "out").exists()
    assert cli("unshard", _renamed(member, 1, tmp_path / "one"), tmp_path / "ok", "-q").returncode == 0
