"""A PEFT model's adapter as Hugging Face outputs: the folder peft saves (`--adapter`), the model with it
merged (`--merge-adapter`), or an adapter-only checkpoint merged onto a base folder (`--base`).
export/adapters.py finds the adapter by its names and computes the merge; each reads the model's tensors
under the names peft gives them (`Named`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ... import dtypes, jsonin
from ...errors import ExportError
from ...hf_files import ADAPTER_CONFIG
from ...store.store import Store
from ...trainers import verl
from ...trainers.megatron import RUN_CONFIG
from .. import adapters
from ..contract import ExportRequest
from ..resolve import ArrayRef
from ..safetensors import Item, SafetensorsPlan, tensor_item
from .leaves import CONFIG, NOT_HF_FILES, shape, side_config
from . import megatron_lora
from .spec import HFModel, HFTensor


@dataclass(frozen=True)
class Named:
    """A model's tensors under the names peft gives them, each the checkpoint's tensor (or those blocks of
    its rows) it is: the checkpoint's own names, or a Megatron model's mapped onto Hugging Face's with its
    adapters (`megatron_lora`: `megatron`)."""

    tensors: dict[str, HFTensor]
    paths: dict[str, str]  # the checkpoint's names -> store paths
    megatron: bool = False

    @classmethod
    def of(cls, model: HFModel, paths: dict[str, str]) -> Named:
        return cls({t.key: t for t in model.tensors}, paths, megatron_lora.has_adapters(list(paths)))

    def where(self, key: str) -> tuple[str, Any]:
        """The store path and rows `key` is."""
        return self.paths[self.tensors[key].source], self.tensors[key].rows

    def shape(self, store: Store, key: str) -> tuple[int, ...] | None:
        path, rows = self.where(key)
        whole = shape(store, path)
        return whole if whole is None or rows is None else (sum(b - a for a, b in rows),) + tuple(whole[1:])

    def ref(self, store: Store, key: str) -> ArrayRef:
        return adapters.stored(store, *self.where(key))

    def item(self, store: Store, out: str, key: str, cast: str | None) -> Item:
        path, rows = self.where(key)
        item = tensor_item(store, out, path, cast, rows)
        if item is None:
            raise ExportError(f"{self.tensors[key].source}: not a tensor")
        return item


def check_adapter(store: Store, view: Named, request: ExportRequest) -> None:
    """What `--adapter` and `--merge-adapter` are refused for from the store's plan alone (its names and
    shapes), before any rank is ingested: no adapter, an adapter's pair or rank or base wrong, its config
    not known, a merge of an adapter-only save."""
    if request.base_model is not None:
        onto_base(store, view, request)
        return
    peft, _ = _found_adapter(store, view, request)
    if request.merge_adapter and peft.adapter_only:
        raise ExportError(ADAPTER_ONLY)
    if request.merge_adapter:
        peft.merged_names()


ADAPTER_ONLY = ("the checkpoint holds the adapter only (its base was not saved): --merge-adapter --base BASE merges "
                "it onto the base model's Hugging Face folder; --adapter writes it, for peft to load onto the base")


def onto_base(store: Store, view: Named, request: ExportRequest) -> tuple[HFModel, list[Item]]:
    """An adapter-only checkpoint merged onto `--base` (a Hugging Face folder read in place): every tensor
    of the base, in its order, the adapted modules' weights merged, the trained modules' the checkpoint's;
    the base's config and tokenizer files. The adapter must fit the base: every module it adapts or trains
    there, of the shapes it implies."""
    base = request.base_model
    assert base is not None
    peft, config = _found_adapter(store, view, request)
    if not peft.adapter_only:
        raise ExportError(f"--base: the checkpoint holds its own base weights (e.g. "
                          f"{next(lora.base for lora in peft.loras if lora.base)}); merge without --base")
    adapted = {f"{lora.module.removeprefix(adapters.PREFIX)}.weight": lora for lora in peft.loras}
    trained = {adapters.saved_name(n, peft.adapter).removeprefix(adapters.PREFIX): n for n in peft.saved}
    for key, lora in adapted.items():
        want = (view.shape(store, lora.b) or (0,))[0], (view.shape(store, lora.a) or (0, 0))[1]
        have = base.tensors[key].shape if key in base.tensors else None
        if have != want:
            raise ExportError(f"{base.folder}: {key} is {'missing' if have is None else list(have)}, but the adapter "
                              f"of {lora.module} makes {list(want)}: an adapter of another model")
    for key, name in trained.items():
        have = base.tensors[key].shape if key in base.tensors else None
        if have != view.shape(store, name):
            raise ExportError(f"{base.folder}: {key} is {'missing' if have is None else list(have)}, but the "
                              f"checkpoint's trained {name} is {list(view.shape(store, name) or ())}")
    items = []
    for key, tensor in base.tensors.items():
        cast = request.cast_of(key)
        out = cast if cast and tensor.dtype in dtypes.CASTABLE else tensor.dtype
        if key in trained:
            item = view.item(store, key, trained[key], cast)
        elif key in adapted:
            merged = adapters.merged(tensor, out, adapted[key], config, lambda name: view.ref(store, name))
            item = Item(key, merged, out, tensor.shape)
        else:
            item = Item(key, tensor, out, tensor.shape)
        items.append(item)
    files = dict(base.files)
    description = jsonin.loads(files.pop(CONFIG), f"{base.folder}/{CONFIG}", "Hugging Face config", ExportError)
    if not isinstance(description, dict):
        raise ExportError(f"{base.folder}/{CONFIG}: not a Hugging Face config (a JSON object)")
    note = f"merged the {config} into {_modules(peft)} of {base.folder}" + \
        (f"; {len(trained)} trained modules the checkpoint's" if trained else "")
    return HFModel(description, None, [], {n: d for n, d in files.items() if n not in NOT_HF_FILES}, [note]), items


def _found_adapter(store: Store, view: Named, request: ExportRequest) -> tuple[adapters.Peft, adapters.LoraConfig]:
    """The model's PEFT adapter and its config; refused where it has none."""
    peft = adapters.found(view.tensors)
    if peft is None:
        raise ExportError(f"the checkpoint's model holds no PEFT (LoRA) adapter "
                          f"({'--adapter' if request.adapter else '--merge-adapter'})")
    return peft, _adapter_config(store, peft, view, request)


