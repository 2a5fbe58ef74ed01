"""`--format nemo`: a Hugging Face model (or any checkpoint `--format hf` maps onto one) as the NeMo 2
checkpoint `llm.import_ckpt` makes of it, which NeMo's fine-tuning restores (`AutoResume(restore_config=
RestoreConfig(path=OUT))`) and `nemo.lightning.io.load_context(OUT)` reads:

    OUT/context/io.json            the TrainerContext as fiddle serializes it: the model's NeMo class, its
                                   config (from config.json), its tokenizer (context/nemo_tokenizer)
    OUT/context/model.yaml         the same model as YAML (NeMo's exporters read it; so does shardstore)
    OUT/context/nemo_tokenizer/    the tokenizer's files, as they are
    OUT/weights/common.pt          the common state NeMo's megatron-core (<= 0.18) reads, and metadata.json
    OUT/weights/__{i}_0.distcp     the tensors: `--format megatron`'s, each key under `module.`
    OUT/weights/.metadata          written last: the folder is a checkpoint only once whole

The tensors are written as `--format megatron` writes them (export/megatron.py: one pass, each chunk a run
of one source tensor's rows, under the Transformer Engine spec's names NeMo's models use), under NeMo's
`module.` prefix, the vocabulary unpadded as NeMo's importers leave it (its models take the config's
vocab_size as it is; `--vocab-multiple` pads it, and NeMo's load then cuts the rows); the common state is
in `common.pt` (megatron-core before 0.19 reads nothing else) rather than as an item. NeMo's model classes
exist for Llama (Llama 3's scaled rotary embeddings as Llama31Config), Qwen2, Qwen3, Mixtral and Qwen3-MoE
(Megatron's top-k router, as `--format megatron` writes them); any other architecture (Qwen2-MoE's gated
shared expert, DeepSeek-V3's latent attention) is refused by name (`--format megatron` writes its weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import tempfiles
from ..errors import ExportError
from ..sink.output import OutputFile
from ..store.store import Store
from ..trainers import nemo
from ..tree import Node
from . import chunks, dcp, fiddle_json, megatron
from .contract import ExportRequest, OutputFormat, Planned, Progress, Written
from .fiddle_json import Config, PyRef
from .hf.megatron_inverse import architecture
from .hf.megatron import CONFIG_ARGS
from .hf.megatron_llama import MOE, QWEN3, QWEN3_MOE, need, number
from .hf.spec import HFModel
from .torch import write_zip

_LLM = "nemo.collections.llm.gpt.model"
# the NeMo model and config classes of each transformers architecture (what NeMo's HF importers build)
CLASSES = {"LlamaForCausalLM": (f"{_LLM}.llama", "LlamaModel", "LlamaConfig"),
           "Qwen2ForCausalLM": (f"{_LLM}.qwen2", "Qwen2Model", "Qwen2Config"),
           QWEN3: (f"{_LLM}.qwen3", "Qwen3Model", "Qwen3Config"),
           MOE: (f"{_LLM}.mixtral", "MixtralModel", "MixtralConfig"),
           QWEN3_MOE: (f"{_LLM}.qwen3", "Qwen3Model", "Qwen3MoEConfig")}
TOKENIZER = PyRef("nemo.collections.common.tokenizers.huggingface.auto_tokenizer", "AutoTokenizer")
TRAINER_CONTEXT = PyRef("nemo.lightning.io.pl", "TrainerContext")
TRAINER = PyRef("nemo.lightning.pytorch.trainer", "Trainer")
STRATEGY = PyRef("nemo.lightning.pytorch.strategies.megatron_strategy", "MegatronStrategy")
# megatron-core <= 0.18's metadata.json: its common state in common.pt, torch.save'd
BACKEND = {**megatron.BACKEND, "common_backend": "torch", "common_backend_version": 1}
COMMON = "common.pt"
# what NeMo keeps in common.pt beside the weights (its Lightning checkpoint without the state dict); an
# empty content_metadata: no distributed optimizer's state
COMMON_STATE = {"epoch": 0, "global_step": 0, "state_dict": {}, "content_metadata": {}}
# the Llama 3 rotary scaling fields NeMo's Llama31Config takes, from transformers' rope_scaling
LLAMA31 = {"factor": "scale_factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
           "original_max_position_embeddings": "old_context_len"}


def model_config(config: dict[str, Any], multiple: int | None) -> tuple[PyRef, PyRef, dict[str, Any]]:
    """The NeMo model class, its config class and that config's fields, for the model config.json
    describes: Megatron-LM's arguments for it (`megatron_args`, which refuses what they cannot say) under
    Megatron-Core's TransformerConfig names (`CONFIG_ARGS`, the map shardstore reads a NeMo model.yaml
    with), and what NeMo's own importer (`HFLlamaImporter.config` and its siblings) adds; the fields its
    classes default (norm, activation, biases) stated, so that model.yaml says the model alone."""
    where = "the model's config.json"
    arch = architecture(config, where)
    if arch not in CLASSES:
        raise ExportError(f"{where}: {arch} has no NeMo 2 model class written here (one of "
                          f"{', '.join(CLASSES)}); --format megatron writes its weights")
    module, model_class, config_class = CLASSES[arch]
    vocab = need(config, "vocab_size", where)
    args = vars(megatron.megatron_args(config, vocab, multiple or 1))
    fields: dict[str, Any] = {name: args[arg] for name, arg in CONFIG_ARGS.items() if args.get(arg) is not None}
    fields.update({"activation_func": PyRef("torch.nn.functional", "silu"), "gated_linear_unit": args["swiglu"],
                   "init_method_std": number(config, "initializer_range", 0.02, where),
                   "share_embeddings_and_output_weights": not args["untie_embeddings_and_output_weights"],
                   "vocab_size": vocab, "make_vocab_size_divisible_by": multiple or divisible_by(vocab),
                   "fp16": args["fp16"], "bf16": args["bf16"], "params_dtype": PyRef("torch", str(args["params_dtype"]))})
    if "num_moe_experts" in fields:  # Megatron's top-k router, softmax over the chosen (NeMo's default too)
        fields.setdefault("moe_router_pre_softmax", False)
    scaling = megatron.rope_scaling(config)
    if scaling is not None:  # Llama 3's (megatron_args refused any other)
        config_class = "Llama31Config"
        fields.update({name: scaling[key] for key, name in LLAMA31.items() if key in scaling})
    return PyRef(module, model_class), PyRef(module, config_class), fields


def divisible_by(vocab: int) -> int:
    """What NeMo's Llama importer gives make_vocab_size_divisible_by: the largest power of two up to 128
    that divides the vocabulary (which NeMo then does not pad: its vocab_size is given)."""
    base = 128
    while vocab % base:
        base //= 2
    return base


def context_files(model: HFModel, multiple: int | None) -> tuple[dict[str, bytes], list[str]]:
    """context/'s files by their path in OUT, and what is said of them."""
    assert model.config is not None
    model_class, config_class, fields = model_config(model.config, multiple)
    tokenizer = {f"{nemo.CONTEXT}/{nemo.TOKENIZER}/{name}": data for name, data in model.files.items()}
    notes = [] if tokenizer else [f"the checkpoint holds no tokenizer files: {nemo.CONTEXT}/{nemo.IO} names no "
                                  f"tokenizer (give the recipe's)"]
    arguments: dict[str, Any] = {"config": Config(config_class, fields)}
    if tokenizer:
        arguments["tokenizer"] = Config(TOKENIZER, {"pretrained_model_name": nemo.TOKENIZER})
    root = Config(TRAINER_CONTEXT, {"model": Config(model_class, arguments),
                                    "trainer": Config(TRAINER, {"strategy": Config(STRATEGY)}), "extra": {}})
    files = {f"{nemo.CONTEXT}/{nemo.IO}": json.dumps(fiddle_json.dumps(root)).encode(),
             f"{nemo.CONTEXT}/{nemo.MODEL}": _yaml(model_class, config_class, fields, bool(tokenizer)).encode(),
             **tokenizer}
    return files, notes


