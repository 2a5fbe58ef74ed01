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
from ...trainers import verl
from ...trainers.registry import trainer
from ...tree import Node, node_at
from ..contract import DirectExport, ExportRequest, OutputFormat, Planned, Progress, Written
from ..resolve import build, leaves, model_node, tensors_only
from ..safetensors import (FILE_NAMES, Item, SafetensorsDirect, SafetensorsPlan, Stacked, direct_layout,
                           export_safetensors, plan_items, stacked_item, tensor_item)
from .. import adapters
from . import megatron, olmo, olmo_core
from .megatron_llama import EMBEDDING
from .spec import HFModel, HFTensor

CONFIG, GENERATION = "config.json", "generation_config.json"
NEMO_MODEL = "model.yaml"  # NeMo's context/model.yaml, which its reader keeps as a side file
COMPOSER_HF = "state/integrations/huggingface"
MAX_CONFIG_FILE = 64 << 20  # tokenizer.json of large vocabularies is tens of MB
DTYPE_KEYS = ("dtype", "torch_dtype")  # a config's dtype, as transformers >= 4.56 and before spell it


NO_HF_DESCRIPTION = ("cannot tell which Hugging Face model this is: the checkpoint has no config.yaml (OLMo), no "
                     "Hugging Face config.json beside it (or in its run folder) and none inside (Composer); give "
                     "--hf-config PATH")


def in_values(store: Store) -> bool:
    """Whether the model is described by values the store holds (Composer's Hugging Face metadata,
    Megatron-LM's common state where the plan did not read its args), which only the data brings."""
    return _holder(store, COMPOSER_HF) is not None \
        or (_megatron_common(store) is not None and store.manifest.facts.megatron_args is None)


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


def _from_nemo(store: Store, subtree: str, raw: bytes) -> tuple[HFModel, dict[str, str]]:
    names = _model_leaves(store, subtree, None)
    rows = _shape(store, names[EMBEDDING]) if EMBEDDING in names else None
    where = f"NeMo's context/{NEMO_MODEL}"
    return _megatron_from(store, subtree, megatron.args_from_nemo(raw, rows[0] if rows else None, where), where)


def _megatron_from(store: Store, subtree: str, args: dict[str, Any], where: str) -> tuple[HFModel, dict[str, str]]:
    """A Megatron GPT model described by Megatron-LM's arguments."""
    config, notes = megatron.config_from_args(args, where)
    names = _model_leaves(store, subtree, None)
    shapes = {n: s for n, p in names.items() if (s := _shape(store, p)) is not None}
    model = megatron.plan(config, list(names), shapes, where, {})
    model.notes += notes
    return model, names


def has_hf_description(store: Store) -> bool:
    """Whether the checkpoint may describe its model itself, from its plan alone (no rank need be in):
    the run's config.yaml, Composer's Hugging Face metadata, or Megatron-LM's common state."""
    side = store.manifest.facts.side_files
    return in_values(store) or "config.yaml" in side or CONFIG in side or NEMO_MODEL in side \
        or store.manifest.facts.megatron_args is not None


def _side_config(store: Store, name: str) -> bytes | None:
    import base64

    data = store.manifest.facts.side_files.get(name)
    return None if data is None else base64.b64decode(data)


def _model_leaves(store: Store, subtree: str, strip_prefix: str | None,
                  rename: Callable[[str], str] = lambda n: n) -> dict[str, str]:
    """Output-ready name -> store path for every leaf of the model subtree."""
    out: dict[str, str] = {}
    for keys, path in leaves(model_node(store.manifest.tree, subtree)):
        name = ".".join(str(k) for k in keys)
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix):]
        name = rename(name)
        if name in out:
            raise ExportError(f"two tensors would both be named {name!r}")
        out[name] = path
    return out


def _shape(store: Store, path: str) -> tuple[int, ...] | None:
    entry = store.manifest.arrays.get(path)
    if entry is not None:
        return entry.shape
    if path in store.manifest.facts.not_tensors:
        return None
    value = build(store, _leaf(path))
    return tuple(value.shape) if hasattr(value, "shape") else None


def _leaf(path: str) -> Node:
    return Node("leaf", path)


