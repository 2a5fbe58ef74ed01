"""The baseline of benchmarks/to_megatron_bench.py: a Hugging Face Llama folder into a Megatron-Core torch_dist
checkpoint the way the tools users have wrap it (Megatron-Bridge's AutoBridge.import_ckpt, Pai-Megatron-Patch's
and ms-swift's converters): transformers loads the model, megatron-core builds its GPTModel (TP=1, PP=1, one
gloo process on the CPU), the Hugging Face tensors are copied into it under Megatron's names, and
megatron-core's own `dist_checkpointing.save` writes `{"model": model.sharded_state_dict(), ...}` as
Megatron-LM's save_checkpoint does.

    PY benchmarks/hf_to_megatron_baseline.py HF_FOLDER OUT_FOLDER

PY: a Python with megatron-core (tests/fixtures/megatron_core.py's docstring says how), run from the repo.
Writes OUT_FOLDER/release/ (`.metadata`, `__0_*.distcp`, `common.pt`, `metadata.json`) and
OUT_FOLDER/latest_checkpointed_iteration.txt (`release`). The common state is Megatron-LM's: `args` (a
Namespace of the model's fields), `checkpoint_version`, `iteration`, `num_floating_point_operations_so_far`.

The mapping (megatron-core's local layer spec, the one tests/fixtures/megatron_load.py loads into):
- model.embed_tokens -> embedding.word_embeddings (rows padded with zeros to a multiple of 128, Megatron-LM's
  make_vocab_size_divisible_by), lm_head -> output_layer (likewise; none if the embeddings are tied),
  model.norm -> decoder.final_layernorm;
- per layer: input_layernorm -> input_layernorm, post_attention_layernorm -> pre_mlp_layernorm,
  q/k/v_proj -> self_attention.linear_qkv (per query group: its q rows, its k rows, its v rows; Qwen2's biases
  alike), o_proj -> self_attention.linear_proj, [gate_proj; up_proj] -> mlp.linear_fc1, down_proj ->
  mlp.linear_fc2.
The Megatron model is built in the Hugging Face model's dtype (params_dtype; bf16 as Megatron-LM's --bf16) and
without megatron-core's random initialisation (every weight is overwritten), so what is held is the two
models' tensors: the Hugging Face one, dropped once copied, and the Megatron one.
"""

from __future__ import annotations

import argparse
import gc
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures.megatron_core import _cpu_shims, _stub_triton  # noqa: E402
from tests.fixtures.megatron_load import gloo_alone, hf_spec  # noqa: E402

VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default (times TP, 1 here)


