"""The output formats (export/contract.py), by name: the command line's choices come from here.

A new output format is one module that writes it, in two steps and in one pass (`plan_direct`), and
defines its `FORMAT`; one entry below; and a conformance subclass (tests/export/conformance.py).
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ..errors import ExportError
from . import dcp, hf, megatron, nemo, renamed, safetensors, torch
from .contract import ExportRequest, OutputFormat

# safetensors writes a model with its adapter merged as the Hugging Face folder's weights (hf/ plans the merge)
SAFETENSORS = replace(safetensors.FORMAT, merged=hf.merged_weights)
FORMATS: dict[str, OutputFormat] = {f.name: f for f in (SAFETENSORS, torch.FORMAT, dcp.FORMAT, hf.FORMAT, megatron.FORMAT,
                                                          nemo.FORMAT)}
# the order `recognised` asks them in: a Megatron-LM run folder (which has a config.json too), a folder with config.json is a Hugging Face folder (of safetensors
# files), one with .metadata a DCP folder, torch files and no safetensors a torch export; else safetensors
RECOGNISED = (megatron.FORMAT, nemo.FORMAT, hf.FORMAT, dcp.FORMAT, torch.FORMAT, SAFETENSORS)
# the format writing a model's tensors under their own names: what a model's state dict in torch files holds
TENSORS = SAFETENSORS


def recognised(out: Path) -> OutputFormat:
    """Which export OUTPUT looks like, by its names."""
    return next(f for f in RECOGNISED if f.recognises(out))


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
    output = output_format(format)
    if output is dcp.FORMAT and options.get("names") is not None:  # the same writer, under other names
        output = renamed.FORMAT
    return ExportRequest(output, **options)


OPTIONS = frozenset(f.name for f in fields(ExportRequest)) - {"output", "arrays", "base_model"} | {"format"}


def known(options: dict[str, Any], names: frozenset[str]) -> None:
    """Refuse an option that is none of `names`, as Python refuses a keyword argument, naming them all."""
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the options are {', '.join(sorted(names))}")
