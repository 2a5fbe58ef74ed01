"""Names: what is a number in one (`digits`), and patterns (`--keep-dtype`, `ls PATTERN`) matched in time
linear in the name.

The names matched come from the checkpoint, so a pattern must not let them choose how long a match takes:
Python's `re` backtracks (`re:(a+)+$` against `aaaa…a!` takes exponential time), so both globs and
`re:` patterns are compiled for RE2 (google-re2), whose matching is linear in the name and whose memory is
bounded. A regex RE2 cannot run in linear time (a back-reference, a look-around) is refused in one line.
Names are matched as their UTF-8 bytes (lone surrogates too, as `paths` encodes them).
"""

from __future__ import annotations

import functools
import re
from typing import Callable

from .errors import ShardstoreError

REGEX = "re:"


def digits(text: str) -> bool:
    """Whether `text` is ASCII digits alone, as every trainer writes a step or rank into a name: str.isdigit()
    and `\\d` also take other scripts' digits (`step-٩` is not step 9) and superscripts (`'²'.isdigit()`,
    which int() refuses)."""
    return text.isascii() and text.isdigit()


@functools.lru_cache(maxsize=256)  # a pattern is asked about every name of a checkpoint
def matcher(pattern: str, what: str, error: type[ShardstoreError] = ShardstoreError) -> Callable[[str], bool]:
    """Whether a whole name matches `pattern`: a shell glob (`*`, `?`, `[...]`, `[!...]`), or a regular
    expression after `re:`. A pattern that is not one, or that RE2 cannot take, is refused as `error`,
    naming the option (`what`)."""
    import re2  # (here, not at the top: the readers import this module for `digits` alone)

    source = pattern[len(REGEX):] if pattern.startswith(REGEX) else _glob(pattern)
    try:
        re.compile(source)  # (compiled only, never matched: its syntax errors say what Python users expect)
    except re.error as exc:
        raise error(f"{what} {pattern!r}: not a regular expression ({exc})") from None
    options = re2.Options()
    options.log_errors = False  # the refusal below is the one line the user sees
    options.dot_nl = True  # a name is one string, newlines and all (as fnmatch's globs see it)
    try:
        compiled = re2.compile(source.encode("utf-8", "surrogatepass"), options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise error(f"{what} {pattern!r}: not a pattern shardstore can match in linear time ({reason}); "
                    f"back-references and look-arounds are not supported") from None
    return lambda name: compiled.fullmatch(name.encode("utf-8", "surrogatepass")) is not None


def nearest(pattern: str, names: list[str]) -> str | None:
    """The name a pattern that matches none of `names` most likely meant (`*nrom*`: `model.norm.weight`):
    the one whose dotted and underscored parts best match the pattern's words, each word scored by
    difflib against its closest part (a whole-name comparison would favour names of the same length)."""
    import difflib

    words = re.findall(r"[A-Za-z]+|[0-9]+", re.sub(r"\\.", " ", pattern.removeprefix(REGEX)))  # `\d`, `\.` aside

    def score(name: str) -> float:
        parts = re.split(r"[._]", name)
        return sum(max(difflib.SequenceMatcher(None, w, p).ratio() for p in parts) for w in words)

    return max(names, key=score, default=None)


def _glob(glob: str) -> str:
    """A shell glob as a regular expression RE2 takes (fnmatch.translate's needs back-references)."""
    out: list[str] = []
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        i += 1
        if c == "*":
            if not out or out[-1] != ".*":
                out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            end = i + (i < n and glob[i] == "!")
            end += end < n and glob[end] == "]"  # a "]" first in the set is one of its characters
            end = glob.find("]", end)
            if end < 0:  # no closing bracket: a literal "[", as fnmatch takes it
                out.append(re.escape(c))
                continue
            body, i = glob[i:end], end + 1
            negate = body.startswith("!")
            body = body[negate:].replace("\\", "\\\\").replace("[", "\\[")  # both literal in a glob's set
            if body.startswith("^") and not negate:  # a literal caret, not RE2's negation
                body = "\\" + body
            out.append(f"[{'^' if negate else ''}{body}]")
        else:
            out.append(re.escape(c))
    return "".join(out)
