"""Splitting FSDP1 flat parameters per parameter: only where the sizes say exactly how."""

from __future__ import annotations

from shardstore.read.formats.fsdp_flat import Member, overlaps, split

PARAMS = [("model.embed_tokens.weight", (10, 4)), ("model.layers.0.q.weight", (4, 4)), ("model.layers.0.q.bias", (4,)),
          ("model.layers.1.q.weight", (4, 4)), ("model.norm.weight", (4,)), ("lm_head.weight", (10, 4))]


def test_root_first_then_each_layer_when_every_length_matches() -> None:
    # root: 40 + 4 + 40 = 84 -> 28 per rank of 3; layer 0: 20 -> 7; layer 1: 16 -> 6 (padded to 18)
    units = split(PARAMS, [28, 7, 6], 3, {})
    assert units is not None
    assert [[m.name for m in u] for u in units] == [
        ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
        ["model.layers.0.q.weight", "model.layers.0.q.bias"], ["model.layers.1.q.weight"]]
    assert [m.start for m in units[0]] == [0, 40, 44]


def test_any_other_length_or_count_is_not_guessed() -> None:
    assert split(PARAMS, [28, 7, 7], 3, {}) is None  # a slice one element longer than FSDP would cut
    assert split(PARAMS, [28, 13], 3, {}) is None  # two layers in one unit: not the grouping derived
    assert split(PARAMS, [28, 7, 6, 1], 3, {}) is None


def test_overlaps_cut_a_ranks_slice_at_parameter_edges() -> None:
    members = [Member("a", (5,), 0, "a"), Member("b", (3, 2), 5, "b")]
    assert overlaps(members, 4, 4) == [(members[0], 4, 1), (members[1], 0, 3)]
    assert overlaps(members, 11, 3) == []  # padding only


def test_ragged_parts_follow_each_other_in_shard_order() -> None:
    """use_orig_params=True: per-rank part sizes of each parameter, within each replica group; a frozen
    parameter (no state anywhere) has none; parts that do not add up, or replica groups that differ, are
    not placed."""
    from shardstore.read.formats.fsdp_flat import ragged

    numels = [10, 4, 6]  # parameter 1 frozen
    lengths = {0: {0: 7}, 1: {0: 3, 2: 4}, 2: {2: 2}}
    assert ragged(numels, lengths, [[0, 1, 2]]) == {0: [(0, 0, 7), (1, 7, 3)], 1: [], 2: [(1, 0, 4), (2, 4, 2)]}
    hsdp = {**lengths, **{r + 3: v for r, v in lengths.items()}}
    assert ragged(numels, hsdp, [[0, 1, 2], [3, 4, 5]])[0] == [(0, 0, 7), (1, 7, 3), (3, 0, 7), (4, 7, 3)]
    assert ragged(numels, {**lengths, 2: {2: 1}}, [[0, 1, 2]]) is None  # 4 + 1 != 6
    assert ragged(numels, {**hsdp, 5: {2: 1}, 4: {0: 3, 2: 5}}, [[0, 1, 2], [3, 4, 5]]) is None
    assert ragged(numels, {**lengths, 2: {7: 2}}, [[0, 1, 2]]) is None  # an index the model does not have
