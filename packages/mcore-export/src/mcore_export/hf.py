"""Hugging Face export (mcore checkpoint -> ``transformers`` directory) and import (the reverse).

Key layouts live in :mod:`mcore_models.hf` (``mcore_to_hf`` / ``hf_to_mcore``); this module streams them between
files. Both directions hold one global tensor in memory at a time: a first pass over ``meta`` tensors plans the files
(and finds missing tensors and unrepresentable features before anything is written), a second pass reads and writes.
Outputs are written into a temporary directory renamed into place at the end, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from mcore_export._hf_files import HFTensors
from mcore_export._llava import check_llava_layout, is_llava_hf_config, llava_layout_infos
from mcore_export._mcore_writer import check_layout, import_attrs, layout_infos, start_checkpoint, write_parameter
from mcore_export._safetensors import SafetensorsWriter, TensorEntry
from mcore_export._source import CheckpointReader, resolve_dtype
from mcore_export._staging import check_output, staged_output
from mcore_export._tokenizer import export_tokenizer, import_tokenizer
from mcore_export.errors import ExportError
from mcore_models import DTYPES, ConversionError, TransformerConfig
from mcore_models.hf import (
    gpt2_config_from_hf,
    gpt2_config_to_hf,
    hf_architecture,
    hf_to_mcore,
    llama_config_from_hf,
    llama_config_to_hf,
    mcore_to_hf,
)
from mcore_models.hf_llava import (
    LLAVA_ARCHITECTURE,
    llava_config_from_hf,
    llava_config_to_hf,
    llava_hf_layout,
    llava_hf_to_mcore,
    llava_mcore_to_hf,
)
from mcore_models.hf_moe import MOE_ARCHITECTURES, MOE_MODEL_TYPES, moe_config_from_hf, moe_config_to_hf
from mcore_models.hf_ssm import SSM_ARCHITECTURES, SSM_MODEL_TYPES, ssm_config_from_hf, ssm_config_to_hf
from mcore_models.multimodal import LlavaConfig
from mcore_parallel.sharding import ShardedTensor

__all__ = ["export_hf", "import_hf", "hf_config_for", "plan_shards", "DEFAULT_MAX_SHARD_SIZE"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3  # bytes: transformers' default "5GB"
_DTYPE_JSON = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
Getter = Callable[[str], torch.Tensor]
Converter = Callable[[Getter], Iterator[tuple[str, torch.Tensor]]]


def hf_config_for(config: TransformerConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` content (raises ConversionError naming what HF cannot represent)."""
    arch = hf_architecture(config)
    if arch in MOE_ARCHITECTURES:
        return moe_config_to_hf(config)
    if arch in SSM_ARCHITECTURES:
        return ssm_config_to_hf(config)
    if arch == "LlamaForCausalLM":
        return llama_config_to_hf(config)
    return gpt2_config_to_hf(config)


