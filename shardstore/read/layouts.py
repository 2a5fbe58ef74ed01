"""Finding the rank files of one checkpoint in a folder, whichever trainer named them.

OLMo writes rank{r}.pt; Composer writes ep{E}-ba{B}-rank{r}.pt, often in a folder ep{E}-ba{B}/, next to
latest-rank{r}.pt symlinks; a plain FSDP run, model_rank{r}.pt in each step folder (step4/, checkpoint-4/).
Files are looked for in the folder and one level down; a symlink to a file already found is not counted
twice. Files of two sub-folders are never one checkpoint, and a folder holding two checkpoints is never
mixed: the run's own pointer (the latest-rank{r}.pt links, a `latest` link, latest_checkpointed_iteration.txt),
else the newest step, is taken, or the caller picks one with a tag (the file-name prefix or sub-folder, e.g.
"ep0-ba20", or "latest" to follow the symlinks) or a step. The rank a file names is only a hint: ingestion
checks it against the rank pickled inside.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

from ..errors import CheckpointError
from ..locations import StorageOptions, filesystem, folder_of, is_url, listing, local, name_of
from .source import inside_run, names_step, pick

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
        group = _group(folder, m.group("tag"))
        groups.setdefault(group, {})[int(m.group("rank"))] = f"{protocol}://{key}"  # type: ignore[assignment]
    return groups


def _group_of(path: Path, src: Path) -> str:
    tag = RANK_FILE.match(path.name).group("tag")  # type: ignore[union-attr]
    return _group(path.parent.name if path.parent != src else "", tag)


def _group(folder: str, tag: str) -> str:
    """The checkpoint a rank file is of, by name: at the top of the folder searched, its file-name prefix
    (ep0-ba20-rank0.pt: "ep0-ba20"); one level down, its sub-folder (a step folder: ep0-ba20/, step4/),
    followed by the prefix where the file names another (step4/model_rank0.pt: "step4/model"). Files of
    two sub-folders are never one checkpoint, whatever they are named."""
    if not folder:
        return tag
    return folder if tag in ("", folder) else f"{folder}/{tag}"


def _step_of(group: str) -> str:
    """The name a group's step is in: its sub-folder, or at the top its file-name prefix."""
    return group.split("/")[0]


def discover(src: str | os.PathLike[str], tag: str | None = None, step: int | None = None,
             storage_options: StorageOptions | None = None) -> list[Path]:
    """The rank files of the one checkpoint in `src` (or the one `tag` or `step` names), ordered by rank."""
    groups = scan(src, tag, step, storage_options)
    if tag == "latest" and not groups:  # no latest-rank<N>.pt links: the run's other pointers, as without a tag
        tag, groups = None, scan(src, None, step, storage_options)
    if len(groups) > 1 and step is None and tag != "latest":
        groups = _taken(src, groups, tag, storage_options)
    if not groups and step is not None:
        raise CheckpointError(f"{src}: no checkpoint of step {step} (looked for ba{step} / step{step})")
    if not groups and tag is not None:
        raise CheckpointError(f"{src}: no rank files tagged {tag!r}")
    if not groups:
        if not is_url(src) and any(Path(local(src)).glob("*.distcp")):
            raise CheckpointError(f"{src}: .distcp files without the .metadata file that describes them: a DCP "
                                  f"save that did not finish, or a copy that left it out")
        raise CheckpointError(f"{src}: {_what_is_there(os.fspath(src), storage_options)}")
    refuse_mixed(src, groups)
    (ranks,) = groups.values()
    return [ranks[r] for r in sorted(ranks)]


