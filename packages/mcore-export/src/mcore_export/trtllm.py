"""TensorRT-LLM checkpoint export: ``config.json`` plus one ``rank{r}.safetensors`` per rank of an output layout.

The output tensor/pipeline layout (``tp``, ``pp``) is independent of the layout that trained the model: every
tensor is read from the checkpoint's global arrays, and each rank file takes only the slices it needs (one rank file
is planned and streamed at a time, so memory holds one tensor slice at a time). Rules of the format
(TensorRT-LLM's ``models/llama/convert.py`` and ``models/gpt/convert.py``; see ``docs/export.md``):

- rank ``r = pp_rank * tp + tp_rank``; layers split as ``torch.tensor_split(range(L), pp)`` (the first ``L % pp``
  stages get one more) and renumbered from 0 on every stage; the embedding (and GPT's position embedding) on the
  first stage, ``ln_f`` and ``lm_head`` on the last;
- ``attention.qkv`` on rank r is ``[Q_r; K_r; V_r]``: the rank's query heads and the KV heads serving them; with fewer
  KV heads than ``tp`` each KV head is duplicated ``tp / kv`` times (consecutively), so every rank holds one;
- gated MLP: ``mlp.fc`` is the activated branch (mcore's first half of ``linear_fc1``, HF ``gate_proj``) and
  ``mlp.gate`` the multiplied one (HF ``up_proj``); ``fc``/``gate`` split on rows, ``proj`` and ``attention.dense``
  on columns, their biases not split;
- ``lm_head`` is zero-padded to a multiple of ``tp`` rows and split on rows; ``vocab_size`` in the config is the
  true vocabulary; a tied embedding is copied into ``lm_head``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from mcore_export._safetensors import SafetensorsWriter, TensorEntry
from mcore_export._source import CheckpointReader, resolve_dtype
from mcore_export._staging import check_output, staged_output
from mcore_export.errors import ExportError, LayoutError
from mcore_models import ConversionError, TransformerConfig

__all__ = ["export_trtllm", "trtllm_architecture", "trtllm_config", "pipeline_layers", "build_engine"]

logger = logging.getLogger(__name__)

_DTYPE_JSON = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_GPT_ACT = {"gelu": "gelu", "gelu_tanh": "gelu", "squared_relu": "squared-relu", "swiglu": "swiglu"}
Region = Callable[[str, "tuple[slice, ...] | None"], torch.Tensor]


def trtllm_architecture(config: TransformerConfig) -> str:
    """``LlamaForCausalLM`` or ``GPTForCausalLM``, or a ConversionError naming what neither can represent."""
    c = config
    problems = []
    if c.hybrid_pattern is not None:  # checked first: its other settings would be reported as if they were the cause
        raise ConversionError(
            f"TensorRT-LLM export cannot represent hybrid_pattern={c.hybrid_pattern!r} (Mamba-2 / hybrid layers); "
            "export those with 'mcore-export hf' (Mamba2ForCausalLM, NemotronHForCausalLM)"
        )
    if c.moe is not None:
        problems.append("moe (mixture-of-experts layers; export those with 'mcore-export hf')")
    if c.qk_layernorm:
        problems.append("qk_layernorm")
    if c.normalization == "rmsnorm":
        if c.activation != "swiglu":
            problems.append(f"activation={c.activation} with rmsnorm (LlamaForCausalLM is always gated SiLU)")
        if c.position_embedding != "rope":
            problems.append(f"position_embedding={c.position_embedding} with rmsnorm (Llama uses RoPE)")
        if c.add_bias_linear:
            problems.append("add_bias_linear (mcore's biases are not TensorRT-LLM Llama's attn_bias/mlp_bias)")
        if c.add_qkv_bias:
            problems.append("add_qkv_bias (TensorRT-LLM Llama's attn_bias also biases the output projection)")
        if c.rotary_percent != 1.0:
            problems.append(f"rotary_percent={c.rotary_percent} (Llama rotates the whole head)")
        arch = "LlamaForCausalLM"
    else:
        if c.position_embedding == "none":
            problems.append("position_embedding=none (GPTForCausalLM needs learned or rotary positions)")
        if c.add_qkv_bias and not c.add_bias_linear:
            problems.append("add_qkv_bias without add_bias_linear (GPTForCausalLM's bias flag covers every linear)")
        if c.rope_scaling is not None:
            problems.append("rope_scaling with layernorm (only the Llama export writes llama3 rotary_scaling)")
        arch = "GPTForCausalLM"
    if problems:
        raise ConversionError(f"TensorRT-LLM {arch} cannot represent: " + "; ".join(problems))
    return arch


def pipeline_layers(num_layers: int, pp: int) -> list[range]:
    """The global layers of each pipeline stage: ``torch.tensor_split(arange(L), pp)`` (first stages get extras)."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _check_layout(c: TransformerConfig, tp: int, pp: int) -> None:
    nh, g = c.num_attention_heads, c.query_groups
    problems = []
    if tp < 1 or pp < 1:
        problems.append("tp and pp must be at least 1")
    else:
        if nh % tp:
            problems.append(f"num_attention_heads={nh} is not divisible by tp={tp}")
        if g >= tp and g % tp:
            problems.append(f"num_query_groups={g} is not divisible by tp={tp}")
        if g < tp and tp % g:
            problems.append(f"tp={tp} is not a multiple of num_query_groups={g} (KV heads cannot be duplicated evenly)")
        if c.ffn_size % tp:
            problems.append(f"ffn_hidden_size={c.ffn_size} is not divisible by tp={tp}")
        if pp > c.num_layers:
            problems.append(f"pp={pp} is larger than num_layers={c.num_layers}")
    if problems:
        raise LayoutError(f"cannot export to tp={tp}, pp={pp}: " + "; ".join(problems))
    if c.num_layers % pp:
        logger.warning(
            "num_layers=%d is not divisible by pp=%d: stages get %s layers (current TensorRT-LLM's "
            "split; releases before ~0.12 used equal blocks)",
            c.num_layers,
            pp,
            [len(r) for r in pipeline_layers(c.num_layers, pp)],
        )


