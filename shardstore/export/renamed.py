"""`--format dcp --names NAMES`: a Hugging Face model (or any checkpoint `--format hf` maps onto one) as a
DCP checkpoint under a trainer's own state-dict names, which `dcp.load` reads into that trainer's model
sharded at any world size.

NAMES is built in (`torchtitan`: torchtitan 0.3's names, Llama's q and k in its rotary order, DeepSeek-V3's
experts stacked: export/hf/torchtitan.py) or a JSON file of renames:
`{"regex": "replacement"}`, each transformers name matched whole by the first regex that matches it and
replaced (`\\1` for its groups), or left out where the replacement is null. A name no regex matches, or
two names renamed alike, are refused before anything is written.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import jsonin
from ..errors import ExportError
from ..store.store import Store
from ..tree import Node
from . import chunks, dcp
from .contract import ExportRequest, Planned, Progress, Written
from .hf import torchtitan
from .hf.torchtitan import Chunk, Renamed

MAX_RULES, MAX_BYTES = 10_000, 4 << 20


def plan_items(store: Store, subtree: str, request: ExportRequest) -> tuple[list[dcp.Item], dict[str, Any], list[str]]:
    """The checkpoint's chunks under the new names, what `.metadata` describes each key as, and notes."""
    assert request.names is not None
    model, sources, _ = chunks.model_arrays(store, subtree, request, request.dtype or "bfloat16")
    shapes = {k: it.shape for k, it in sources.items()}
    if request.names in torchtitan.VERSIONS:
        renamed = torchtitan.renamed(model.config or {}, shapes, "the model's config.json")
    else:
        renamed = _from_file(Path(request.names), shapes)
    items = []
    for c in renamed.chunks:
        source = sources[c.hf].source
        lead = len(renamed.shapes[c.target]) - len(source.shape)
        rows = sum(b - a for a, b in c.rows) if c.rows else source.shape[0]
        items.append(chunks.rows_item(c.target, c.offset, (1,) * lead + (rows, *source.shape[1:]), source, c.rows))
    dtypes = {c.target: sources[c.hf].dtype for c in renamed.chunks}
    described: dict[str, Any] = {key: ("tensor", dtypes[key], shape) for key, shape in renamed.shapes.items()}
    return items, described, model.notes + list(renamed.notes)


def _from_file(path: Path, shapes: dict[str, tuple[int, ...]]) -> Renamed:
    """The renames a JSON file gives (see the module's docstring), each name matched whole."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ExportError(f"--names {path}: {exc.strerror or exc}; a built-in name ({', '.join(torchtitan.VERSIONS)}) "
                          f"or a JSON file of renames") from None
    rules = jsonin.loads(raw, f"--names {path}", error=ExportError, max_bytes=MAX_BYTES)
    if not isinstance(rules, dict) or not all(isinstance(v, (str, type(None))) for v in rules.values()) \
            or len(rules) > MAX_RULES:
        raise ExportError(f"--names {path}: a JSON object of up to {MAX_RULES} regexes, each to a replacement "
                          f"(a string) or null (left out)")
    compiled = []
    for pattern, replacement in rules.items():
        try:
            compiled.append((re.compile(pattern), replacement))
        except re.error as exc:
            raise ExportError(f"--names {path}: {pattern!r:.60} is no regex ({exc})") from None
    out: dict[str, tuple[int, ...]] = {}
    found = []
    for key, shape in shapes.items():
        rule = next(((r, s) for r, s in compiled if r.fullmatch(key)), None)
        if rule is None:
            raise ExportError(f"{key}: --names {path} has no regex matching it (null leaves a name out)")
        if rule[1] is None:
            continue
        try:
            name = rule[0].fullmatch(key).expand(rule[1])  # type: ignore[union-attr]
        except (re.error, IndexError) as exc:
            raise ExportError(f"--names {path}: {rule[1]!r:.60} for {key}: {exc}") from None
        if name in out:
            raise ExportError(f"{key}: --names {path} renames it {name!r}, as it renames another")
        out[name] = shape
        found.append(Chunk(key, name, (0,) * len(shape)))
    return Renamed(out, tuple(found))


def _plan(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    items, described, notes = plan_items(store, subtree, request)
    plan = dcp.DcpPlan(described, {}, dcp.spread(items, jobs), {})

    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        if partial is not None:
            raise ExportError("--allow-partial: a checkpoint under --names is written whole or not at all")
        return dcp.export_dcp(store, out, plan, jobs, progress), [], notes

    return Planned(plan.names + [dcp.METADATA], plan.nbytes, write)


def _direct(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> chunks.ChunksDirect | None:
    items, described, notes = plan_items(store, subtree, request)
    fields = chunks.plan_direct(store, items, described, jobs)
    return None if fields is None else chunks.ChunksDirect(**fields, said=tuple(notes))


# `--format dcp` with `--names` (export/registry.py picks it)
FORMAT = replace(dcp.FORMAT, subtree=True, describes_model=True, plan=_plan, direct=_direct)
