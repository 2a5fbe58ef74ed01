"""The output formats (export/contract.py), by name: the command line's choices come from here.

A new output format is a module that writes it (two steps, and one pass under export/direct/) and one
entry below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import ExportError
from ..store.store import Store
from ..tree import Node
from .contract import ExportRequest, OutputFormat, Planned
from .dcp import METADATA, export_dcp, plan_dcp
from .direct import DirectExport
from .direct import dcp as direct_dcp
from .direct import safetensors as direct_safetensors
from .direct import torch as direct_torch
from .hf import export_hf, in_values, plan_hf, planned_files
from .notes import flat_buckets
from .resolve import leaves
from .safetensors import export_safetensors, plan_safetensors
from .torch import export_torch, torch_files

Progress = Callable[[int], None] | None
Written = tuple[list[Path], list[str], list[str]]  # files, leaves left out, notes


def _whole_store_notes(store: Store) -> list[str]:
    return flat_buckets(store.manifest.arrays)


def _plan_torch(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        return export_torch(store, out, progress, partial), [], _whole_store_notes(store)

    return Planned(torch_files(store), sum(a.nbytes for a in store.manifest.arrays.values()), write)


def _plan_dcp(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    plan = plan_dcp(store, jobs)

    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        return export_dcp(store, out, plan, jobs, progress, partial), [], _whole_store_notes(store)

    return Planned(plan.names + [METADATA], plan.nbytes, write)


def _plan_hf(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    model, plan = plan_hf(store, subtree, request.hf_config, request.strip_prefix, request.dtype,
                          request.max_shard_size)

    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        return export_hf(store, out, model, plan, progress, partial), [], model.notes

    return Planned(planned_files(model, plan), plan.nbytes, write)


def _plan_safetensors(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    plan = plan_safetensors(store, node, request.strip_prefix, request.dtype, request.max_shard_size)

    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        files = export_safetensors(store, out, plan, progress, partial, scheduler, jobs)
        return files, plan.skipped, flat_buckets(it.key for group in plan.groups for it in group)

    return Planned(plan.files, plan.nbytes, write)


def _tensors_only(store: Store, node: Node) -> bool:
    """Whether every leaf below `node` is known from the plan (an array, or a value known not to be a
    tensor): a plain value's shape comes with the data, too late for a layout made before it."""
    facts = store.manifest.facts
    return all(path in store.manifest.arrays or path in facts.not_tensors for _, path in leaves(node))


def _direct_hf(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> DirectExport | None:
    if not _tensors_only(store, node) or (request.hf_config is None and in_values(store)):
        return None
    model, plan = plan_hf(store, subtree, request.hf_config, request.strip_prefix, request.dtype,
                          request.max_shard_size)
    return direct_safetensors.plan(store, plan, model)


def _direct_safetensors(store: Store, request: ExportRequest, node: Node, subtree: str,
                        jobs: int) -> DirectExport | None:
    if not _tensors_only(store, node):
        return None
    plan = plan_safetensors(store, node, request.strip_prefix, request.dtype, request.max_shard_size)
    return direct_safetensors.plan(store, plan, None)


_SAFETENSORS = r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
FORMATS: dict[str, OutputFormat] = {f.name: f for f in (
    OutputFormat("safetensors", subtree=True, may_write=_SAFETENSORS, config_beside=True, resume_beside=False,
                 describes_model=False, takes_scheduler=True, plan=_plan_safetensors, direct=_direct_safetensors),
    OutputFormat("torch", subtree=False, may_write=None, config_beside=True, resume_beside=True,
                 describes_model=False, takes_scheduler=False, plan=_plan_torch,
                 direct=lambda store, request, node, subtree, jobs: direct_torch.plan(store)),
    OutputFormat("dcp", subtree=False, may_write=r"__\d+_0\.distcp|\.metadata", config_beside=True,
                 resume_beside=False, describes_model=False, takes_scheduler=False, plan=_plan_dcp,
                 direct=lambda store, request, node, subtree, jobs: direct_dcp.plan(store, jobs)),
    OutputFormat("hf", subtree=True, may_write=_SAFETENSORS + r"|config\.json|generation_config\.json",
                 config_beside=False, resume_beside=False, describes_model=True, takes_scheduler=False,
                 plan=_plan_hf, direct=_direct_hf),
)}


def output_format(name: str) -> OutputFormat:
    """The format called `name`, or one line naming the choices."""
    found = FORMATS.get(name)
    if found is None:
        raise ExportError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}")
    return found