def trtllm_config(config: TransformerConfig, tp: int, pp: int, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of the TensorRT-LLM checkpoint."""
    c = config
    arch = trtllm_architecture(c)
    out: dict[str, Any] = {
        "architecture": arch,
        "dtype": _DTYPE_JSON[dtype],
        "logits_dtype": "float32",
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.query_groups,
        "head_size": c.head_dim,
        "intermediate_size": c.ffn_size,
        "norm_epsilon": c.norm_eps,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": c.share_embeddings_and_output_weights,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "cp_size": 1, "gpus_per_node": 8},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    if arch == "LlamaForCausalLM":
        scaling = None
        if c.rope_scaling is not None:
            rs = c.rope_scaling
            scaling = {
                "type": "llama3",
                "rope_type": "llama3",
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        out.update(
            hidden_act="silu",
            position_embedding_type="rope_gpt_neox",
            rotary_base=c.rotary_base,
            rotary_scaling=scaling,
            mlp_bias=False,
            attn_bias=False,
        )
        return out
    rope = c.position_embedding == "rope"
    if c.activation == "gelu":
        logger.warning("exact (erf) GELU: TensorRT-LLM's 'gelu' is the tanh approximation (outputs differ slightly)")
    out.update(
        hidden_act=_GPT_ACT[c.activation],
        position_embedding_type="rope_gpt_neox" if rope else "learned_absolute",
        rotary_pct=c.rotary_percent if rope else 0.0,
        rotary_base=c.rotary_base,
        rotary_scaling=None,
        bias=c.add_bias_linear,
        apply_query_key_layer_scaling=False,
        q_scaling=1.0,
        qk_layernorm=False,
    )
    if not rope and c.add_bias_linear and c.activation in ("gelu", "gelu_tanh"):
        out["gpt_variant"] = "gpt2"
    return out


@dataclass(frozen=True)
class _Rank:
    tp: int
    tp_rank: int
    layers: range
    first: bool
    last: bool


def _qkv_rows(c: TransformerConfig, r: _Rank) -> tuple[slice, Callable[[torch.Tensor], torch.Tensor]]:
    """Rows of mcore's grouped fused QKV that rank ``r`` needs, and how to turn them into ``[Q_r; K_r; V_r]``."""
    nh, g, d, t = c.num_attention_heads, c.query_groups, c.head_dim, r.tp
    per = nh // g
    if g >= t:
        g0, g1 = r.tp_rank * g // t, (r.tp_rank + 1) * g // t
    else:  # each KV head serves t/g consecutive ranks (the duplication)
        g0 = r.tp_rank // (t // g)
        g1 = g0 + 1
    q0 = r.tp_rank * (nh // t) - g0 * per  # first wanted query head, relative to the loaded groups
    q1 = q0 + nh // t

    def arrange(rows: torch.Tensor) -> torch.Tensor:
        rest = rows.shape[1:]
        grouped = rows.reshape(g1 - g0, per + 2, d, *rest)
        q = grouped[:, :per].reshape((g1 - g0) * per, d, *rest)[q0:q1].reshape(-1, *rest)
        k = grouped[:, per].reshape(-1, *rest)
        v = grouped[:, per + 1].reshape(-1, *rest)
        return torch.cat([q, k, v], dim=0)

    return slice(g0 * (per + 2) * d, g1 * (per + 2) * d), arrange


def _rows(region: Region, key: str, start: int, stop: int) -> torch.Tensor:
    return region(key, (slice(start, stop),))


def _cols(region: Region, key: str, start: int, stop: int) -> torch.Tensor:
    return region(key, (slice(None), slice(start, stop)))


def _rank_tensors(c: TransformerConfig, region: Region, r: _Rank, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of one rank file, in file order."""
    t, i = r.tp, r.tp_rank
    gpt = arch == "GPTForCausalLM"
    bias = gpt and c.add_bias_linear
    norm_params = ("weight", "bias") if c.normalization == "layernorm" else ("weight",)
    if r.first:
        yield "transformer.vocab_embedding.weight", region("embedding.word_embeddings.weight", None)
        if c.position_embedding == "learned_absolute":
            yield "transformer.position_embedding.weight", region("embedding.position_embeddings.weight", None)
    inner, attn = c.ffn_size // t, c.num_attention_heads * c.head_dim // t
    for j, layer in enumerate(r.layers):
        m, o = f"decoder.layers.{layer}", f"transformer.layers.{j}"
        for p in norm_params:
            yield f"{o}.input_layernorm.{p}", region(f"{m}.input_layernorm.{p}", None)
        rows, arrange = _qkv_rows(c, r)
        yield f"{o}.attention.qkv.weight", arrange(region(f"{m}.self_attention.linear_qkv.weight", (rows,)))
        if bias:
            yield f"{o}.attention.qkv.bias", arrange(region(f"{m}.self_attention.linear_qkv.bias", (rows,)))
        yield (
            f"{o}.attention.dense.weight",
            _cols(region, f"{m}.self_attention.linear_proj.weight", i * attn, (i + 1) * attn),
        )
        if bias:
            yield f"{o}.attention.dense.bias", region(f"{m}.self_attention.linear_proj.bias", None)
        for p in norm_params:
            yield f"{o}.post_layernorm.{p}", region(f"{m}.pre_mlp_layernorm.{p}", None)
        fc1 = f"{m}.mlp.linear_fc1"
        yield f"{o}.mlp.fc.weight", _rows(region, f"{fc1}.weight", i * inner, (i + 1) * inner)
        if bias:
            yield f"{o}.mlp.fc.bias", _rows(region, f"{fc1}.bias", i * inner, (i + 1) * inner)
        if c.gated:
            full = c.ffn_size
            yield f"{o}.mlp.gate.weight", _rows(region, f"{fc1}.weight", full + i * inner, full + (i + 1) * inner)
            if bias:
                yield f"{o}.mlp.gate.bias", _rows(region, f"{fc1}.bias", full + i * inner, full + (i + 1) * inner)
        yield f"{o}.mlp.proj.weight", _cols(region, f"{m}.mlp.linear_fc2.weight", i * inner, (i + 1) * inner)
        if bias:
            yield f"{o}.mlp.proj.bias", region(f"{m}.mlp.linear_fc2.bias", None)
    if r.last:
        for p in norm_params:
            yield f"transformer.ln_f.{p}", region(f"decoder.final_layernorm.{p}", None)
        key = "embedding.word_embeddings.weight" if c.share_embeddings_and_output_weights else "output_layer.weight"
        v = c.vocab_size
        per_rank = -(-v // t)
        start, stop = i * per_rank, (i + 1) * per_rank
        head = _rows(region, key, min(start, v), min(stop, v))
        if head.shape[0] < per_rank:  # the padding rows (zeros) past the true vocabulary
            pad = torch.zeros(per_rank - head.shape[0], *head.shape[1:], dtype=head.dtype, device=head.device)
            head = torch.cat([head, pad])
        yield "lm_head.weight", head


def export_trtllm(
    checkpoint: str | Path,
    out: str | os.PathLike[str],
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the TensorRT-LLM checkpoint of ``checkpoint`` for ``tp * pp`` ranks into ``out``; returns ``out``."""
    reader = CheckpointReader(checkpoint)
    c = reader.config
    arch = trtllm_architecture(c)
    _check_layout(c, tp, pp)
    target = resolve_dtype(dtype, c.dtype)
    config = trtllm_config(c, tp, pp, target)
    out_path = Path(out)
    check_output(out_path.absolute(), overwrite)
    stages = pipeline_layers(c.num_layers, pp)
    ranks = [
        _Rank(tp, tp_rank, stages[s], s == 0, s == pp - 1) for s in range(pp) for tp_rank in range(tp)
    ]  # index = pp_rank * tp + tp_rank
    meta = reader.as_meta()
    plans = [[TensorEntry(n, tuple(x.shape), target) for n, x in _rank_tensors(c, meta.region, r, arch)] for r in ranks]
    logger.info(
        "exporting %s as TensorRT-LLM %s (%s, tp=%d, pp=%d) to %s", reader.path, arch, config["dtype"], tp, pp, out
    )
    with staged_output(out_path, overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for rank, (r, plan) in enumerate(zip(ranks, plans)):
            tensors = _rank_tensors(c, reader.region, r, arch)
            with SafetensorsWriter(tmp / f"rank{rank}.safetensors", plan) as writer:
                for _ in plan:
                    name, tensor = next(tensors)
                    writer.write(name, tensor.to(target))
            logger.info("wrote rank%d.safetensors (%d tensors)", rank, len(plan))
    return out_path


def build_engine(checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str], *extra_args: str) -> Path:
    """Run ``trtllm-build`` on an exported checkpoint (needs TensorRT-LLM <= 1.2 with its TensorRT backend)."""
    if find_spec("tensorrt_llm") is None or shutil.which("trtllm-build") is None:
        raise ExportError(
            "building an engine needs TensorRT-LLM (pip install tensorrt-llm --extra-index-url "
            "https://pypi.nvidia.com, a release <= 1.2 that still has trtllm-build); the exported checkpoint "
            "itself needs nothing"
        )
    cmd = ["trtllm-build", "--checkpoint_dir", os.fspath(checkpoint_dir), "--output_dir", os.fspath(out), *extra_args]
    logger.info("running %s", " ".join(cmd))
    subprocess.run(cmd, check=True)
    return Path(out)
