"""Names: ASCII digits alone are a number; globs as fnmatch reads them, regexes after `re:`, both in time
linear in the name."""

from __future__ import annotations

import fnmatch
import random
import time

import pytest

from shardstore.errors import ShardstoreError
from shardstore.patterns import digits, matcher


def _random_globs_and_names(seed: int, count: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    glob_chars, name_chars = "ab.*?[]!^\\", "ab.[]!^\\\n"
    return [("".join(rng.choice(glob_chars) for _ in range(rng.randint(0, 8))),
             "".join(rng.choice(name_chars) for _ in range(rng.randint(0, 8)))) for _ in range(count)]


def test_globs_match_as_fnmatch_matches_them() -> None:
    """fnmatch is the oracle: thousands of globs of its special characters against names of the same ones."""
    cases = _random_globs_and_names(0, 20_000)
    cases += [("*norm*", "model.layers.0.input_layernorm.weight"), ("model.*.bias", "model.a.b.bias"),
              ("[a-c]x", "bx"), ("[!a-c]x", "bx"), ("[!a-c]x", "dx"), ("[]]", "]"), ("[!]]", "a"), ("[^a]", "^"),
              ("[", "["), ("a[", "a["), ("*é*", "xéy"), ("?", "é"), ("*", "line\nbreak")]
    for glob, name in cases:
        assert matcher(glob, "--keep-dtype")(name) == fnmatch.fnmatchcase(name, glob), (glob, name)


def test_regexes_match_the_whole_name() -> None:
    keep = matcher(r"re:model\.layers\.\d+\.(input|post_attention)_layernorm\.weight", "--keep-dtype")
    assert keep("model.layers.12.input_layernorm.weight")
    assert not keep("model.layers.12.input_layernorm.weight.x") and not keep("xmodel.layers.1.input_layernorm.weight")
    assert matcher("re:a.c", "--keep-dtype")("a\ud800c")  # a lone surrogate is one character, as paths.py keeps it


def test_a_name_crafted_against_a_backtracking_pattern_is_matched_in_linear_time() -> None:
    """`(a+)+$` against `aaaa…a!`: Python's re needs about 2**n steps (it would not finish here); a name a
    hundred times longer takes about a hundred times as long (the ratio, with room for a noisy machine, is
    what is asserted, not a wall-clock limit)."""
    evil = matcher("re:(a+)+$", "--keep-dtype")

    def took(n: int) -> float:
        name = "a" * n + "!"
        start = time.perf_counter()
        for _ in range(20):
            assert not evil(name)
        return time.perf_counter() - start

    short, long = min(took(10_000) for _ in range(3)), min(took(1_000_000) for _ in range(3))
    assert long < short * 100 * 10, (short, long)


@pytest.mark.parametrize("pattern", [r"re:(a)\1", "re:(?=a)b", "re:a(?!b)"])
def test_patterns_that_cannot_be_matched_in_linear_time_are_one_line(pattern: str) -> None:
    with pytest.raises(ShardstoreError, match=r"^--keep-dtype '.*': not a pattern shardstore can match in linear time"):
        matcher(pattern, "--keep-dtype")


@pytest.mark.parametrize("pattern", ["re:(", "re:a**", "[z-a]"])
def test_patterns_that_are_not_patterns_are_one_line(pattern: str) -> None:
    with pytest.raises(ShardstoreError, match=r"^--keep-dtype '.*': not a regular expression \("):
        matcher(pattern, "--keep-dtype")


@pytest.mark.parametrize("text, ok", [("0009", True), ("٩", False), ("²", False), ("1٩", False), ("", False),
                                      ("９", False), ("12", True)])
def test_digits_are_ascii_digits_alone(text: str, ok: bool) -> None:
    """str.isdigit() takes `٩` (an Arabic-Indic nine) and `²` (which int() refuses); a step name does not."""
    assert digits(text) is ok
