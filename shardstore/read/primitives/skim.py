"""A rank file's pickle without every rank's shard metadata.

Every ShardedTensor in a rank file carries the global list of every rank's shard (`shards_metadata`,
and the same devices again in its sharding spec's `placements`): W entries per tensor in each of W
files. At world size 1024 that is ~400k objects and 48 MB of pickle per file for an OLMo-7B shape, and
building them is what reading a rank file costs. A worker needs none of them: once the store is planned
(from one file read whole), it only has to know that its file's lists are the planned ones.

The C extension (`_pickle_scan.skim`) cuts both lists out of the opcode stream, puts a global naming a
placeholder in their place, and digests each `shards_metadata` list's opcodes in a normal form that does
not depend on memo numbering, so two files whose lists hold the same values give the same digest. The
rest of the pickle, a small fraction, goes through the same safe unpickler as ever. Nothing in the cut
lists is built or called. Anything the skimmer does not recognise (or no C compiler at install time)
gives None, and the caller unpickles the whole file: identical results, just slower.

Walking and digesting the lists is still linear in W in every file, and at W=1024 it was most of a
file's cost. But one save's rank files repeat the same lists byte for byte, so each process keeps the
lists of the last file it skimmed (a `Reference`: their bytes, and the atoms they read from outside
themselves). The next file's list that is the same bytes, reading the same atoms and ending at the same
place, has the same normal form, so the same digest: it is compared with memcmp and its memo entries
replayed, not walked and hashed again. Anything else is walked as before; the result is the same either
way (tests/read/primitives/test_skim.py and the fuzz harness compare them).
"""

from __future__ import annotations

import hashlib
import secrets
import sys
from dataclasses import dataclass
from typing import Any, Literal

from .unpickle import load

try:
    from ._pickle_scan import skim as _skim_c  # type: ignore[import-not-found, unused-ignore]  # (absent where no compiler built it)
except ImportError:  # not built: every file is unpickled whole
    _skim_c = None

NATIVE = _skim_c is not None


class Span:
    """Where a `shards_metadata` list was: the index of its digest."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _Elided:
    """What stands for anything else that was cut (a placements list, a reference into a cut list)."""


@dataclass(frozen=True)
class Reference:
    """The lists of a file skimmed before, and their normal forms (what `Skimmed.decode` needs)."""

    lists: Any  # the C extension's capsule
    forms: dict[str, bytes]


_LAST: list[Reference] = []  # this process's reference: the last file skimmed in full (at most one)


@dataclass
class Skimmed:
    data: bytes  # the pickle without the lists
    digests: list[str]  # of each cut `shards_metadata` list, in stream order
    forms: dict[str, bytes]  # with `forms=True`: each distinct list's normal form (a pickle of it), by digest
    globals: dict[tuple[str, str], Any]  # the placeholders' globals, for the unpickler
    spans: list[Span]  # the placeholder of each cut `shards_metadata` list
    elided: _Elided  # the one object standing for what else was cut
    matched: int  # cut lists that were the reference's, compared byte for byte instead of walked
    cut: int  # cut lists in all (`shards_metadata` and `placements`)
    reference: Reference | None  # this file's lists, where no reference was given

    def span_index(self, value: Any) -> int | None:
        """Which cut list `value` stands for, if it is one of this file's placeholders."""
        if isinstance(value, Span) and value.index < len(self.spans) and self.spans[value.index] is value:
            return value.index
        return None

    def elided_kept(self) -> bool:
        """Whether anything still refers to what else was cut: once the unpickler is gone, only this record
        and its globals may (a sharding spec holding it was dropped; a trainer's value holding it was not)."""
        return sys.getrefcount(self.elided) > 3  # this record, the globals, getrefcount's own argument

    def decode(self, digest: str, where: str, strict: bool) -> Any:
        """The cut list with this digest, built (by the same safe unpickler) from its normal form."""
        return load(b"\x80\x02" + self.forms[digest] + b".", where, strict)


def skim(data: bytes | memoryview, forms: bool = False,
         reference: Reference | None | Literal[True] = True) -> Skimmed | None:
    """`data` (a rank file's pickle) without its shard lists, or None where the skimmer does not apply.
    `reference`: True for this process's last file (and this file becomes it when that one does not fit),
    None for none, or a given one."""
    if _skim_c is None:
        return None
    given = (_LAST[0] if _LAST else None) if reference is True else reference
    kept: dict[str, bytes] = dict(given.forms) if given is not None else {}

    def digest(form: bytes) -> str:
        text = hashlib.sha256(form).hexdigest()[:32]
        kept.setdefault(text, form)
        return text

    # A fresh module name each time: a file cannot name a placeholder it was not given.
    module = f"shardstore_elided_{secrets.token_hex(8)}"
    found = _skim_c(data, module, digest, given.lists if given is not None else None)
    if found is None:
        return None
    out, digests, built, matched, lists = found
    made = Reference(built, kept) if built is not None else None
    if reference is True and (made is not None or matched < lists):
        _LAST[:] = [made] if made is not None else []  # a miss: the next file makes its own
    elided, spans = _Elided(), [Span(i) for i in range(len(digests))]
    names: dict[tuple[str, str], Any] = {(module, "ref"): elided}
    names.update({(module, f"span{s.index}"): s for s in spans})
    mine = {d: kept[d] for d in digests} if forms else {}  # (a reference's forms hold other files' lists too)
    return Skimmed(out, digests, mine, names, spans, elided, matched, lists, made)
