"""Finding the rank files of one checkpoint in a folder, whichever trainer named them.

OLMo writes rank{r}.pt; Composer writes ep{E}-ba{B}-rank{r}.pt (often in a folder ep{E}-ba{B}/) beside
latest-rank{r}.pt symlinks. A folder holding two checkpoints is never mixed: the caller must pick one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError

RANK_FILE = re.compile(r"^(?P<tag>.*?)[-_.]?rank(?P<rank>\d+)\.pt$")


def _candidates(src: Path) -> list[Path]:
    found = [p for p in sorted(src.iterdir()) if p.is_file() and RANK_FILE.match(p.name)]
    if not found:  # a Composer save folder one level down
        found = [p for d in sorted(src.iterdir()) if d.is_dir()
                 for p in sorted(d.iterdir()) if p.is_file() and RANK_FILE.match(p.name)]
    return found


def discover(src: str | os.PathLike[str], tag: str | None = None) -> list[Path]:
    """The rank files of the one checkpoint in `src` (or the one `tag` names), ordered by rank."""
    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"{src}: no such directory")
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory")
    groups: dict[str, dict[int, Path]] = {}
    real: dict[Path, Path] = {}
    for path in _candidates(src):
        target = path.resolve()
        if target in real and (path.is_symlink() or real[target].is_symlink()):
            if real[target].is_symlink() and not path.is_symlink():
                real[target] = path  # prefer the real name over a latest-* link
            continue
        real[target] = path
    for path in real.values():
        m = RANK_FILE.match(path.name)
        assert m is not None
        name = m.group("tag")
        if path.is_symlink() and name.startswith("latest"):
            continue  # a latest-* link whose target is outside the folder: it names another checkpoint
        group = f"{path.parent.name}/{name}" if path.parent != src else name
        ranks = groups.setdefault(group, {})
        rank = int(m.group("rank"))
        if rank in ranks:
            raise CheckpointError(f"{src}: two files for rank {rank}: {ranks[rank].name} and {path.name}")
        ranks[rank] = path
    if tag is not None:
        groups = {g: r for g, r in groups.items() if tag in (g, g.split("/")[0], g.split("/")[-1])}
        if not groups:
            raise CheckpointError(f"{src}: no rank files tagged {tag!r}")
    if not groups:
        raise CheckpointError(f"{src}: no rank files (*rank<N>.pt) found")
    if len(groups) > 1:
        names = ", ".join(repr(g or "(untagged)") for g in sorted(groups))
        raise CheckpointError(f"{src}: holds more than one checkpoint ({names}); pick one with --tag")
    (ranks,) = groups.values()
    return [ranks[r] for r in sorted(ranks)]


def missing_ranks(files: list[Path], world_size: int) -> list[int]:
    have = {int(m.group("rank")) for f in files if (m := RANK_FILE.match(f.name))}
    return [r for r in range(world_size) if r not in have]
