"""Megatron-Core's LoRA adapters (Megatron-Bridge's, NeMo 2's, veRL's Megatron actor's) under the names
peft gives the Hugging Face model's, so that export/hf/lora.py reads them as any PEFT model's.

Bridge's and NeMo's `LoRA` wraps each target linear `X` and saves its adapter beside `X.weight` as
`X.adapter.linear_in.weight` (A, [r, in]) and `X.adapter.linear_out.weight` (B, [out, r]), each whole in
a torch_dist checkpoint, B's rows in the order of X's (per query group in linear_qkv, [gate; up] in a
SwiGLU linear_fc1); its forward scales B·A by alpha/r, as peft's LoRA does. The Hugging Face module a
block of X's rows becomes (linear_qkv's q_proj, k_proj, v_proj) gets A whole and the same rows of B: the
rows of ΔW are B's rows times A, so splitting the merged fused weight and merging each split part are
the same numbers. An adapter-only save (Bridge's and NeMo's PEFT runs keep the adapters alone) maps
through the base weights its adapters imply.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from ...errors import ExportError
from ...patterns import matcher
from ..adapters import PREFIX
from .spec import HFModel, HFTensor

ADAPTER = re.compile(r"(?P<module>.+?)\.adapter\.(?P<rest>.+)\Z")
PAIR = {"linear_in.weight": 0, "linear_out.weight": 1}  # A, B
EXTRA_STATE = "._extra_state"  # Transformer Engine's, which NeMo 2 keeps for the adapters' linears too
# Bridge's PEFT classes whose adapters are LoRA's fused pair (`LoRA`; `VLMLoRA` is it, for a VLM's parts)
LORA_CLASSES = ("megatron.bridge.peft.lora.LoRA", "megatron.bridge.peft.lora.VLMLoRA")


@dataclass(frozen=True)
class Adapters:
    """A Megatron model's LoRA adapters: each adapted module's A and B, by the module's name."""

    pairs: dict[str, tuple[str, str]]
    adapter_only: bool  # the save holds no base weight (Bridge's and NeMo's PEFT saves)


def has_adapters(names: list[str]) -> bool:
    return any(n.startswith("decoder.") and ADAPTER.match(n) for n in names)


def split(names: list[str], shapes: dict[str, tuple[int, ...]]
          ) -> tuple[Adapters | None, list[str], dict[str, tuple[int, ...]]]:
    """The adapters among a Megatron model's names, and the model's names and shapes without them (an
    adapter-only save's: the base weights its adapters imply). Refused by name: what of an adapter is
    not LoRA's pair (DoRA's magnitude, CanonicalLoRA's per-projection adapters, a grouped experts' stacked
    adapters), a pair not of one rank, a base weight missing from a save that has the others."""
    found: dict[str, list[str | None]] = {}
    for name in names:
        m = ADAPTER.match(name)
        if m is None or not name.startswith("decoder.") or name.endswith(EXTRA_STATE):
            continue
        if m["rest"] not in PAIR:
            raise ExportError(f"{name}: Megatron-Bridge's DoRA or CanonicalLoRA, not mapped onto peft's names (their "
                              f"saves at TP > 1 keep a row-parallel linear's DoRA magnitude per rank, and "
                              f"CanonicalLoRA's gate and up rows in TP order); --format safetensors writes them as saved")
        found.setdefault(m["module"], [None, None])[PAIR[m["rest"]]] = name
    if not found:
        return None, names, shapes
    pairs: dict[str, tuple[str, str]] = {}
    implied: dict[str, tuple[int, ...]] = {}
    for module, (a, b) in sorted(found.items()):
        if a is None or b is None:
            raise ExportError(f"{a or b}: the adapter of {module} has no linear_{'out' if a else 'in'}")
        sa, sb = shapes.get(a, ()), shapes.get(b, ())
        if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[1]:
            raise ExportError(f"{module}: its adapter's linear_in {list(sa)} and linear_out {list(sb)} are no LoRA "
                              f"pair (a grouped experts' adapters, stacked per expert, are not mapped)")
        pairs[module] = (a, b)
        implied[f"{module}.weight"] = (sb[0], sa[1])
    based = [w for w in implied if w in shapes]
    if based and len(based) != len(implied):
        missing = next(w for w in implied if w not in shapes)
        raise ExportError(f"{missing}: not in the checkpoint, whose other adapted modules have their base weights")
    rest = [n for n in names if not (ADAPTER.match(n) and n.startswith("decoder."))]
    kept = {n: s for n, s in shapes.items() if n in rest}
    if based:
        return Adapters(pairs, False), rest, kept
    return Adapters(pairs, True), rest + list(implied), {**kept, **implied}