def _from_olmo(store: Store, subtree: str) -> tuple[HFModel, dict[str, str]]:
    import yaml

    raw = _side_config(store, "config.yaml")
    if raw is None:
        raise ExportError(NO_HF_DESCRIPTION)
    try:
        cfg = (yaml.safe_load(raw) or {}).get("model")
    except (yaml.YAMLError, AttributeError) as exc:
        raise ExportError(f"config.yaml: unreadable ({str(exc).splitlines()[0][:100]})") from None
    if not isinstance(cfg, dict):
        raise ExportError("config.yaml: no `model` section; not an OLMo training config")
    group = int(cfg.get("block_group_size") or 1)
    names = _model_leaves(store, subtree, None, lambda n: olmo.normalise(n, group))
    shapes = {n: s for n, p in names.items() if (s := _shape(store, p)) is not None}
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
    names = _model_leaves(store, subtree, "model.")
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
        for p in sorted(folder.iterdir()):
            if p.is_file() and p.name != CONFIG and describes_model(p.name):
                if p.stat().st_size > MAX_CONFIG_FILE:
                    raise ExportError(f"{p}: {p.stat().st_size} bytes; not a tokenizer or config file")
                files[p.name] = p.read_bytes()
    return _from_files(store, subtree, strip_prefix, files, str(config_path))


# The trainers' own files beside a model's (kept beside other exports, not in a Hugging Face folder).
NOT_HF_FILES = ("fsdp_config.json", "config.yaml")


def _from_files(store: Store, subtree: str, strip_prefix: str | None, files: dict[str, bytes],
                where: str) -> tuple[HFModel, dict[str, str]]:
    """A model described by its Hugging Face files (config.json first), weights named as they are."""
    config = jsonin.loads(files[CONFIG], where, "Hugging Face config", ExportError)
    if not isinstance(config, dict):
        raise ExportError(f"{where}: not a Hugging Face config (a JSON object)")
    rest = {n: data for n, data in files.items() if n != CONFIG and n not in NOT_HF_FILES}
    names = _model_leaves(store, subtree, strip_prefix)
    if megatron.is_megatron(list(names)):  # Megatron-Core's names: mapped onto the config's classes
        shapes = {n: s for n, p in names.items() if (s := _shape(store, p)) is not None}
        return megatron.plan(config, list(names), shapes, where, rest), names
    return HFModel(config, None, [HFTensor(n, n) for n in names], rest), names


def _experiment_config(store: Store) -> dict[str, Any] | None:
    """OLMo-core's experiment config, when that is what the checkpoint's config.json is."""
    raw = _side_config(store, CONFIG)
    try:
        config = jsonin.loads(raw, CONFIG) if raw is not None else None
    except ShardstoreError:
        return None  # not OLMo-core's, whatever it is: the Hugging Face reading of it names what is wrong
    return config if olmo_core.is_experiment_config(config) else None