def _taken(src: str | os.PathLike[str], groups: dict[str, dict[int, Path]], tag: str | None,
           storage_options: StorageOptions | None) -> dict[str, dict[int, Path]]:
    """Of several checkpoints, with no step named, the one the run points at, as a run of checkpoint
    folders is read: its latest-rank<N>.pt links (Composer's, unless a tag names others), else as
    `source.pick` takes a step folder (latest_checkpointed_iteration.txt, a `latest` link, the newest).
    Groups of one folder (model_rank0.pt beside optim_rank0.pt) are all kept: the caller refuses them."""
    if tag is None and not is_url(src):
        latest = scan(src, "latest", None, storage_options)
        if latest:
            return latest
    steps = sorted({_step_of(g) for g in groups})
    if len(steps) == 1 or "" in steps:
        return groups
    taken = pick(os.fspath(src), steps, None, None, storage_options)
    return {g: r for g, r in groups.items() if _step_of(g) == taken}


READS = "shardstore reads a sharded checkpoint's folder (per-rank *rank<N>.pt files, a DCP folder, ...)"
WHOLE = (".bin", ".pt", ".pth", ".ckpt", ".safetensors")  # what a model saved whole is named (pytorch_model.bin)
DONE = ("already unsharded: nothing to do (load it as it is; `shardstore verify SHARDED_SRC OUT` checks it "
        "against the sharded checkpoint it came from)")


def _a_shard(name: str) -> bool:
    """Whether a file's name says it is one rank's (rank0.pt, mp_rank_00_model_states.pt, 0_0.distcp)."""
    return "rank" in name.lower() or name.endswith(".distcp")


def _what_file(name: str, folder: str) -> str:
    """What a file given in place of a checkpoint folder is, by its name, and what to do instead."""
    if _a_shard(name):
        return (f"one file of a sharded checkpoint: name the folder it is in ({folder}), or ingest files one by "
                f"one (shardstore ingest STORE FILE...)")
    if name.endswith(".gguf"):
        return f"a GGUF file (llama.cpp's), not a training checkpoint; {READS}"
    if name.endswith(WHOLE):
        return f"one file, not a folder of shards: weights saved in one file are {DONE}"
    return f"a file, not a folder; {READS}"


def _what_is_there(src: str, storage_options: StorageOptions | None) -> str:
    """What a folder holding no checkpoint holds instead (nothing; weights saved whole; GGUF files; other
    files), and what shardstore reads: the one line refusing it."""
    names = [name_of(p) for p in listing(src, storage_options)]
    if not names:
        return "an empty folder: no checkpoint in it"
    some = f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
    if any(n.endswith(".gguf") for n in names):
        return f"holds GGUF files (llama.cpp's: {some}), not a training checkpoint; {READS}"
    if any(n.endswith(WHOLE) for n in names) and not any(_a_shard(n) for n in names):
        return f"holds {some} and no shards: weights saved whole, {DONE}"
    return f"no checkpoint in it (it holds {some}); {READS}"


def taken_among(units: list[str], storage_options: StorageOptions | None = None) -> tuple[str, list[str]] | None:
    """Where rank files of several saves share one folder (Composer's ep0-ba10-rank0.pt beside
    ep0-ba20-rank0.pt): the tag of the save `units` are of and every tag there, for saying which was taken;
    None where the folder holds one save."""
    if not units or name_rank(units[0]) is None:
        return None
    folder = folder_of(units[0])
    groups = scan(folder, None, None, storage_options)
    taken = RANK_FILE.match(name_of(units[0])).group("tag")  # type: ignore[union-attr]
    return (taken, sorted(groups)) if len(groups) > 1 and taken in groups else None


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
        raise CheckpointError(f"{src}: {_what_file(src.name, str(src.parent))}")
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
    """The groups `tag` names (the whole name, its sub-folder or its file-name prefix: "step4/model" is
    tagged step4 and model) and whose names are of `step`."""
    if tag not in (None, "latest"):
        groups = {g: r for g, r in groups.items() if tag in (g, *g.split("/"))}
    if step is not None:
        groups = {g: r for g, r in groups.items() if any(names_step(part, step) for part in g.split("/"))}
    return groups


def missing_ranks(files: Sequence[str | os.PathLike[str]], world_size: int) -> list[int]:
    have = {name_rank(f) for f in files}
    return [r for r in range(world_size) if r not in have]