def _yaml(model_class: PyRef, config_class: PyRef, fields: dict[str, Any], tokenizer: bool) -> str:
    """model.yaml as NeMo writes it (nemo_run's YAML of the model: `_target_`s, a callable as `_call_:
    false`), its fields in order."""
    lines = [f"_target_: {model_class.module}.{model_class.name}", "config:",
             f"  _target_: {config_class.module}.{config_class.name}"]
    for key, value in fields.items():
        if isinstance(value, PyRef):
            lines += [f"  {key}:", "    _call_: false", f"    _target_: {value.module}.{value.name}"]
        else:
            lines.append(f"  {key}: {_scalar(value)}")
    lines += ["model_transform: null", "optim: null"]
    lines += ["tokenizer:", f"  _target_: {TOKENIZER.module}.{TOKENIZER.name}",
              f"  pretrained_model_name: {nemo.TOKENIZER}"] if tokenizer else ["tokenizer: null"]
    return "\n".join(lines) + "\n"


def _scalar(value: Any) -> str:
    """A YAML scalar that YAML 1.1 readers (PyYAML) read back as the same value: a float always with its
    point (`1e-05` is a string there)."""
    if isinstance(value, float):
        text = repr(value)
        mantissa, _, exponent = text.partition("e")
        return f"{mantissa if '.' in mantissa else mantissa + '.0'}{'e' + exponent if exponent else ''}"
    return json.dumps(value)


