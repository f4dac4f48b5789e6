"""The Python API: ``LLM(checkpoint).generate(prompts, SamplingParams(...))`` and ``LLM.generate_stream``.

``LLM`` loads an mcore checkpoint (weights only, any training layout) into this process's TP shard, builds the
tokenizer named in the checkpoint (the byte tokenizer when none is named), and drives an :class:`LLMEngine` in the
caller's thread. A LLaVA checkpoint (:mod:`mcore_models.multimodal.checkpoint`: its metadata's model has a vision
and a language part) builds a :class:`~mcore_models.multimodal.LlavaModel` (this rank's TP shard of the tower
and the language model, the projector whole), served at any tp with images (:mod:`mcore_infer.images`; at tp > 1
the first rank sends the others the pixels: :mod:`mcore_infer.tp_images`), normalised and tiled as its
mcore-train run did (``multimodal.image_mean`` / ``image_std``, ``max_tiles`` / ``tile_thumbnail`` / ``tile_tags``)
unless the ``EngineConfig`` fields of those names say otherwise. Under tensor parallelism every rank builds an
``LLM`` with the same arguments; the first TP rank calls ``generate`` and then ``shutdown``, the others call
:meth:`LLM.follow` (it returns at ``shutdown``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mcore_data import ByteTokenizer, TokenizerSpec, build_tokenizer
from mcore_infer.config import EngineConfig
from mcore_infer.engine import LLMEngine, RequestOutput
from mcore_infer.errors import InvalidRequestError
from mcore_infer.runner import ModelRunner
from mcore_infer.sampling import SamplingParams
from mcore_models import GPTModel, TransformerConfig
from mcore_models.checkpoint import (
    load_weights,
    model_config_from_checkpoint,
    resolve_checkpoint,
    tokenizer_spec_from_checkpoint,
)
from mcore_models.multimodal import LlavaModel
from mcore_parallel import Group
from mcore_parallel.checkpoint import read_metadata

__all__ = ["LLM", "Generation", "load_model"]

log = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class Generation:
    """The completions of one prompt (``n`` of them, in order)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[RequestOutput]


def load_model(
    checkpoint: str | Path,
    *,
    tp: Group | None = None,
    device: torch.device | str | None = None,
    dtype: str | None = None,
) -> tuple[GPTModel | LlavaModel, Any]:
    """Build the checkpoint's model on ``device`` (this rank's TP shard), load its weights; and its tokenizer. MoE
    layers hold every expert (ep=1), each split over the tensor-parallel ranks (expert_tp = tp). A LLaVA checkpoint
    gives a ``LlavaModel`` (the tower split over the TP ranks like the language model)."""
    ckpt = resolve_checkpoint(checkpoint)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    model: GPTModel | LlavaModel
    if is_llava_checkpoint(ckpt):
        model = _load_llava(ckpt, tp, device, dtype)
    else:
        config = _inference_config(model_config_from_checkpoint(ckpt), dtype)
        model = GPTModel(config, tp=tp, device=device, expert_tp=_expert_tp(config, tp))
        load_weights(model, ckpt)
    spec = tokenizer_spec_from_checkpoint(ckpt)
    tokenizer = ByteTokenizer() if spec is None else build_tokenizer(TokenizerSpec(spec["kind"], spec.get("path")))
    return model.eval(), tokenizer


def _expert_tp(config: TransformerConfig, tp: Group | None) -> Group | None:
    """Serving runs without sequence parallelism, so MoE layers split each expert over the tensor-parallel ranks."""
    return tp if config.moe is not None and tp is not None and tp.size > 1 else None


def _inference_config(config: TransformerConfig, dtype: str) -> TransformerConfig:
    return config.replace(params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0, recompute="none")


def is_llava_checkpoint(path: str | Path) -> bool:
    """Whether the checkpoint holds a ``LlavaModel`` (its metadata's ``model`` has ``vision`` and ``language``)."""
    meta = read_metadata(resolve_checkpoint(path)).get("model")
    return isinstance(meta, dict) and {"vision", "language"} <= set(meta)


def _trained_normalization(checkpoint: str | Path, config: EngineConfig) -> EngineConfig:
    """``config`` with the pixel normalisation an mcore-train VLM run used (its saved ``multimodal.image_mean`` /
    ``image_std``), when it used one."""
    meta = read_metadata(resolve_checkpoint(checkpoint))
    mm = (meta.get("config") or {}).get("multimodal") or {}
    mean, std = mm.get("image_mean"), mm.get("image_std")
    if not mean or not std:
        return config
    log.info("images normalised as in training: mean %s, std %s", mean, std)
    return replace(config, image_mean=tuple(mean), image_std=tuple(std))


