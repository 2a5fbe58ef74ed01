"""`--format hf`: a folder `AutoModelForCausalLM.from_pretrained` loads, written straight from the store.

Where the model's Hugging Face description comes from, first match wins:
- `hf_config`: a config.json, or a folder holding one and tokenizer files (copied); weights keep their
  names (after `strip_prefix`);
- a Composer checkpoint of a transformers model (llm-foundry's ComposerHFCausalLM) carries its config and
  tokenizer files under `state/integrations/huggingface`; weights lose Composer's `model.` prefix;
- an OLMo-core trainer checkpoint, from the experiment config.json its trainer writes beside it
  (`olmo_core.py`);
- a checkpoint saved with its Hugging Face files beside it (veRL's huggingface/), kept as side files;
  Megatron-Core's GPT names are mapped onto the Llama-family class the config names (`megatron.py`);
- an OLMo checkpoint with the run's config.yaml kept in the store: OLMo 1 or OLMo 2 (`olmo.py`).
The weights go out through the safetensors writer, so splits stream and copies stay kernel-side.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ... import dtypes, jsonin
from ...errors import ExportError, ShardstoreError
from ...hf_files import ADAPTER_CONFIG, describes_model
from ...sink.output import OutputFile
from ...store.store import Store
from ...tree import Node, node_at
from ...trainers import nemo
from ...trainers.megatron import RUN_CONFIG
from ..contract import DirectExport, ExportRequest, OutputFormat, Planned, Progress, Written
from ..resolve import build, tensors_only
from ..safetensors import (FILE_NAMES, Item, SafetensorsDirect, SafetensorsPlan, Stacked, direct_layout,
                           export_safetensors, plan_items, planned_safetensors, stacked_item, tensor_item)
from .. import adapters, mxfp4, quantized
from . import lora, megatron, megatron_lora, olmo, olmo_core
from .leaves import CONFIG, GENERATION, NOT_HF_FILES, model_files, model_leaves, module_attribute, shape, side_config
from .megatron_llama import EMBEDDING
from .spec import HFModel, HFTensor

NEMO_MODEL = nemo.MODEL  # NeMo's context/model.yaml, which its reader keeps as a side file
COMPOSER_HF = "state/integrations/huggingface"
DTYPE_KEYS = ("dtype", "torch_dtype")  # a config's dtype, as transformers >= 4.56 and before spell it


NO_HF_DESCRIPTION = ("cannot tell which Hugging Face model this is: the checkpoint has no config.yaml (OLMo), no "
                     "Hugging Face config.json beside it (or in its run folder) and none inside (Composer); give "
                     "--hf-config PATH")


def in_values(store: Store) -> bool:
    """Whether the model is described by values the store holds (Composer's Hugging Face metadata,
    Megatron-LM's common state where the plan did not read its args), which only the data brings."""
    described = {CONFIG, NEMO_MODEL, RUN_CONFIG} & set(store.manifest.facts.side_files)  # (`describe` reads first)
    return _holder(store, COMPOSER_HF) is not None \
        or (_megatron_common(store) is not None and store.manifest.facts.megatron_args is None and not described)


def _megatron_common(store: Store) -> Node | None:
    """Megatron-Core's common state, if the checkpoint has one (where the plan found it: a bytes item
    `common_state/shard_0_1` in megatron-core >= 0.19's own files, the values of `common.pt` under
    `common_state` before, the first rank's file's values in Megatron-LM's torch format)."""
    where = store.manifest.facts.megatron_common
    return None if where is None else node_at(store.manifest.tree, where)


def _from_megatron_args(store: Store, subtree: str, node: Node) -> tuple[HFModel, dict[str, str]]:
    planned = store.manifest.facts.megatron_args
    if isinstance(planned, dict):  # read with the plan
        return _megatron_from(store, subtree, planned, "Megatron's common state: args")
    common = build(store, node, plain_dicts=True)
    common = common[0] if isinstance(common, list) and len(common) == 1 else common
    args = common.get("args") if isinstance(common, dict) else None
    state = getattr(args, "state", None)
    if not isinstance(state, dict):
        raise ExportError("Megatron's common state holds no args to describe the model (a checkpoint of a "
                          "trainer other than Megatron-LM?); give --hf-config")
    return _megatron_from(store, subtree, state, "Megatron's common state: args")


def _from_yaml(store: Store, subtree: str, raw: bytes, where: str, section: str) -> tuple[HFModel, dict[str, str]]:
    """A Megatron GPT model described by the TransformerConfig a trainer's YAML file holds (NeMo 2's
    context/model.yaml, Megatron-Bridge's run_config.yaml)."""
    names = model_leaves(store, subtree, None)
    rows = shape(store, names[EMBEDDING]) if EMBEDDING in names else None
    return _megatron_from(store, subtree, megatron.args_from_yaml(raw, rows[0] if rows else None, where, section),
                          where)


def _megatron_from(store: Store, subtree: str, args: dict[str, Any], where: str) -> tuple[HFModel, dict[str, str]]:
    """A Megatron GPT model described by Megatron-LM's arguments."""
    config, notes = megatron.config_from_args(args, where)
    names = model_leaves(store, subtree, None)
    shapes = {n: s for n, p in names.items() if (s := shape(store, p)) is not None}
    model = megatron.plan(config, list(names), shapes, where, {})
    model.notes += notes
    return model, names


def has_hf_description(store: Store) -> bool:
    """Whether the checkpoint may describe its model itself, from its plan alone (no rank need be in):
    the run's config.yaml, Composer's Hugging Face metadata, NeMo's model.yaml, Megatron-Bridge's
    run_config.yaml, or Megatron-LM's common state."""
    side = store.manifest.facts.side_files
    return in_values(store) or "config.yaml" in side or CONFIG in side or NEMO_MODEL in side or RUN_CONFIG in side \
        or store.manifest.facts.megatron_args is not None


def _from_olmo(store: Store, subtree: str) -> tuple[HFModel, dict[str, str]]:
    import yaml

    raw = side_config(store, "config.yaml")
    if raw is None:
        raise ExportError(NO_HF_DESCRIPTION)
    try:
        cfg = (yaml.safe_load(raw) or {}).get("model")
    except (yaml.YAMLError, AttributeError) as exc:
        raise ExportError(f"config.yaml: unreadable ({str(exc).splitlines()[0][:100]})") from None
    if not isinstance(cfg, dict):
        raise ExportError("config.yaml: no `model` section; not an OLMo training config")
    group = int(cfg.get("block_group_size") or 1)
    names = model_leaves(store, subtree, None, lambda n: olmo.normalise(n, group))
    shapes = {n: s for n, p in names.items() if (s := shape(store, p)) is not None}
    return olmo.plan(cfg, list(names), shapes), names


def _holder(store: Store, path: str) -> tuple[Any, list[str]] | None:
    """The node that holds `path`, whether the store keeps it as a subtree or inside a value above it (a
    dict of plain values is one leaf), and the keys below that node; None if there is none."""
    parts = path.split("/")
    for depth in range(len(parts), 0, -1):
        try:
            node = node_at(store.manifest.tree, "/".join(parts[:depth]))
        except ExportError:
            continue
        return (node, parts[depth:]) if depth == len(parts) or node.kind == "leaf" else None
    return None


def _value_at(store: Store, path: str) -> Any:
    """The value at `path` (see `_holder`); None if there is none."""
    held = _holder(store, path)
    if held is None:
        return None
    node, below = held
    value = build(store, node, plain_dicts=True)
    for key in below:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _from_composer(store: Store, subtree: str, meta: Any) -> tuple[HFModel, dict[str, str]]:
    try:
        config = meta["model"]["config"]["content"]
        if not isinstance(config, dict):
            raise TypeError
    except (KeyError, TypeError):
        raise ExportError(f"{COMPOSER_HF}: holds no model config (not a Composer HuggingFaceModel checkpoint?)") from None
    files: dict[str, bytes] = {}
    tokenizer = meta.get("tokenizer") or {}
    notes = []
    if tokenizer and not store.manifest.facts.keeps_empty_values:
        # DCP stores nested values key by key and keeps no entry for an empty dict or list, so the
        # tokenizer files it holds are not the files Composer saved (tokenizer.json's empty
        # `special_tokens` is gone): written, they would be wrong bytes.
        notes.append("tokenizer files not written: a DCP checkpoint does not keep them whole (empty entries are "
                     "dropped); give --hf-config a folder holding the config and tokenizer files")
        tokenizer = {}
    for stem, saved in tokenizer.items():
        ext, content = saved.get("file_extension"), saved.get("content")
        if ext == ".json":
            files[f"{stem}.json"] = json.dumps(content, indent=2, ensure_ascii=False).encode()
        elif ext == ".txt":  # Composer kept the lines; it writes each back followed by a newline
            files[f"{stem}.txt"] = "".join(f"{line}\n" for line in content).encode()
        else:
            raise ExportError(f"{COMPOSER_HF}: tokenizer file {stem!r:.40} of unknown kind {ext!r:.20}")
    names = model_leaves(store, subtree, "model.")
    return HFModel(config, None, [HFTensor(n, n) for n in names], files, notes), names


def _from_user(store: Store, subtree: str, hf_config: str | os.PathLike[str], strip_prefix: str | None
               ) -> tuple[HFModel, dict[str, str]]:
    where = Path(hf_config)
    folder = where if where.is_dir() else None
    config_path = where / CONFIG if folder else where
    try:
        files = {CONFIG: config_path.read_bytes()}
    except FileNotFoundError:
        raise ExportError(f"{config_path}: no such file (--hf-config takes a config.json or a folder holding one)") from None
    if folder is not None:  # tokenizer and generation files beside it, copied as they are
        files.update(model_files(folder, but=CONFIG))
    return _from_files(store, subtree, strip_prefix, files, str(config_path))


def _from_files(store: Store, subtree: str, strip_prefix: str | None, files: dict[str, bytes],
                where: str) -> tuple[HFModel, dict[str, str]]:
    """A model described by its Hugging Face files (config.json first), weights named as they are."""
    config = jsonin.loads(files[CONFIG], where, "Hugging Face config", ExportError)
    if not isinstance(config, dict):
        raise ExportError(f"{where}: not a Hugging Face config (a JSON object)")
    rest = {n: data for n, data in files.items() if n != CONFIG and n not in NOT_HF_FILES}
    names = model_leaves(store, subtree, strip_prefix)
    if megatron.is_megatron(list(names)):  # Megatron-Core's names: mapped onto the config's classes
        shapes = {n: s for n, p in names.items() if (s := shape(store, p)) is not None}
        return megatron.plan(config, list(names), shapes, where, rest), names
    return HFModel(config, None, [HFTensor(n, n) for n in names], rest), names


def _experiment_config(store: Store) -> dict[str, Any] | None:
    """OLMo-core's experiment config, when that is what the checkpoint's config.json is."""
    raw = side_config(store, CONFIG)
    try:
        config = jsonin.loads(raw, CONFIG) if raw is not None else None
    except ShardstoreError:
        return None  # not OLMo-core's, whatever it is: the Hugging Face reading of it names what is wrong
    return config if olmo_core.is_experiment_config(config) else None


def _from_olmo_core(store: Store, subtree: str, experiment: dict[str, Any]) -> tuple[HFModel, dict[str, str]]:
    names = model_leaves(store, subtree, None, lambda n: olmo.normalise(n, 1))
    shapes = {n: s for n, p in names.items() if (s := shape(store, p)) is not None}
    return olmo_core.plan(experiment, list(names), shapes), names


def _from_side_files(store: Store, subtree: str, strip_prefix: str | None) -> tuple[HFModel, dict[str, str]]:
    """A checkpoint saved with its model's Hugging Face files beside it (veRL's huggingface/: config,
    generation config, tokenizer), kept in the store as side files."""
    import base64

    side = store.manifest.facts.side_files
    files = {n: base64.b64decode(data) for n, data in side.items() if describes_model(n)}
    return _from_files(store, subtree, strip_prefix, files, f"the checkpoint's {CONFIG}")


def describe(store: Store, subtree: str, hf_config: str | os.PathLike[str] | None, strip_prefix: str | None
             ) -> tuple[HFModel, dict[str, str]]:
    """The Hugging Face model for the store, and its source names -> store paths."""
    if strip_prefix is None and (attribute := module_attribute(store, subtree)):
        model, names = describe(store, subtree, hf_config, attribute)
        model.notes.append(f"the module's attribute {attribute[:-1]!r} taken off every name (the "
                           f"transformers model it holds); --strip-prefix chooses another")
        return model, names
    if hf_config is not None:
        return _from_user(store, subtree, hf_config, strip_prefix)
    meta = _value_at(store, COMPOSER_HF)
    if meta:
        return _from_composer(store, subtree, meta)
    if CONFIG in store.manifest.facts.side_files:
        experiment = _experiment_config(store)
        if experiment is not None:
            return _from_olmo_core(store, subtree, experiment)
        return _from_side_files(store, subtree, strip_prefix)
    nemo = side_config(store, NEMO_MODEL)
    if nemo is not None:  # after the Hugging Face files a trainer keeps beside it (veRL's)
        return _from_yaml(store, subtree, nemo, f"NeMo's context/{NEMO_MODEL}", "config")
    common, bridge = _megatron_common(store), side_config(store, RUN_CONFIG)
    if bridge is not None and store.manifest.facts.megatron_args is None:  # Bridge writes no Megatron-LM args
        return _from_yaml(store, subtree, bridge, f"Megatron-Bridge's {RUN_CONFIG}", "model")
    if common is not None:
        return _from_megatron_args(store, subtree, common)
    return _from_olmo(store, subtree)


def peft_view(store: Store, subtree: str, request: ExportRequest) -> lora.Named:
    """The model's tensors under the names peft gives them: the checkpoint's own (the module attribute a
    Lightning module adds taken off), or a Megatron model's with its adapters mapped onto Hugging Face's."""
    strip = request.strip_prefix if request.strip_prefix is not None else module_attribute(store, subtree)
    names = model_leaves(store, subtree, strip)
    if megatron.is_megatron(list(names)) and megatron_lora.has_adapters(list(names)):
        return lora.Named.of(*describe(store, subtree, request.hf_config, request.strip_prefix))
    return lora.Named({n: HFTensor(n, n) for n in names}, names)


def check_adapter(store: Store, subtree: str, request: ExportRequest) -> None:
    """`lora.check_adapter` from the plan, where the model's names can be known from it: a Megatron model
    described by the values only its data brings (Megatron-LM's args in a torch-format file) is checked
    by the export itself."""
    names = list(model_leaves(store, subtree, request.strip_prefix))
    if request.hf_config is None and in_values(store) and megatron_lora.has_adapters(names):
        return
    lora.check_adapter(store, peft_view(store, subtree, request), request)


def plan_hf(store: Store, subtree: str, request: ExportRequest) -> tuple[HFModel, SafetensorsPlan]:
    if request.adapter:
        return lora.plan_adapter(store, peft_view(store, subtree, request), request)
    if request.base_model is not None:
        model, items = lora.onto_base(store, peft_view(store, subtree, request), request)
        return _described(model, items, request)
    model, names = describe(store, subtree, request.hf_config, request.strip_prefix)
    view = lora.Named.of(model, names)
    peft = adapters.found(view.tensors)
    if peft is None and request.merge_adapter:
        raise ExportError(f"{subtree or 'the checkpoint'}: holds no PEFT (LoRA) adapter (--merge-adapter)")
    if peft is not None:
        if not request.merge_adapter:
            example = view.tensors[peft.loras[0].a if peft.loras else peft.saved[0]].source
            what = (f"holds LoRA adapter weights only (e.g. {example})" if peft.adapter_only else
                    f"holds a LoRA model: its base weights and its adapter (e.g. {example})")
            raise ExportError(f"{subtree or 'the checkpoint'}: {what}, not a model from_pretrained can load; "
                              f"--adapter writes the adapter as peft saves it"
                              f"{'' if peft.adapter_only else ', --merge-adapter the model with it merged'}")
        model, request = lora.merged_model(store, model, view, peft, request)
    items = quantized.dequantize(tensor_items(store, model, names, request), model.config, request.dtype)
    return _described(without_scales(model, items), items, request)


def without_scales(model: HFModel, items: list[Item]) -> HFModel:
    """The model as `items` hold it: where quantized weights were dequantized (export/quantized.py), without
    their scales and its quantization_config (MXFP4's `X_blocks` named `X`)."""
    kept = {it.key for it in items}
    if kept == {t.key for t in model.tensors}:
        return model
    config = None if model.config is None else {k: v for k, v in model.config.items() if k != "quantization_config"}
    tensors = [t if t.key in kept else replace(t, key=t.key.removesuffix(mxfp4.BLOCKS)) for t in model.tensors
               if t.key in kept or t.key.removesuffix(mxfp4.BLOCKS) in kept]
    return replace(model, config=config, tensors=tensors)


def tensor_items(store: Store, model: HFModel, names: dict[str, str], request: ExportRequest) -> list[Item]:
    """The model's tensors as the safetensors writer takes them (and the Megatron writer: export/megatron.py)."""
    items = []
    for t in model.tensors:
        item = stacked_item(store, t.key, [names[s] for s in t.stack], request.cast_of(t.key), t.interleave,
                            t.transpose, request.arrays) if t.stack else \
            tensor_item(store, t.key, names[t.source], request.cast_of(t.key), t.rows, request.arrays)
        if item is None:
            raise ExportError(f"{t.source}: not a tensor")
        items.append(item)
    return items


def merged_weights(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    """`--format safetensors --merge-adapter`: the merged model's weights alone (what the Hugging Face
    folder holds of it), under the model's own names, or a Megatron model's Hugging Face names; only a
    Megatron model needs describing."""
    view = peft_view(store, subtree, request)
    peft = adapters.found(view.tensors)
    if peft is None:
        raise ExportError(f"{subtree or 'the checkpoint'}: holds no PEFT (LoRA) adapter (--merge-adapter)")
    model, request = lora.merged_model(store, HFModel(None, None, list(view.tensors.values())), view, peft, request)
    return planned_safetensors(store, plan_items(tensor_items(store, model, view.paths, request), [], request), model.notes)


def _described(model: HFModel, items: list[Item], request: ExportRequest) -> tuple[HFModel, SafetensorsPlan]:
    """The model's tensors laid out in files, its config naming the dtype they load in."""
    if not items:
        raise ExportError("no tensors to export")
    loads_as = _loads_as(items)
    if loads_as is not None and model.config is not None:
        model.config = _saying_dtype(model.config, loads_as)
    return model, plan_items(items, [], request)


def _loads_as(items: list[Item]) -> str | None:
    """The dtype config.json names: the floating dtype holding most of the output's bytes (the wider on a
    tie). `from_pretrained(dtype="auto")` loads every tensor in the one dtype the config names, so a bf16
    export whose norms --keep-dtype keeps in fp32 loads as bf16, not at twice its size."""
    sizes: dict[str, int] = {}
    for it in items:
        if it.dtype in dtypes.CASTABLE:
            sizes[it.dtype] = sizes.get(it.dtype, 0) + it.nbytes
    return max(sizes, key=lambda d: (sizes[d], dtypes.info(d).itemsize), default=None)


def _saying_dtype(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """`config` with every dtype field saying `dtype`: at the top in the spellings it has (transformers
    >= 4.56 writes `dtype`, older versions `torch_dtype`, which both read: that one where it has none), and
    in its sub-configs where they have one (a multimodal model's text_config and vision_config, as
    transformers 4 wrote them; it loads each part in its own with dtype="auto")."""
    top = [k for k in DTYPE_KEYS if k in config] or ["torch_dtype"]
    return {**_sub_configs_saying(config, dtype), **dict.fromkeys(top, dtype)}


def _sub_configs_saying(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {k: {**_sub_configs_saying(v, dtype), **{d: dtype for d in DTYPE_KEYS if d in v}}
            if isinstance(v, dict) else v for k, v in config.items()}


def planned_files(model: HFModel, plan: SafetensorsPlan) -> list[str]:
    return plan.files + model_file_names(model)


def model_file_names(model: HFModel) -> list[str]:
    """What `write_model_files` writes."""
    return ([CONFIG] if model.config is not None else []) + ([GENERATION] if model.generation else []) + list(model.files)


def export_hf(store: Store, out_dir: Path, model: HFModel, plan: SafetensorsPlan,
              progress: Callable[[int], None] | None = None, partial: dict[str, str] | None = None) -> list[Path]:
    return export_safetensors(store, out_dir, plan, progress, partial) + write_model_files(out_dir, model)


def write_model_files(out_dir: Path, model: HFModel) -> list[Path]:
    """config.json, generation_config.json where known, and the tokenizer files: beside the weights."""
    written = []
    texts = {CONFIG: json.dumps(model.config, indent=2).encode() + b"\n"} if model.config is not None else {}
    if model.generation:
        texts[GENERATION] = json.dumps(model.generation, indent=2).encode() + b"\n"
    for name, data in {**texts, **model.files}.items():
        with OutputFile(out_dir / name) as f:
            f.write(data)
        written.append(out_dir / name)
    return written


@dataclass(frozen=True)
class HFDirect(SafetensorsDirect):
    """The safetensors files in one pass, and the model's config and tokenizer files beside them."""

    model: HFModel

    @property
    def files(self) -> list[str]:
        return planned_files(self.model, self.plan)

    @property
    def notes(self) -> list[str]:
        return self.model.notes

    def finish(self, store: Store, out: Path) -> list[Path]:
        return super().finish(store, out) + write_model_files(out, self.model)


def _plan(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    model, plan = plan_hf(store, subtree, request)

    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        return export_hf(store, out, model, plan, progress, partial), [], model.notes

    return Planned(planned_files(model, plan), plan.nbytes, write, [it for group in plan.groups for it in group])


def _direct(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> DirectExport | None:
    if not tensors_only(store, node) or (request.hf_config is None and in_values(store)):
        return None
    model, plan = plan_hf(store, subtree, request)
    if any(isinstance(it.source, (Stacked, *quantized.COMPUTED)) for group in plan.groups for it in group):
        return None  # one pass places boxes of each array; a stack's moved rows, or values computed from several
        # arrays (dequantized weights), are not: written from the store
    return HFDirect(direct_layout(store, plan), plan, model)


FORMAT = OutputFormat("hf", subtree=True, may_write=FILE_NAMES + r"|config\.json|generation_config\.json"
                      r"|adapter_model\.safetensors|adapter_config\.json",
                      config_beside=False, resume_beside=False, describes_model=True, single_file=False, takes_scheduler=False,
                      plan=_plan, direct=_direct, merged=_plan, writes_adapter=True,
                      recognises=lambda out: (out / CONFIG).is_file() or (out / ADAPTER_CONFIG).is_file())