def plan_adapter(store: Store, view: Named, request: ExportRequest) -> tuple[HFModel, SafetensorsPlan]:
    """The adapter alone, as peft's `save_pretrained` writes it: adapter_model.safetensors under PEFT's saved
    names, and adapter_config.json (the trainer's own, or one made from the tensors and --lora-alpha)."""
    peft, config = _found_adapter(store, view, request)
    items = [view.item(store, key, name, request.cast_of(key)) for key, name in peft.adapter_tensors().items()]
    notes = [f"the {config} of {_modules(peft)}; its base: {config.fields.get('base_model_name_or_path')}"]
    model = HFModel(None, None, [], {ADAPTER_CONFIG: adapters.config_bytes(config)}, notes)
    return model, SafetensorsPlan([adapters.WEIGHTS], [items], [], request.metadata())


def _modules(peft: adapters.Peft) -> str:
    """The modules adapted, by kind, for saying what was exported or merged: "84 modules (q_proj, v_proj)"."""
    return f"{len(peft.loras)} modules ({', '.join(sorted({lora.module.rsplit('.', 1)[-1] for lora in peft.loras}))})"


def _adapter_config(store: Store, peft: adapters.Peft, view: Named, request: ExportRequest) -> adapters.LoraConfig:
    """The adapter's config (`adapters.config_of`): the checkpoint's adapter_config.json where its trainer
    kept one, else made from the tensors, its rank and alpha from the trainer's own record of its LoRA
    (`_recorded`) or --lora-alpha, and the base model the checkpoint's config.json names."""
    raw_bytes = side_config(store, ADAPTER_CONFIG)
    where = f"the checkpoint's {ADAPTER_CONFIG}"
    raw = jsonin.loads(raw_bytes, where, "PEFT adapter config", ExportError) if raw_bytes is not None else None
    if raw is not None and not isinstance(raw, dict):
        raise ExportError(f"{where}: not a PEFT adapter config (a JSON object)")
    alpha, rslora = request.lora_alpha, request.rslora
    if view.megatron:  # Megatron's LoRA scales by alpha/r
        if request.rslora:
            raise ExportError("--rslora: Megatron's LoRA (Megatron-Bridge's, NeMo's) scales by alpha/r; it has no "
                              "rsLoRA")
        rslora = False
    recorded = _recorded(store, peft, view) if raw is None else None
    if recorded is not None:
        r, alpha, where = recorded
        if request.lora_alpha not in (None, alpha) or request.rslora:
            raise ExportError(f"--lora-alpha or --rslora says otherwise than {where}: lora_alpha {alpha:g}, and its "
                              f"trainer trains no rsLoRA")
        rslora = False
        ranks = sorted({(view.shape(store, lora.a) or (0,))[0] for lora in peft.loras})
        if ranks != [r]:
            raise ExportError(f"{where}: r is {r}, but the adapter's lora_A have {ranks} rows")
    if raw is not None and request.lora_alpha is not None and raw.get("lora_alpha") != request.lora_alpha:
        raise ExportError(f"--lora-alpha {request.lora_alpha:g}, but {where} says {raw.get('lora_alpha')!r}")
    if raw is not None and request.rslora is not None and bool(raw.get("use_rslora")) != request.rslora:
        raise ExportError(f"--{'' if request.rslora else 'no-'}rslora, but {where} says use_rslora "
                          f"{raw.get('use_rslora')!r}")
    wanted = [n for lora in peft.loras for n in (lora.a, lora.b, lora.magnitude, lora.base) if n is not None]
    shapes = {n: s for n in wanted if (s := view.shape(store, n)) is not None}
    missing = next((n for n in wanted if n not in shapes), None)
    if missing is not None:
        raise ExportError(f"{view.tensors[missing].source}: not a tensor, but PEFT names it one")
    model_config = side_config(store, CONFIG)
    described = jsonin.loads(model_config, CONFIG, "Hugging Face config", ExportError) if model_config else None
    base = described.get("_name_or_path") if isinstance(described, dict) else None
    return adapters.config_of(raw, peft, shapes, alpha, rslora, base if isinstance(base, str) and base else None,
                              where)


