"""The output formats (export/contract.py), by name: the command line's choices come from here.

A new output format is one module that writes it, in two steps and in one pass (`plan_direct`), and
defines its `FORMAT`; one entry below; and a conformance subclass (tests/export/conformance.py).
"""

from __future__ import annotations

from ..errors import ExportError
from . import dcp, hf, safetensors, torch
from .contract import OutputFormat

FORMATS: dict[str, OutputFormat] = {f.name: f for f in (safetensors.FORMAT, torch.FORMAT, dcp.FORMAT, hf.FORMAT)}


def output_format(name: str) -> OutputFormat:
    """The format called `name`, or one line naming the choices."""
    found = FORMATS.get(name)
    if found is None:
        raise ExportError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}")
    return found