def plan_shards(entries: list[TensorEntry], max_shard_size: int) -> list[list[TensorEntry]]:
    """Greedy, in order: a new shard starts when the next tensor would push the current one past the limit."""
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size={max_shard_size} must be positive")
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def export_hf(
    checkpoint: str | Path,
    out: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
) -> Path:
    """Write a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads; returns its path.

    ``dtype``: bf16, fp16 or fp32 (default: the checkpoint's ``params_dtype``). Weights go to ``model.safetensors``,
    or to ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_size`` bytes (a single larger tensor
    gets a shard of its own) with ``model.safetensors.index.json``.
    """
    reader = CheckpointReader(checkpoint, llava=True)
    config = reader.config  # a LLaVA checkpoint's language model
    hf_config, convert = _export_plan(reader)
    target = resolve_dtype(dtype, config.dtype)
    out_path = Path(out)
    check_output(out_path.absolute(), overwrite)
    entries = [TensorEntry(k, tuple(t.shape), target) for k, t in convert(reader.as_meta().get)]
    shards = plan_shards(entries, max_shard_size)
    total = sum(e.nbytes for e in entries)
    logger.info(
        "exporting %s (%s, %d tensors, %.3f GB %s) to %s in %d file(s)",
        reader.path,
        hf_config["architectures"][0],
        len(entries),
        total / 1e9,
        _DTYPE_JSON[target],
        out,
        len(shards),
    )
    with staged_output(out_path, overwrite) as tmp:
        ids = export_tokenizer(reader.tokenizer, tmp, config.max_position_embeddings)
        hf_config["torch_dtype"] = _DTYPE_JSON[target]
        for part in (hf_config, hf_config.get("text_config")):  # LLaVA: its language model's config too
            if part is not None:
                part["bos_token_id"] = ids.bos[1] if ids.bos else None
                part["eos_token_id"] = ids.eos[1] if ids.eos else None
                if ids.pad:
                    part["pad_token_id"] = ids.pad[1]
        _write_json(tmp / "config.json", hf_config)
        generation = {
            "_from_model_config": True,
            "bos_token_id": hf_config["bos_token_id"],
            "eos_token_id": hf_config["eos_token_id"],
        }
        if ids.pad:
            generation["pad_token_id"] = ids.pad[1]
        _write_json(tmp / "generation_config.json", generation)
        tensors = convert(reader.get)
        if len(shards) == 1:
            _write_file(tmp / "model.safetensors", shards[0], tensors)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_file(tmp / name, shard, tensors)
                weight_map.update({e.name: name for e in shard})
                logger.info("wrote shard %d/%d (%s)", i + 1, len(shards), name)
            _write_json(
                tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
            )
    return out_path