def padded_vocab(vocab: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-vocab // multiple) * multiple


def build_model(spec: dict[str, Any], vocab: int, dtype: torch.dtype) -> Any:
    """GPTModel for `spec` (tests/fixtures/megatron_load.py's hf_spec) at TP=1, PP=1 with the local layer
    spec, its parameters in `dtype`, left uninitialised (they are all copied over)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert not spec["experts"], "the baseline converts dense models only"
    ps.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
        num_query_groups=spec["groups"], kv_channels=spec["head_dim"], ffn_hidden_size=spec["ffn"],
        layernorm_epsilon=spec["eps"], normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=spec["qkv_bias"],
        qk_layernorm=spec["qk_layernorm"], tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec["qk_layernorm"])
    model = GPTModel(config=config, transformer_layer_spec=layer, vocab_size=vocab,
                     max_sequence_length=spec["max_positions"], position_embedding_type="rope",
                     rotary_base=spec["rope_theta"], share_embeddings_and_output_weights=spec["tied"],
                     pre_process=True, post_process=True)
    # Megatron-LM's --bf16 (Float16Module) has every parameter in bf16, the norms too
    return model.to(dtype)


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's linear_qkv rows: for each query group, its q rows, then its k rows, then its v rows."""
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def copy_weights(model: Any, hf: dict[str, torch.Tensor], spec: dict[str, Any]) -> None:
    """The Hugging Face state dict `hf` into the Megatron model's parameters, each popped once copied."""
    params = dict(model.named_parameters())
    done = set()

    def put(name: str, value: torch.Tensor) -> None:
        target = params[name]
        if target.shape != value.shape:  # the padded vocabulary: extra rows zero
            assert target.shape[1:] == value.shape[1:] and target.shape[0] > value.shape[0], (name, value.shape)
            target[value.shape[0]:].zero_()
            target = target[:value.shape[0]]
        target.copy_(value)
        done.add(name)

    with torch.no_grad():
        put("embedding.word_embeddings.weight", hf.pop("model.embed_tokens.weight"))
        put("decoder.final_layernorm.weight", hf.pop("model.norm.weight"))
        if not spec["tied"]:
            put("output_layer.weight", hf.pop("lm_head.weight"))
        hf.pop("lm_head.weight", None)  # tied: the embedding's own tensor
        g = spec["groups"]
        for i in range(spec["layers"]):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            put(m + "input_layernorm.weight", hf.pop(h + "input_layernorm.weight"))
            put(m + "pre_mlp_layernorm.weight", hf.pop(h + "post_attention_layernorm.weight"))
            a = h + "self_attn."
            put(m + "self_attention.linear_qkv.weight", interleave_qkv(
                hf.pop(a + "q_proj.weight"), hf.pop(a + "k_proj.weight"), hf.pop(a + "v_proj.weight"), g))
            if spec["qkv_bias"]:
                put(m + "self_attention.linear_qkv.bias", interleave_qkv(
                    hf.pop(a + "q_proj.bias"), hf.pop(a + "k_proj.bias"), hf.pop(a + "v_proj.bias"), g))
            if spec["qk_layernorm"]:
                put(m + "self_attention.q_layernorm.weight", hf.pop(a + "q_norm.weight"))
                put(m + "self_attention.k_layernorm.weight", hf.pop(a + "k_norm.weight"))
            put(m + "self_attention.linear_proj.weight", hf.pop(a + "o_proj.weight"))
            put(m + "mlp.linear_fc1.weight", torch.cat([hf.pop(h + "mlp.gate_proj.weight"),
                                                        hf.pop(h + "mlp.up_proj.weight")]))
            put(m + "mlp.linear_fc2.weight", hf.pop(h + "mlp.down_proj.weight"))
    left = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    assert not left, f"Hugging Face tensors not mapped: {left}"
    missing = set(params) - done
    assert not missing, f"Megatron parameters not set: {sorted(missing)}"


def megatron_args(spec: dict[str, Any], vocab: int, dtype: torch.dtype) -> argparse.Namespace:
    """Megatron-LM's `args` in the common state: the model's fields as its arguments name them."""
    return argparse.Namespace(
        num_layers=spec["layers"], hidden_size=spec["hidden"], ffn_hidden_size=spec["ffn"],
        num_attention_heads=spec["heads"], group_query_attention=spec["groups"] != spec["heads"],
        num_query_groups=spec["groups"], kv_channels=spec["head_dim"],
        max_position_embeddings=spec["max_positions"], seq_length=spec["max_positions"],
        position_embedding_type="rope", rotary_base=spec["rope_theta"], rotary_percent=1.0,
        normalization="RMSNorm", norm_epsilon=spec["eps"], swiglu=True, add_bias_linear=False,
        add_qkv_bias=spec["qkv_bias"], qk_layernorm=spec["qk_layernorm"],
        untie_embeddings_and_output_weights=not spec["tied"], padded_vocab_size=vocab,
        make_vocab_size_divisible_by=VOCAB_MULTIPLE, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        ckpt_format="torch_dist", bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        iteration=0)


def convert(hf_folder: str, out: str) -> None:
    warnings.simplefilter("ignore")
    _stub_triton()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    spec = hf_spec(hf_folder)
    # 1. transformers' model of the folder, in its own dtype (config.json's)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype="auto")
    dtype = next(hf_model.parameters()).dtype
    hf = hf_model.state_dict()
    del hf_model

    # 2. megatron-core's GPTModel in one gloo process on the CPU
    _cpu_shims()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    gloo_alone()
    vocab = padded_vocab(spec["vocab"])
    model = build_model(spec, vocab, dtype)

    # 3. the Hugging Face tensors into it under Megatron's names
    copy_weights(model, hf, spec)
    del hf
    gc.collect()

    # 4. Megatron-LM's save_checkpoint of a release checkpoint: the model's sharded state dict under "model",
    # the rest the common state, through megatron-core's dist_checkpointing.save (torch_dist)
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": megatron_args(spec, vocab, dtype),
             "checkpoint_version": 3.0, "iteration": 0, "num_floating_point_operations_so_far": 0}
    folder = Path(out, "release")
    folder.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(folder), dist_checkpointing.serialization.get_default_save_sharded_strategy(),
                            content_metadata=metadata)
    Path(out, "latest_checkpointed_iteration.txt").write_text("release")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_folder")
    ap.add_argument("out_folder")
    a = ap.parse_args()
    convert(a.hf_folder, a.out_folder)


if __name__ == "__main__":
    main()
