"""Safetensors and Hugging Face folders in one pass: the header first, every tensor's bytes where it
says; a row block of a split weight (`att_proj` -> q, k, v) is a box of the fused array."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...store.store import Store
from ..hf import planned_files, write_model_files
from ..hf.spec import HFModel
from ..notes import flat_buckets
from ..resolve import ArrayRef
from ..safetensors import SafetensorsPlan, header, write_index
from . import DirectExport
from .layout import Layout, Target, new_layout, prepare


@dataclass(frozen=True)
class SafetensorsDirect(DirectExport):
    layout: Layout
    plan: SafetensorsPlan
    model: HFModel | None  # for hf: the config and tokenizer files written beside the weights

    @property
    def files(self) -> list[str]:
        return planned_files(self.model, self.plan) if self.model else self.plan.files

    @property
    def skipped(self) -> list[str]:
        return self.plan.skipped

    @property
    def notes(self) -> list[str]:
        return self.model.notes if self.model else flat_buckets(it.key for group in self.plan.groups for it in group)

    def finish(self, store: Store, out: Path) -> list[Path]:
        return write_index(out, self.plan) + (write_model_files(out, self.model) if self.model else [])


def plan(store: Store, plan: SafetensorsPlan, model: HFModel | None) -> SafetensorsDirect:
    """The layout of `plan`, whose every tensor is an array of the store's plan (the caller made sure)."""
    targets: dict[str, list[Target]] = {}
    sizes, heads = [], []
    for i, group in enumerate(plan.groups):
        head = header(group, {})
        offset = len(head)
        for item in group:
            ref = item.source
            assert isinstance(ref, ArrayRef), item.key  # plain values never reach a one-pass plan
            if ref.rows is None:
                targets.setdefault(ref.path, []).append(Target(i, offset, None, item.dtype))
                offset += item.nbytes
                continue
            shape = store.manifest.arrays[ref.path].shape
            row = item.nbytes // ref.shape[0] if ref.shape[0] else 0  # one row, in the output's dtype
            for first, stop in ref.rows:  # each block where the ones before it end
                box = ((first,) + (0,) * (len(shape) - 1), (stop - first,) + shape[1:])
                targets.setdefault(ref.path, []).append(Target(i, offset, box, item.dtype))
                offset += (stop - first) * row
        sizes.append(offset)
        heads.append([(0, head)])
    lay = new_layout(store, plan.names, sizes, targets)
    prepare(store, lay, heads)
    return SafetensorsDirect(lay, plan, model)