def _trained_tiling(checkpoint: str | Path, config: EngineConfig) -> EngineConfig:
    """``config`` with the image tiling an mcore-train VLM run used (its saved ``multimodal.max_tiles`` /
    ``tile_thumbnail`` / ``tile_tags``) in the fields ``config`` leaves unset; a checkpoint without them (an older
    run, an imported Hugging Face model) is not tiled."""
    ckpt = resolve_checkpoint(checkpoint)
    mm = (read_metadata(ckpt).get("config") or {}).get("multimodal") or {}
    saved: dict[str, Any] = {}
    for key in ("max_tiles", "tile_thumbnail", "tile_tags"):
        value = mm.get(key)
        if value is None or getattr(config, key) is not None:
            continue
        if type(value) is not (int if key == "max_tiles" else bool) or (key == "max_tiles" and value < 1):
            raise InvalidRequestError(f"{ckpt}: the checkpoint's multimodal.{key}={value!r} is not valid; give "
                                      f"--{key.replace('_', '-')} to serve it")  # fmt: skip
        saved[key] = value
    if not saved:
        return config
    config = replace(config, **saved)
    if config.tiling().enabled:
        log.info("images tiled as in training: %s", config.tiling())
    return config


def _load_llava(ckpt: Path, tp: Group | None, device: torch.device, dtype: str) -> LlavaModel:
    from mcore_models.multimodal.checkpoint import llava_config_from_checkpoint, load_llava_weights

    config = llava_config_from_checkpoint(ckpt)
    config = config.replace(language=_inference_config(config.language, dtype), freeze=(),
                            vision=config.vision.replace(params_dtype=dtype))  # fmt: skip
    model = LlavaModel(config, tp=tp, device=device, expert_tp=_expert_tp(config.language, tp))
    load_llava_weights(model, ckpt)  # this rank's pieces (the checkpoint's arrays are global: any training layout)
    return model


class LLM:
    """Offline generation over one engine. Pass a checkpoint, or a built ``model`` and ``tokenizer``."""

    def __init__(
        self,
        checkpoint: str | Path | None = None,
        *,
        model: GPTModel | LlavaModel | None = None,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        tp: Group | None = None,
        device: torch.device | str | None = None,
        dtype: str | None = None,
        name: str | None = None,
    ) -> None:
        if (checkpoint is None) == (model is None):
            raise ValueError("pass either a checkpoint or a model")
        if checkpoint is not None:
            model, tokenizer = load_model(checkpoint, tp=tp, device=device, dtype=dtype)
            name = name or Path(checkpoint).resolve().name
        assert model is not None
        tp = tp or model.ctx.tp
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.config = config or EngineConfig()
        if checkpoint is not None and isinstance(model, LlavaModel) and self.config.image_mean is None:
            self.config = _trained_normalization(checkpoint, self.config)
        if checkpoint is not None and isinstance(model, LlavaModel):
            self.config = _trained_tiling(checkpoint, self.config)
        lm = model.language if isinstance(model, LlavaModel) else model
        self.name = name or str(lm.config.extra.get("preset", "mcore-model"))
        self.runner = ModelRunner(model, self.config, tp)
        self.runner.capture_graphs()
        self.engine = LLMEngine(self.runner, self.tokenizer, max_queue=self.config.max_queue, seed=self.config.seed)
        self.is_driver = tp.rank == 0

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    # ---------------------------------------------------------------------------------------------- generating
    def encode(self, prompt: Prompt) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        n: int = 1,
    ) -> list[Generation]:
        """Generate for every prompt (text or token ids) with continuous batching; results in prompt order."""
        plist = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(plist))
        groups: list[tuple[Generation, list[str]]] = []
        for prompt, p in zip(plist, params_list):
            ids = self.encode(prompt)
            rids = self._add(ids, p, n, stream=False)
            groups.append((Generation(prompt if isinstance(prompt, str) else None, ids, []), rids))
        done: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        results = []
        for gen, rids in groups:
            gen.outputs = [done[r] for r in rids]
            results.append(gen)
        return results

    def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one :class:`RequestOutput` per step with new tokens (``new_text``/``new_token_ids``); the last one
        has ``finished`` set and the whole completion. Other requests already queued keep running alongside."""
        ids = self.encode(prompt)
        (rid,) = self._add(ids, params or SamplingParams(), 1, stream=True)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            if rid in self.engine._seqs:
                self.engine.abort(rid)
                self.engine.step()

    def _add(self, ids: list[int], params: SamplingParams, n: int, stream: bool) -> list[str]:
        if n < 1:
            raise InvalidRequestError(f"n must be >= 1 (got {n})", param="n")
        rids = []
        for i in range(n):
            p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            rids.append(self.engine.add_request(ids, p, stream=stream))
        return rids

    # ---------------------------------------------------------------------------------------------- TP ranks
    def follow(self) -> None:
        """On a non-first TP rank: run the first rank's steps until it calls :meth:`shutdown`."""
        self.runner.follow()

    def shutdown(self) -> None:
        """On the first TP rank: release the other ranks from :meth:`follow`."""
        self.runner.stop_followers()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    return list(params)
