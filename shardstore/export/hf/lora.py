"""A PEFT model's adapter as Hugging Face outputs: the folder peft saves (`--adapter`), the model with it
merged (`--merge-adapter`), or an adapter-only checkpoint merged onto a base folder (`--base`).
export/adapters.py finds the adapter by its names and computes the merge."""

from __future__ import annotations

from dataclasses import replace

from ... import dtypes, jsonin
from ...errors import ExportError
from ...hf_files import ADAPTER_CONFIG
from ...store.store import Store
from ...trainers import verl
from .. import adapters
from ..contract import ExportRequest
from ..safetensors import Item, SafetensorsPlan, tensor_item
from .leaves import CONFIG, NOT_HF_FILES, model_leaves, module_attribute, shape, side_config
from .spec import HFModel, HFTensor


def check_adapter(store: Store, subtree: str, request: ExportRequest) -> None:
    """What `--adapter` and `--merge-adapter` are refused for from the store's plan alone (its names and
    shapes), before any rank is ingested: no adapter, an adapter's pair or rank or base wrong, its config
    not known, a merge of an adapter-only save."""
    if request.base_model is not None:
        onto_base(store, subtree, request)
        return
    peft, _, _ = _found_adapter(store, subtree, request)
    if request.merge_adapter and peft.adapter_only:
        raise ExportError(ADAPTER_ONLY)
    if request.merge_adapter:
        peft.merged_names()


ADAPTER_ONLY = ("the checkpoint holds the adapter only (its base was not saved): --merge-adapter --base BASE merges "
                "it onto the base model's Hugging Face folder; --adapter writes it, for peft to load onto the base")


def onto_base(store: Store, subtree: str, request: ExportRequest) -> tuple[HFModel, list[Item]]:
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
        want = (shape(store, names[lora.b]) or (0,))[0], (shape(store, names[lora.a]) or (0, 0))[1]
        have = base.tensors[key].shape if key in base.tensors else None
        if have != want:
            raise ExportError(f"{base.folder}: {key} is {'missing' if have is None else list(have)}, but the adapter "
                              f"of {lora.module} makes {list(want)}: an adapter of another model")
    for key, name in trained.items():
        have = base.tensors[key].shape if key in base.tensors else None
        if have != shape(store, names[name]):
            raise ExportError(f"{base.folder}: {key} is {'missing' if have is None else list(have)}, but the "
                              f"checkpoint's trained {name} is {list(shape(store, names[name]) or ())}")
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
    note = f"merged the {config} into {_modules(peft)} of {base.folder}" + \
        (f"; {len(trained)} trained modules the checkpoint's" if trained else "")
    return HFModel(description, None, [], {n: d for n, d in files.items() if n not in NOT_HF_FILES}, [note]), items


def _found_adapter(store: Store, subtree: str,
                   request: ExportRequest) -> tuple[adapters.Peft, dict[str, str], adapters.LoraConfig]:
    """The model's PEFT adapter, its names (the module attribute a Lightning module adds taken off), and
    its config; refused where it has none."""
    strip_prefix = request.strip_prefix if request.strip_prefix is not None else module_attribute(store, subtree)
    names = model_leaves(store, subtree, strip_prefix)
    adapters.refuse_megatron(names)
    peft = adapters.found(names)
    if peft is None:
        raise ExportError(f"{subtree or 'the checkpoint'}: holds no PEFT (LoRA) adapter "
                          f"({'--adapter' if request.adapter else '--merge-adapter'})")
    return peft, names, _adapter_config(store, peft, names, request)


def plan_adapter(store: Store, subtree: str, request: ExportRequest) -> tuple[HFModel, SafetensorsPlan]:
    """The adapter alone, as peft's `save_pretrained` writes it: adapter_model.safetensors under PEFT's saved
    names, and adapter_config.json (the trainer's own, or one made from the tensors and --lora-alpha)."""
    peft, names, config = _found_adapter(store, subtree, request)
    items = []
    for key, name in peft.adapter_tensors().items():
        item = tensor_item(store, key, names[name], request.cast_of(key))
        if item is None:
            raise ExportError(f"{names[name]}: not a tensor")
        items.append(item)
    notes = [f"the {config} of {_modules(peft)}; its base: {config.fields.get('base_model_name_or_path')}"]
    model = HFModel(None, None, [], {ADAPTER_CONFIG: adapters.config_bytes(config)}, notes)
    return model, SafetensorsPlan([adapters.WEIGHTS], [items], [], request.metadata())


