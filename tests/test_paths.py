"""Store paths: every key becomes a valid Zarr node name, and distinct keys stay distinct."""

from __future__ import annotations

import pytest

from shardstore import paths


@pytest.mark.parametrize("key, want", [
    ("wte.weight", "wte.weight"), (3, "3"), ("a/b", "a%2Fb"), ("50%", "50%25"), ("", "%"), (".", "%2E"),
    ("..", "%2E%2E"), ("__metadata__", "%5F_metadata__"), ("_private", "_private"),
])
def test_escape(key: object, want: str) -> None:
    assert paths.escape(key) == want


def test_escaped_names_of_distinct_keys_differ() -> None:
    keys = ["a/b", "a%2Fb", "", "%", ".", "%2E", "__x", "%5F_x", "_x"]
    assert len({paths.escape(k) for k in keys}) == len(keys)


def test_join_skips_the_root() -> None:
    assert paths.join("", "model", "wte.weight") == "model/wte.weight"