def plan_items(store: Store, subtree: str, request: ExportRequest
               ) -> tuple[HFModel, list[dcp.Item], dict[str, Any], dict[str, bytes]]:
    """`--format megatron`'s items, each tensor and object under `module.`, the common state left for
    common.pt; and context/'s files (refused before anything is written where NeMo has no class)."""
    # the vocabulary unpadded unless asked: NeMo's models take the config's vocab_size as it is
    unpadded = replace(request, vocab_multiple=request.vocab_multiple or 1)
    model, _, items, described = megatron.plan_items(store, subtree, unpadded)
    files, notes = context_files(model, request.vocab_multiple)
    model = replace(model, notes=[*model.notes, *notes])
    kept = [replace(it, fqn=nemo.PREFIX + it.fqn) for it in items if it.fqn != megatron.COMMON_ITEM]
    return model, kept, {nemo.PREFIX + k: v for k, v in described.items() if k != megatron.COMMON_ITEM}, files


def _write_beside(out: Path, files: dict[str, bytes], store: Store) -> list[Path]:
    """context/, then weights/'s metadata.json and common.pt: all before weights/.metadata."""
    written = []
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        with OutputFile(out / name) as f:
            f.write(data)
        written.append(out / name)
    weights = out / nemo.WEIGHTS
    with OutputFile(weights / "metadata.json") as f:
        f.write(json.dumps(BACKEND).encode())
    with OutputFile(weights / COMMON) as f:
        write_zip(f, Path(COMMON).stem, COMMON_STATE, store)
    return written + [weights / "metadata.json", weights / COMMON]


def _file_names(files: dict[str, bytes]) -> list[str]:
    return list(files) + [f"{nemo.WEIGHTS}/metadata.json", f"{nemo.WEIGHTS}/{COMMON}"]


def _plan(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    model, items, described, files = plan_items(store, subtree, request)
    plan = dcp.DcpPlan(described, {}, dcp.spread(items, jobs), {})
    names = _file_names(files) + [f"{nemo.WEIGHTS}/{name}" for name in plan.names] + [f"{nemo.WEIGHTS}/{dcp.METADATA}"]

    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        if partial is not None:
            raise ExportError("--allow-partial: a NeMo checkpoint is written whole or not at all")
        weights = out / nemo.WEIGHTS
        weights.mkdir(parents=True, exist_ok=True)
        tempfiles.sweep(weights, recursive=False)  # what a killed export left
        beside = _write_beside(out, files, store)
        return beside + dcp.export_dcp(store, weights, plan, jobs, progress), [], model.notes

    return Planned(names, plan.nbytes, write)


@dataclass(frozen=True)
class NemoDirect(chunks.ChunksDirect):
    """weights/'s chunks as chunks.ChunksDirect writes them; context/ and the common state before its
    `.metadata`."""

    beside: tuple[tuple[str, bytes], ...] = ()

    @property
    def files(self) -> list[str]:
        return _file_names(dict(self.beside)) + super().files

    def finish(self, store: Store, out: Path) -> list[Path]:
        return _write_beside(out, dict(self.beside), store) + super().finish(store, out)


def _direct(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> NemoDirect | None:
    """Each chunk that is one run of rows of an array the ingest brings, laid out in weights/'s files for
    its workers; the rest written at the finish from the store."""
    model, items, described, files = plan_items(store, subtree, request)
    fields = chunks.plan_direct(store, items, described, jobs, nemo.WEIGHTS)
    return None if fields is None else NemoDirect(**fields, said=tuple(model.notes), beside=tuple(files.items()))


MAY_WRITE = rf"{nemo.WEIGHTS}|{nemo.CONTEXT}"  # all it writes at OUT's top
FORMAT = OutputFormat("nemo", subtree=True, may_write=MAY_WRITE, config_beside=False, resume_beside=False,
                      describes_model=True, single_file=False, takes_scheduler=False, plan=_plan, direct=_direct,
                      recognises=lambda out: (out / nemo.WEIGHTS).is_dir() and (out / nemo.CONTEXT).is_dir(),
                      reads_back_as_model=True, pads_vocabulary=True)