def _modules(peft: adapters.Peft) -> str:
    """The modules adapted, by kind, for saying what was exported or merged: "84 modules (q_proj, v_proj)"."""
    return f"{len(peft.loras)} modules ({', '.join(sorted({lora.module.rsplit('.', 1)[-1] for lora in peft.loras}))})"


def _adapter_config(store: Store, peft: adapters.Peft, names: dict[str, str],
                    request: ExportRequest) -> adapters.LoraConfig:
    """The adapter's config (`adapters.config_of`): the checkpoint's adapter_config.json where its trainer
    kept one, else made from the tensors, its alpha veRL's lora_train_meta.json's or --lora-alpha's, and the
    base model the checkpoint's config.json names."""
    raw_bytes = side_config(store, ADAPTER_CONFIG)
    where = f"the checkpoint's {ADAPTER_CONFIG}"
    raw = jsonin.loads(raw_bytes, where, "PEFT adapter config", ExportError) if raw_bytes is not None else None
    if raw is not None and not isinstance(raw, dict):
        raise ExportError(f"{where}: not a PEFT adapter config (a JSON object)")
    alpha, rslora = request.lora_alpha, request.rslora
    meta = side_config(store, verl.LORA_META)
    if raw is None and meta is not None:  # veRL's LoRA: its rank and alpha, and never rsLoRA
        where = f"the checkpoint's {verl.LORA_META}"
        r, alpha = adapters.from_verl(jsonin.loads(meta, where, "veRL's LoRA record", ExportError), where)
        if request.lora_alpha not in (None, alpha) or request.rslora:
            raise ExportError(f"--lora-alpha or --rslora says otherwise than {where}: lora_alpha {alpha:g}, and veRL "
                              f"trains no rsLoRA")
        rslora = False
        ranks = sorted({(shape(store, names[lora.a]) or (0,))[0] for lora in peft.loras})
        if ranks != [r]:
            raise ExportError(f"{where}: r is {r}, but the adapter's lora_A have {ranks} rows")
    if raw is not None and request.lora_alpha is not None and raw.get("lora_alpha") != request.lora_alpha:
        raise ExportError(f"--lora-alpha {request.lora_alpha:g}, but {where} says {raw.get('lora_alpha')!r}")
    if raw is not None and request.rslora is not None and bool(raw.get("use_rslora")) != request.rslora:
        raise ExportError(f"--{'' if request.rslora else 'no-'}rslora, but {where} says use_rslora "
                          f"{raw.get('use_rslora')!r}")
    wanted = [n for lora in peft.loras for n in (lora.a, lora.b, lora.magnitude, lora.base) if n is not None]
    shapes = {n: s for n in wanted if (s := shape(store, names[n])) is not None}
    missing = next((n for n in wanted if n not in shapes), None)
    if missing is not None:
        raise ExportError(f"{names[missing]}: not a tensor, but PEFT names it one")
    model_config = side_config(store, CONFIG)
    described = jsonin.loads(model_config, CONFIG, "Hugging Face config", ExportError) if model_config else None
    base = described.get("_name_or_path") if isinstance(described, dict) else None
    return adapters.config_of(raw, peft, shapes, alpha, rslora, base if isinstance(base, str) and base else None,
                              where)


def merged_model(store: Store, model: HFModel, names: dict[str, str], peft: adapters.Peft,
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
    merged.notes.append(f"merged the {config} into {_modules(peft)}"
                        + (f"; {len(peft.saved)} trained modules taken whole" if peft.saved else ""))
    paths = {n: names[w] for n, w in plain.items()}
    return merged, paths, replace(request, arrays=adapters.merging(store, peft, config, names))