def _from_olmo_core(store: Store, subtree: str, experiment: dict[str, Any]) -> tuple[HFModel, dict[str, str]]:
    names = _model_leaves(store, subtree, None, lambda n: olmo.normalise(n, 1))
    shapes = {n: s for n, p in names.items() if (s := _shape(store, p)) is not None}
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
    if strip_prefix is None and trainer(store.manifest.layout).module_prefix:
        strip_prefix = _module_attribute(store, subtree)
        if strip_prefix:
            model, names = describe(store, subtree, hf_config, strip_prefix)
            model.notes.append(f"the module's attribute {strip_prefix[:-1]!r} taken off every name (the "
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
    nemo = _side_config(store, NEMO_MODEL)
    if nemo is not None:  # after the Hugging Face files a trainer keeps beside it (veRL's)
        return _from_nemo(store, subtree, nemo)
    common = _megatron_common(store)
    if common is not None:
        return _from_megatron_args(store, subtree, common)
    return _from_olmo(store, subtree)


def _module_attribute(store: Store, subtree: str) -> str | None:
    """`model.` when every name of the model starts so, in a checkpoint of a trainer whose module holds
    the transformers model as an attribute (a LightningModule's `self.model = AutoModelForCausalLM...`)."""
    names = list(_model_leaves(store, subtree, None))
    firsts = {name.split(".", 1)[0] for name in names}
    return f"{firsts.pop()}." if len(firsts) == 1 and all("." in n for n in names) else None


def plan_hf(store: Store, subtree: str, request: ExportRequest) -> tuple[HFModel, SafetensorsPlan]:
    if request.adapter:
        return _plan_adapter(store, subtree, request)
    if request.base_model is not None:
        model, items = _onto_base(store, subtree, request)
        return _described(model, items, request)
    model, names = describe(store, subtree, request.hf_config, request.strip_prefix)
    peft = adapters.found(names)
    if peft is None and request.merge_adapter:
        raise ExportError(f"{subtree or 'the checkpoint'}: holds no PEFT (LoRA) adapter (--merge-adapter)")
    if peft is not None:
        if not request.merge_adapter:
            example = peft.loras[0].a if peft.loras else peft.saved[0]
            what = (f"holds LoRA adapter weights only (e.g. {example})" if peft.adapter_only else
                    f"holds a PEFT (LoRA) model: the base weights under PEFT's names, and its adapter (e.g. {example})")
            raise ExportError(f"{subtree or 'the checkpoint'}: {what}, not a model from_pretrained can load; "
                              f"--adapter writes the adapter as peft saves it"
                              f"{'' if peft.adapter_only else ', --merge-adapter the model with it merged'}")
        model, names, request = _merged(store, model, names, peft, request)
    items = []
    for t in model.tensors:
        item = stacked_item(store, t.key, [names[s] for s in t.stack], request.cast_of(t.key), t.interleave,
                            t.transpose, request.arrays) if t.stack else \
            tensor_item(store, t.key, names[t.source], request.cast_of(t.key), t.rows, request.arrays)
        if item is None:
            raise ExportError(f"{t.source}: not a tensor")
        items.append(item)
    return _described(model, items, request)


def _described(model: HFModel, items: list[Item], request: ExportRequest) -> tuple[HFModel, SafetensorsPlan]:
    """The model's tensors laid out in files, its config naming the dtype they load in."""
    if not items:
        raise ExportError("no tensors to export")
    loads_as = _loads_as(items)
    if loads_as is not None and model.config is not None:
        model.config = _saying_dtype(model.config, loads_as)
    return model, plan_items(items, [], request)


def check_adapter(store: Store, subtree: str, request: ExportRequest) -> None:
    """What `--adapter` and `--merge-adapter` are refused for from the store's plan alone (its names and
    shapes), before any rank is ingested: no adapter, an adapter's pair or rank or base wrong, its config
    not known, a merge of an adapter-only save."""
    if request.base_model is not None:
        _onto_base(store, subtree, request)
        return
    peft, _, _ = _found_adapter(store, subtree, request)
    if request.merge_adapter and peft.adapter_only:
        raise ExportError(ADAPTER_ONLY)
    if request.merge_adapter:
        peft.merged_names()


ADAPTER_ONLY = ("the checkpoint holds the adapter only (its base was not saved): --merge-adapter --base BASE merges "
                "it onto the base model's Hugging Face folder; --adapter writes it, for peft to load onto the base")


def _onto_base(store: Store, subtree: str, request: ExportRequest) -> tuple[HFModel, list[Item]]:
    """An adapter-only checkpoint merged onto `--base` (a Hugging Face folder read in place): every tensor
    of the base, in its order, the adapted modules' weights merged, the trained modules' the checkpoint's;
    the base's config and tokenizer files. The adapter must fit the base: every module it adapts or trains
    there, of the shapes it implies."""
    base = request.base_model
    assert base is not None
    peft, names, config = _found_adapter(store, subtree, request)
    if not peft.adapter_only:
        raise ExportError(f"--base: the checkpoint holds its own base weights (e.g. "
                          f"{next(lora.base for lora in peft.loras if lora.base)}); merge without --base")
    adapted = {f"{lora.module.removeprefix(adapters.PREFIX)}.weight": lora for lora in peft.loras}
    trained = {adapters.saved_name(n, peft.adapter).removeprefix(adapters.PREFIX): n for n in peft.saved}
    for key, lora in adapted.items():
        want = (_shape(store, names[lora.b]) or (0,))[0], (_shape(store, names[lora.a]) or (0, 0))[1]
        have = base.tensors[key].shape if key in base.tensors else None
        if have != want:
            raise ExportError(f"{base.folder}: {key} is {'missing' if have is None else list(have)}, but the adapter "
                              f"of {lora.module} makes {list(want)}: an adapter of another model")
    for key, name in trained.items():
        have = base.tensors[key].shape if key in base.tensors else None
        if have != _shape(store, names[name]):
            raise ExportError(f"{base.folder}: {key} is {'missing' if have is None else list(have)}, but the "
                              f"checkpoint's trained {name} is {list(_shape(store, names[name]) or ())}")
    items = []
    for key, tensor in base.tensors.items():
        cast = request.cast_of(key)
        out = cast if cast and tensor.dtype in dtypes.CASTABLE else tensor.dtype
        if key in trained:
            item = tensor_item(store, key, names[trained[key]], cast)
        elif key in adapted:
            merged = adapters.merged(tensor, out, adapted[key], config,
                                     lambda name: adapters.stored(store, names[name]))
            item = Item(key, merged, out, tensor.shape)
        else:
            item = Item(key, tensor, out, tensor.shape)
        if item is None:
            raise ExportError(f"{names[trained[key]]}: not a tensor")
        items.append(item)
    files = dict(base.files)
    description = jsonin.loads(files.pop(CONFIG), f"{base.folder}/{CONFIG}", "Hugging Face config", ExportError)
    if not isinstance(description, dict):
        raise ExportError(f"{base.folder}/{CONFIG}: not a Hugging Face config (a JSON object)")
    note = (f"merged the {'DoRA' if config.dora else 'LoRA'} adapter (r={config.r}, alpha={config.alpha:g}"
            f"{', rsLoRA' if config.rslora else ''}) into {len(adapted)} modules ({', '.join(_kinds(peft))}) of "
            f"{base.folder}" + (f"; {len(trained)} trained modules the checkpoint's" if trained else ""))
    return HFModel(description, None, [], {n: d for n, d in files.items() if n not in NOT_HF_FILES}, [note]), items


def _found_adapter(store: Store, subtree: str,
                   request: ExportRequest) -> tuple[adapters.Peft, dict[str, str], adapters.LoraConfig]:
    """The model's PEFT adapter, its names (the module attribute a Lightning module adds taken off), and
    its config; refused where it has none."""
    strip_prefix = request.strip_prefix
    if strip_prefix is None and trainer(store.manifest.layout).module_prefix:
        strip_prefix = _module_attribute(store, subtree)
    names = _model_leaves(store, subtree, strip_prefix)
    peft = adapters.found(names)
    if peft is None:
        raise ExportError(f"{subtree or 'the checkpoint'}: holds no PEFT (LoRA) adapter "
                          f"({'--adapter' if request.adapter else '--merge-adapter'})")
    return peft, names, _adapter_config(store, peft, names, request)


def _plan_adapter(store: Store, subtree: str, request: ExportRequest) -> tuple[HFModel, SafetensorsPlan]:
    """The adapter alone, as peft's `save_pretrained` writes it: adapter_model.safetensors under PEFT's saved
    names, and adapter_config.json (the trainer's own, or one made from the tensors and --lora-alpha)."""
    peft, names, config = _found_adapter(store, subtree, request)
    items = []
    for key, name in peft.adapter_tensors().items():
        item = tensor_item(store, key, names[name], request.cast_of(key))
        if item is None:
            raise ExportError(f"{names[name]}: not a tensor")
        items.append(item)
    notes = [f"the {'DoRA' if config.dora else 'LoRA'} adapter of {len(peft.loras)} modules "
             f"({', '.join(_kinds(peft))}), r={config.r}, alpha={config.alpha:g}"
             f"{', rsLoRA' if config.rslora else ''}; its base: {config.fields.get('base_model_name_or_path')}"]
    model = HFModel(None, None, [], {ADAPTER_CONFIG: adapters.config_bytes(config)}, notes)
    return model, SafetensorsPlan([adapters.WEIGHTS], [items], [], request.metadata())


def _kinds(peft: adapters.Peft) -> list[str]:
    """The kinds of module adapted (q_proj, v_proj, ...), for saying what was exported or merged."""
    return sorted({lora.module.rsplit(".", 1)[-1] for lora in peft.loras})


def _adapter_config(store: Store, peft: adapters.Peft, names: dict[str, str],
                    request: ExportRequest) -> adapters.LoraConfig:
    """The adapter's config (`adapters.config_of`): the checkpoint's adapter_config.json where its trainer
    kept one, else made from the tensors, its alpha veRL's lora_train_meta.json's or --lora-alpha's, and the
    base model the checkpoint's config.json names."""
    raw_bytes = _side_config(store, ADAPTER_CONFIG)
    where = f"the checkpoint's {ADAPTER_CONFIG}"
    raw = jsonin.loads(raw_bytes, where, "PEFT adapter config", ExportError) if raw_bytes is not None else None
    if raw is not None and not isinstance(raw, dict):
        raise ExportError(f"{where}: not a PEFT adapter config (a JSON object)")
    alpha, rslora = request.lora_alpha, request.rslora
    meta = _side_config(store, verl.LORA_META)
    if raw is None and meta is not None:  # veRL's LoRA: its rank and alpha, and never rsLoRA
        where = f"the checkpoint's {verl.LORA_META}"
        r, alpha = adapters.from_verl(jsonin.loads(meta, where, "veRL's LoRA record", ExportError), where)
        if request.lora_alpha not in (None, alpha) or request.rslora:
            raise ExportError(f"--lora-alpha or --rslora says otherwise than {where}: lora_alpha {alpha:g}, and veRL "
                              f"trains no rsLoRA")
        rslora = False
        ranks = sorted({(_shape(store, names[lora.a]) or (0,))[0] for lora in peft.loras})
        if ranks != [r]:
            raise ExportError(f"{where}: r is {r}, but the adapter's lora_A have {ranks} rows")
    if raw is not None and request.lora_alpha is not None and raw.get("lora_alpha") != request.lora_alpha:
        raise ExportError(f"--lora-alpha {request.lora_alpha:g}, but {where} says {raw.get('lora_alpha')!r}")
    if raw is not None and request.rslora is not None and bool(raw.get("use_rslora")) != request.rslora:
        raise ExportError(f"--{'' if request.rslora else 'no-'}rslora, but {where} says use_rslora "
                          f"{raw.get('use_rslora')!r}")
    wanted = [n for lora in peft.loras for n in (lora.a, lora.b, lora.magnitude, lora.base) if n is not None]
    shapes = {n: s for n in wanted if (s := _shape(store, names[n])) is not None}
    missing = next((n for n in wanted if n not in shapes), None)
    if missing is not None:
        raise ExportError(f"{names[missing]}: not a tensor, but PEFT names it one")
    model_config = _side_config(store, CONFIG)
    described = jsonin.loads(model_config, CONFIG, "Hugging Face config", ExportError) if model_config else None
    base = described.get("_name_or_path") if isinstance(described, dict) else None
    return adapters.config_of(raw, peft, shapes, alpha, rslora, base if isinstance(base, str) and base else None,
                              where)


def _merged(store: Store, model: HFModel, names: dict[str, str], peft: adapters.Peft,
            request: ExportRequest) -> tuple[HFModel, dict[str, str], ExportRequest]:
    """The model with its adapter merged: its plain names (`Peft.merged_names`), and the request reading each
    adapted module's base weight merged (`adapters.merging`)."""
    if any(t.key != t.source or t.rows or t.stack for t in model.tensors) or request.arrays is not None:
        raise ExportError("this model's names are mapped onto Hugging Face's: merging its adapter is not read yet")
    if peft.adapter_only:
        raise ExportError(ADAPTER_ONLY)
    config = _adapter_config(store, peft, names, request)
    plain = peft.merged_names()
    merged = HFModel(model.config, model.generation, [HFTensor(n, n) for n in plain], model.files, list(model.notes))
    merged.notes.append(f"merged the {'DoRA' if config.dora else 'LoRA'} adapter (r={config.r}, alpha={config.alpha:g}"
                        f"{', rsLoRA' if config.rslora else ''}) into {len(peft.loras)} modules ({', '.join(_kinds(peft))})"
                        + (f"; {len(peft.saved)} trained modules taken whole" if peft.saved else ""))
    paths = {n: names[w] for n, w in plain.items()}
    return merged, paths, replace(request, arrays=adapters.merging(store, peft, config, names))


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
    return plan.files + ([CONFIG] if model.config is not None else []) + ([GENERATION] if model.generation else []) \
        + list(model.files)


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
    if not tensors_only(store, node) or (request.hf_config is None and in_values(store)) or request.merge_adapter:
        return None  # (a merged weight is computed from the store)
    model, plan = plan_hf(store, subtree, request)
    if any(isinstance(it.source, Stacked) for group in plan.groups for it in group):
        return None  # one pass places boxes of each array; a stack's moved rows are not: written from the store
    return HFDirect(direct_layout(store, plan), plan, model)


FORMAT = OutputFormat("hf", subtree=True, may_write=FILE_NAMES + r"|config\.json|generation_config\.json"
                      r"|adapter_model\.safetensors|adapter_config\.json",
                      config_beside=False, resume_beside=False, describes_model=True, single_file=False, takes_scheduler=False,
                      plan=_plan, direct=_direct,
                      recognises=lambda out: (out / CONFIG).is_file() or (out / ADAPTER_CONFIG).is_file())
