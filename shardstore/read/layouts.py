"""Finding the rank files of one checkpoint in a folder, whichever trainer named them.

OLMo writes rank{r}.pt; Composer writes ep{E}-ba{B}-rank{r}.pt, often in a folder ep{E}-ba{B}/, next to
latest-rank{r}.pt symlinks. Files are looked for in the folder and one level down; a symlink to a file
already found is not counted twice. A folder holding two checkpoints is never mixed: the caller picks one
with a tag (the file-name prefix or sub-folder, e.g. "ep0-ba20", or "latest" to follow the symlinks).
The rank a file names is only a hint: ingestion checks it against the rank pickled inside.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

from ..errors import CheckpointError
from ..locations import StorageOptions, filesystem, is_url, local
from .source import inside_run, names_step

RANK_FILE = re.compile(r"^(?P<tag>.*?)[-_.]?rank(?P<rank>[0-9]+)\.pt$")


def name_rank(path: str | os.PathLike[str]) -> int | None:
    """The rank a file's name claims, if it follows a known pattern."""
    m = RANK_FILE.match(Path(path).name)
    return int(m.group("rank")) if m else None


def _candidates(src: Path) -> list[Path]:
    top = sorted(src.iterdir())
    below = [p for d in top if d.is_dir() and not d.is_symlink() for p in sorted(d.iterdir())]
    return [p for p in top + below if RANK_FILE.match(p.name) and p.is_file()]


def _remote_scan(src: str, storage_options: StorageOptions | None) -> dict[str, dict[int, Path]]:
    """Rank files under a URL, grouped like local ones (object stores have no symlinks)."""
    fs, base = filesystem(src, storage_options)
    base = base.rstrip("/")
    try:
        found = fs.find(base, maxdepth=2)
    except FileNotFoundError:
        raise CheckpointError(f"{src}: no such folder") from None
    protocol = src.split("://", 1)[0]
    groups: dict[str, dict[int, Path]] = {}
    for key in sorted(found):
        rel = key[len(base):].lstrip("/")
        name = rel.rsplit("/", 1)[-1]
        m = RANK_FILE.match(name)
        if not m:
            continue
        folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
        tag = m.group("tag")
        group = folder if folder and (not tag or tag == folder) else tag
        groups.setdefault(group, {})[int(m.group("rank"))] = f"{protocol}://{key}"  # type: ignore[assignment]
    return groups


def _group_of(path: Path, src: Path) -> str:
    tag = RANK_FILE.match(path.name).group("tag")  # type: ignore[union-attr]
    return path.parent.name if path.parent != src and (not tag or tag == path.parent.name) else tag


def discover(src: str | os.PathLike[str], tag: str | None = None, step: int | None = None,
             storage_options: StorageOptions | None = None) -> list[Path]:
    """The rank files of the one checkpoint in `src` (or the one `tag` or `step` names), ordered by rank."""
    groups = scan(src, tag, step, storage_options)
    if not groups and step is not None:
        raise CheckpointError(f"{src}: no checkpoint of step {step} (looked for ba{step} / step{step})")
    if not groups and tag is not None:
        raise CheckpointError(f"{src}: no rank files tagged {tag!r}")
    if not groups:
        if not is_url(src) and any(Path(local(src)).glob("*.distcp")):
            raise CheckpointError(f"{src}: .distcp files without the .metadata file that describes them: a DCP "
                                  f"save that did not finish, or a copy that left it out")
        raise CheckpointError(f"{src}: no rank files (*rank<N>.pt) found")
    refuse_mixed(src, groups)
    (ranks,) = groups.values()
    return [ranks[r] for r in sorted(ranks)]


def refuse_mixed(src: str | os.PathLike[str], groups: dict[str, dict[int, Path]], how: str = "--tag or --step") -> None:
    """Never mix two checkpoints: name them and ask for one (`how` names the options that pick one)."""
    if len(groups) > 1:
        names = ", ".join(repr(g) if g else "(untagged)" for g in sorted(groups))
        raise CheckpointError(f"{src}: holds more than one checkpoint ({names}); pick one with {how}")


def scan(src: str | os.PathLike[str], tag: str | None = None, step: int | None = None,
         storage_options: StorageOptions | None = None) -> dict[str, dict[int, Path]]:
    """Rank files found in `src`, grouped by checkpoint (tag -> rank -> path); may be empty."""
    if is_url(src):
        return _filter(_remote_scan(str(src), storage_options), tag, step)
    src = Path(local(src))
    if not src.exists():
        raise CheckpointError(f"{src}: no such directory")
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory")
    files = _candidates(src)
    real = {p.resolve() for p in files if not p.is_symlink()}
    links = [p for p in files if p.is_symlink()]
    for link in links:  # a pointer out of the run is another run's file (Composer's latest-rank{r}.pt)
        inside_run(str(src), str(link))
    if tag == "latest":
        files = sorted({p.resolve() for p in links})
    else:
        # A link to a file already found is the same rank file again (Composer's latest-rank{r}.pt).
        files = [p for p in files if not p.is_symlink() or p.resolve() not in real]
    groups: dict[str, dict[int, Path]] = {}
    for path in files:
        ranks = groups.setdefault(_group_of(path, path.parent if tag == "latest" else src), {})
        rank = name_rank(path)
        assert rank is not None
        if rank in ranks:
            raise CheckpointError(f"{src}: two files claim rank {rank}: {ranks[rank]} and {path}")
        ranks[rank] = path
    return _filter(groups, tag, step)


def _filter(groups: dict[str, dict[int, Path]], tag: str | None, step: int | None) -> dict[str, dict[int, Path]]:
    if tag not in (None, "latest"):
        groups = {g: r for g, r in groups.items() if g == tag}
    if step is not None:
        groups = {g: r for g, r in groups.items() if names_step(g, step)}
    return groups


def missing_ranks(files: Sequence[str | os.PathLike[str]], world_size: int) -> list[int]:
    have = {name_rank(f) for f in files}
    return [r for r in range(world_size) if r not in have]