def _recorded(store: Store, peft: adapters.Peft, view: Named) -> tuple[int, float, str] | None:
    """The rank and alpha of the checkpoint's LoRA as its trainer recorded them where it keeps no
    adapter_config.json (veRL's lora_train_meta.json, Megatron-Bridge's run_config.yaml), and where;
    Bridge's target_modules must name every module adapted."""
    meta = side_config(store, verl.LORA_META)
    if meta is not None:  # veRL builds its LoraConfig from these alone: no rsLoRA, no DoRA, no bias
        where = f"the checkpoint's {verl.LORA_META}"
        return *adapters.from_verl(jsonin.loads(meta, where, "veRL's LoRA record", ExportError), where), where
    run_config = side_config(store, RUN_CONFIG) if view.megatron else None
    run = megatron_lora.run_lora(run_config, f"the checkpoint's {RUN_CONFIG}") if run_config is not None else None
    if run is None:
        return None
    where = f"the checkpoint's {RUN_CONFIG}"
    for lora in peft.loras:
        module = megatron_lora.module_of(view.tensors[lora.a].source)
        if not run.targets_module(module):
            raise ExportError(f"{where}: its target_modules ({', '.join(run.targets)[:80]}) do not name {module}, "
                              f"which the checkpoint adapts: the config of another run")
    return run.r, run.alpha, where


def merged_model(store: Store, model: HFModel, view: Named, peft: adapters.Peft,
                 request: ExportRequest) -> tuple[HFModel, ExportRequest]:
    """The model with its adapter merged: its plain names (`Peft.merged_names`), and the request reading each
    adapted module's base weight merged (`adapters.merging`)."""
    if request.arrays is not None:
        raise ExportError("an adapter is merged into one checkpoint's weights, not into an average's")
    if peft.adapter_only:
        raise ExportError(ADAPTER_ONLY)
    config = _adapter_config(store, peft, view, request)
    plain = peft.merged_names()
    merged = HFModel(model.config, model.generation, [replace(view.tensors[k], key=n) for n, k in plain.items()],
                     model.files, list(model.notes))
    merged.notes.append(f"merged the {config} into {_modules(peft)}"
                        + (f"; {len(peft.saved)} trained modules taken whole" if peft.saved else ""))
    return merged, replace(request, arrays=adapters.merging(peft, config, view.where,
                                                             lambda key: view.ref(store, key)))
