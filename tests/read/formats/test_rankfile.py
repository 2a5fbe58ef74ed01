"""A rank file's own shards against its own global shard list, on genuine hybrid-sharded files from the
corpus: torch <= 2.1 numbers placements within the shard group, torch 2.13 by global rank."""

from __future__ import annotations

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