def peft_named(model: HFModel, adapters: Adapters) -> HFModel:
    """`model` (the Hugging Face names of a Megatron model's base weights) as peft's PeftModel names it
    with the adapters: every tensor under `base_model.model.`, an adapted module's weight its
    `base_layer.weight`, its adapter `lora_A.default.weight` (A whole) and `lora_B.default.weight` (B's rows
    its weight's); an adapter-only save's as peft saves an adapter (`lora_A.weight`)."""
    by_weight = {f"{module}.weight": pair for module, pair in adapters.pairs.items()}
    tensors: list[HFTensor] = []
    placed = set()
    name = "" if adapters.adapter_only else ".default"
    for t in model.tensors:
        pair = by_weight.get(t.source)
        if pair is None:
            tensors.append(replace(t, key=PREFIX + t.key))
            continue
        if t.stack or not t.key.endswith(".weight"):
            raise ExportError(f"{pair[0]}: adapts {t.source}, which becomes part of {t.key}: not mapped onto "
                              f"peft's names")
        module = PREFIX + t.key.removesuffix(".weight")
        placed.add(t.source)
        if not adapters.adapter_only:
            tensors.append(HFTensor(f"{module}.base_layer.weight", t.source, t.rows))
        tensors += [HFTensor(f"{module}.lora_A{name}.weight", pair[0]),
                    HFTensor(f"{module}.lora_B{name}.weight", pair[1], t.rows)]
    unplaced = next((w for w in by_weight if w not in placed), None)
    if unplaced is not None:
        raise ExportError(f"{by_weight[unplaced][0]}: adapts {unplaced}, which the Hugging Face model has no "
                          f"place for")
    return HFModel(model.config, model.generation, tensors, model.files, model.notes)


def module_of(name: str) -> str:
    """The Megatron module an adapter's tensor (its name in the checkpoint) adapts."""
    m = ADAPTER.match(name)
    return m["module"] if m else name


@dataclass(frozen=True)
class RunLora:
    """What Megatron-Bridge's run_config.yaml says of the run's LoRA (its `peft:` section)."""

    r: int
    alpha: float
    targets: list[str]  # Megatron module names, or patterns of whole names with `*`

    def targets_module(self, module: str) -> bool:
        """Whether the run's target_modules name `module` as Bridge's ModuleMatcher matches them: by its
        last name, or a pattern (`*` any run of characters) of its whole name."""
        return any(module.rsplit(".", 1)[-1] == t or "*" in t and matcher(
            "re:" + ".*".join(re.escape(part) for part in t.split("*")), "target_modules", ExportError)(module)
            for t in self.targets)


def run_lora(raw: bytes, where: str) -> RunLora | None:
    """The LoRA Bridge's run_config.yaml records, None where the run trained none (read as plain YAML: its
    `_target_` names a class, never imported). Refused: a PEFT other than LoRA's fused pair, or ranks
    per expert layer (`normalize_moe_lora`)."""
    import yaml

    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ExportError(f"{where}: not YAML ({str(exc).splitlines()[0][:80]})") from None
    peft: Any = doc.get("peft") if isinstance(doc, dict) else None
    if peft is None:
        return None
    if not isinstance(peft, dict) or peft.get("_target_") not in LORA_CLASSES:
        kind = peft.get("_target_") if isinstance(peft, dict) else peft
        raise ExportError(f"{where}: peft is {str(kind)[:80]!r}; of Megatron-Bridge's PEFT, LoRA's adapters are "
                          f"mapped onto peft's (DoRA's and CanonicalLoRA's are not yet)")
    r: Any = peft.get("dim")
    alpha: Any = peft.get("alpha")
    targets: Any = peft.get("target_modules")
    if type(r) is not int or r <= 0 or type(alpha) not in (int, float) or not math.isfinite(alpha) \
            or not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ExportError(f"{where}: peft's dim, alpha and target_modules are not a rank, a number and names")
    if peft.get("normalize_moe_lora"):
        raise ExportError(f"{where}: normalize_moe_lora (a rank per expert layer) is not mapped onto peft's yet")
    return RunLora(r, float(alpha), targets)
