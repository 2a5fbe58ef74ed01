"""NeMo 2 (`nemo.collections.llm`): its checkpoints are read through the DCP format (read/formats/dcp.py)
and written by `--format nemo` (export/nemo.py); here, how it names their parts.

A NeMo 2 checkpoint (what `llm.import_ckpt` and its trainer's saves leave) is `weights/`, a Megatron-Core
`torch_dist` folder whose model keys are under `module.` (its MegatronParallel's prefix), beside
`context/`: `io.json` (fiddle's serialization of the TrainerContext: the model's class, its config and
tokenizer; `nemo.lightning.io.load_context` reads it), `model.yaml` (the same model as YAML, which its
exporters read) and the tokenizer's files in `nemo_tokenizer/`.
"""

from __future__ import annotations

WEIGHTS, CONTEXT, MODEL, TOKENIZER, IO = "weights", "context", "model.yaml", "nemo_tokenizer", "io.json"
PREFIX = "module."
