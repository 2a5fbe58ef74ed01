"""The output formats (export/contract.py), by name: the command line's choices come from here.

A new output format is one module that writes it, in two steps and in one pass (`plan_direct`), and
defines its `FORMAT`; one entry below; and a conformance subclass (tests/export/conformance.py).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..errors import ExportError
from . import dcp, hf, safetensors, torch
from .contract import ExportRequest, OutputFormat

FORMATS: dict[str, OutputFormat] = {f.name: f for f in (safetensors.FORMAT, torch.FORMAT, dcp.FORMAT, hf.FORMAT)}


def output_format(name: str) -> OutputFormat:
    """The format called `name`, or one line naming the choices."""
    found = FORMATS.get(name)
    if found is None:
        raise ExportError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}")
    return found


def request(format: str = "safetensors", **options: Any) -> ExportRequest:
    """The `ExportRequest` for the format called `format`, with `options` (its other fields), each checked
    once here: a name that is no option of an export is one line too."""
    known(options, OPTIONS)
    return ExportRequest(output_format(format), **options)


OPTIONS = frozenset(f.name for f in fields(ExportRequest)) - {"output"} | {"format"}


def known(options: dict[str, Any], names: frozenset[str]) -> None:
    """Refuse an option that is none of `names`, as Python refuses a keyword argument, naming them all."""
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the options are {', '.join(sorted(names))}")