def _export_plan(reader: CheckpointReader) -> tuple[dict[str, Any], Converter]:
    """The ``config.json`` content and the tensor conversion of a checkpoint (GPT or LLaVA)."""
    llava = reader.llava
    if llava is not None:
        return llava_config_to_hf(llava), lambda get: llava_mcore_to_hf(llava, get)
    config = reader.config
    return hf_config_for(config), lambda get: mcore_to_hf(config, get)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_file(path: Path, entries: list[TensorEntry], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    with SafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
        for e in entries:
            key, tensor = next(tensors)
            writer.write(key, tensor.to(e.dtype))


# ----------------------------------------------------------------------------------------------------- import
def _config_from_hf(hf: dict[str, Any], params_dtype: str) -> TransformerConfig | LlavaConfig:
    arch = (hf.get("architectures") or [None])[0]
    model_type = hf.get("model_type")
    if is_llava_hf_config(hf):
        return llava_config_from_hf(hf, params_dtype=params_dtype)
    if arch == "LlamaForCausalLM" or (arch is None and model_type == "llama"):
        return llama_config_from_hf(hf, params_dtype=params_dtype)
    if arch == "GPT2LMHeadModel" or (arch is None and model_type == "gpt2"):
        return gpt2_config_from_hf(hf, params_dtype=params_dtype)
    if arch in MOE_ARCHITECTURES or (arch is None and model_type in MOE_MODEL_TYPES):
        return moe_config_from_hf(hf, params_dtype=params_dtype)
    if arch in SSM_ARCHITECTURES or (arch is None and model_type in SSM_MODEL_TYPES):
        return ssm_config_from_hf(hf, params_dtype=params_dtype)
    raise ConversionError(
        f"architecture {arch!r} (model_type {model_type!r}) is not supported; supported: LlamaForCausalLM, "
        f"GPT2LMHeadModel, {', '.join(MOE_ARCHITECTURES + SSM_ARCHITECTURES)}, {LLAVA_ARCHITECTURE}"
    )


def import_hf(
    model_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a Hugging Face directory (``config.json`` + safetensors) into an mcore checkpoint at ``out``.

    The checkpoint, like every mcore checkpoint, stores global tensors and loads under any TP/PP layout; ``tp``
    and ``pp`` choose the chunking (one chunk per TP piece, as a run of that layout would save it) and are checked
    against the model (heads, groups and layers must divide). ``dtype`` defaults to the model's ``torch_dtype``.
    """
    src = Path(model_dir)
    try:
        hf_cfg = json.loads((src / "config.json").read_text())
    except FileNotFoundError:
        raise ExportError(f"{src}/config.json is missing: not a Hugging Face model directory") from None
    except json.JSONDecodeError as e:
        raise ExportError(f"{src}/config.json is not valid JSON ({e})") from None
    stored = hf_cfg.get("torch_dtype") or hf_cfg.get("dtype")
    if stored is None and isinstance(hf_cfg.get("text_config"), dict):  # LLaVA configs may state it there
        stored = hf_cfg["text_config"].get("torch_dtype") or hf_cfg["text_config"].get("dtype")
    params = resolve_dtype(dtype, DTYPES.get(str(stored), torch.float32))
    try:
        config = _config_from_hf(hf_cfg, _DTYPE_JSON[params])
    except ConversionError as e:
        raise ConversionError(f"{src}/config.json: {e}") from None
    arch, infos = _import_layout(config, tp, pp)
    out_path = Path(out)
    check_output(out_path.absolute(), overwrite)
    with HFTensors(src) as tensors:
        convert = _import_converter(config, tensors)
        _check_planned(src, convert(tensors.meta_get), infos)
        with staged_output(out_path, overwrite) as tmp:
            tokenizer = import_tokenizer(src, tmp)
            source = {"format": "huggingface", "path": str(src.absolute()), "architecture": arch}
            lm = config.language if isinstance(config, LlavaConfig) else config
            attrs = import_attrs(out_path, lm, tp, pp, source)
            attrs["model"] = config.to_dict()  # a LLaVA checkpoint's is the LlavaConfig
            if tokenizer is not None:
                attrs["tokenizer"] = tokenizer
            start_checkpoint(tmp, attrs)
            for key, tensor in convert(tensors.get):
                write_parameter(tmp / "model" / key, infos[key], tensor.to(params))
        unused = sorted(set(tensors.keys()) - tensors.used)
    if unused:
        logger.info("tensors of %s not used by the conversion: %s", src, unused)
    logger.info("imported %s (%s) into %s", src, arch, out_path)
    return out_path


def _import_layout(config: TransformerConfig | LlavaConfig, tp: int, pp: int) -> tuple[str, dict[str, ShardedTensor]]:
    """The HF architecture (a ConversionError when unsupported) and the model's parameters chunked for tp, after
    checking that tp x pp fits the model."""
    if isinstance(config, LlavaConfig):
        llava_config_to_hf(config)  # what the HF class cannot represent, mcore cannot import either
        check_llava_layout(config, tp, pp)
        return LLAVA_ARCHITECTURE, llava_layout_infos(config, tp)
    arch = hf_architecture(config)
    check_layout(config, tp, pp)
    return arch, layout_infos(config, tp)


def _import_converter(config: TransformerConfig | LlavaConfig, tensors: HFTensors) -> Converter:
    if isinstance(config, LlavaConfig):
        layout = llava_hf_layout(tensors.keys())  # hub, transformers' module names, or save_pretrained's mix
        return lambda get: llava_hf_to_mcore(config, get, layout)
    return lambda get: hf_to_mcore(config, get)


def _check_planned(src: Path, converted: Iterator[tuple[str, torch.Tensor]], infos: dict[str, ShardedTensor]) -> None:
    """Every tensor the conversion would write exists in the model with the shape the config gives it."""
    planned = {k: tuple(t.shape) for k, t in converted}
    wrong = [f"{k}: {s} (expected {infos[k].global_shape})" for k, s in planned.items()
             if k in infos and s != infos[k].global_shape]  # fmt: skip
    if wrong or set(planned) != set(infos):
        raise ConversionError(
            f"{src}: tensors do not match the config: shapes {wrong}, "
            f"unexpected {sorted(set(planned) - set(infos))}, "
            f"missing {sorted(set(infos) - set(planned))}"
        )
