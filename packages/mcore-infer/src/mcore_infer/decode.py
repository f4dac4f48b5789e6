"""The module that runs a model with a decode plan's fusions (:class:`DecodeModel`, :func:`prepare_for_decode`).

The plan itself, which serving-only fusions an engine's steps use, is :mod:`mcore_infer.decode_plan` (its names are
importable from here too).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mcore_infer.decode_layers import LAYER_FUSIONS, PlainDecodeLayer, fused_layer, missing_for_fusions, skipped_fusions
from mcore_infer.decode_plan import (
    DECODE_PRESETS,
    ROW_KERNELS,
    DecodeKernels,
    DecodeLaunches,
    DecodePlan,
    check_decode_kernels,
    parse_decode_kernels,
    requested_plan,
)
from mcore_infer.kernels.add_norm import add_rms_norm
from mcore_infer.kernels.argmax import row_argmax
from mcore_infer.kernels.embed_rope import embed_rope
from mcore_infer.kernels.norm_gemv import norm_row_linear
from mcore_infer.kernels.norm_linear import MAX_ROWS, norm_linear
from mcore_infer.kernels.small_gemv import FMA_MAX_ROWS, add_deferred
from mcore_infer.rope_table import RotaryTable
from mcore_models import GPTModel
from mcore_models.transformer.attention import InferenceContext
from mcore_models.transformer.norm import RMSNorm

__all__ = [
    "DECODE_PRESETS",
    "ROW_KERNELS",
    "DecodeKernels",
    "DecodeLaunches",
    "DecodeModel",
    "DecodePlan",
    "check_decode_kernels",
    "parse_decode_kernels",
    "prepare_for_decode",
    "requested_plan",
]

log = logging.getLogger(__name__)


class DecodeModel(nn.Module):
    """A model's inference forward with a decode plan's fusions; shares (never copies) the model's parameters.

    Called like ``GPTModel.forward`` with an inference context: ``decode(ids, positions, gather_logits=True,
    inference_context=ctx)`` returns logits ``[1, rows, vocab]``; ``decoder_input`` (``[tokens, 1, hidden]``, e.g.
    a VLM's word embeddings with image embeddings spliced in) replaces the embedding. ``plan`` is what applies (with ``auto``, a layer
    fusion is on where some layer takes it); each of ``layers`` is a :class:`~mcore_infer.decode_layers.
    FusedDecodeLayer`, a :class:`~mcore_infer.decode_layers.FusedMambaLayer` or a
    :class:`~mcore_infer.decode_layers.PlainDecodeLayer`.
    """

    def __init__(
        self,
        model: GPTModel,
        layers: dict[str, nn.Module],
        plan: DecodePlan,
        norm_linear_head: bool,
        norm_gemv_head: bool = False,
        rotary_table: RotaryTable | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.rotary_table = rotary_table  # the rotary tables of every position, gathered per step
        self.layers = nn.ModuleDict(layers)
        self.plan = plan
        self.norm_linear_head = norm_linear_head
        self.norm_gemv_head = norm_gemv_head  # the last add and the final norm inside the output layer's row GEMV

    def compile_layers(self, mode: str | None = None) -> None:
        """``torch.compile`` each wrapper (dynamic token count): a layer's work between its attention calls, with
        the previous layer's deferred residual add and its first norm, is one compiled graph. The caller's layers
        are not compiled."""
        for wrapper in self.layers.values():
            wrapper.compile(dynamic=True, mode=mode)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        gather_logits: bool = False,
        inference_context: InferenceContext,
        decoder_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx = inference_context
        hidden, rotary = self._embed(input_ids, position_ids, decoder_input)
        pending: torch.Tensor | None = None  # the last layer's residual, not added yet
        for key, layer in self.layers.items():
            ctx.layer_number = int(key)  # read by its attention (see InferenceContext)
            hidden, pending = layer(hidden, rotary, ctx, pending)
        logits = self._output(hidden, pending, ctx.logits_index, gather_logits)
        draw_into = getattr(ctx, "argmax_out", None)
        if draw_into is not None:  # (a decode graph's greedy draw: argmax_in_graph)
            row_argmax(logits[0, : draw_into.shape[0]], out=draw_into, pdl=self.plan.pdl)
        return logits

    def _embed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, decoder_input: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The first layer's input and the rotary rows: one kernel with ``embed_rope`` in small steps."""
        table = self.rotary_table
        small = input_ids.dim() == 2 and input_ids.shape[0] == 1 and input_ids.shape[1] <= FMA_MAX_ROWS
        emb: torch.Tensor = self.model.embedding.word_embeddings.weight
        fused = self.plan.embed_rope and small and decoder_input is None
        if fused and position_ids is not None and table is not None and table.cos.dtype == emb.dtype:
            return embed_rope(input_ids[0], position_ids[0], emb, table.cos, table.sin, self.plan.pdl)
        return self.model.embed(input_ids, position_ids, decoder_input=decoder_input, rotary=table)

    def _output(
        self, hidden: torch.Tensor, pending: torch.Tensor | None, index: torch.Tensor | None, gather_logits: bool
    ) -> torch.Tensor:
        """The logits of the rows ``index`` names (all: None) after the last layer's output ``hidden`` and its
        deferred residual ``pending``."""
        model = self.model
        norm: Any = model.decoder.final_layernorm
        rows = (pending if pending is not None else hidden).numel() // hidden.shape[-1]
        gemv_head = self.norm_gemv_head and rows <= FMA_MAX_ROWS
        pdl_head = self.plan.pdl and isinstance(norm, RMSNorm) and rows <= FMA_MAX_ROWS
        if gemv_head or pdl_head or (self.norm_linear_head and rows <= MAX_ROWS):
            # the last residual add, the final norm and the output layer in one kernel, or (pdl) the add and the norm
            # in one (rows are independent: the logits rows are selected first; the layer's output may be partial
            # sums [splits, *residual.shape])
            if index is not None:
                parts = pending is not None and hidden.dim() == pending.dim() + 1
                hidden = hidden.index_select(1 if parts else 0, index)
                pending = pending.index_select(0, index) if pending is not None else None
            w = model.output_weight
            if gemv_head:
                logits, _ = norm_row_linear(hidden, pending, norm.weight, norm.eps, w, None, self.plan.pdl)
            elif pdl_head:  # the last add and the final norm as the layers' norms run with pdl: one kernel
                hidden, _ = add_rms_norm(hidden, pending, norm.weight, norm.eps, pdl=True)
                logits = model.output_layer(hidden, weight=w)
            else:
                launch = self.plan.launches.norm_linear
                logits, _ = norm_linear(hidden, pending, norm.weight, norm.eps, w, launch=launch)
            return model.finish_logits(logits, gather_logits=gather_logits)
        if pending is not None:
            hidden = add_deferred(hidden, pending)
        if index is not None:
            hidden = hidden.index_select(0, index)
        return model.head(hidden, gather_logits=gather_logits)


def prepare_for_decode(
    model: GPTModel,
    plan: DecodeKernels | DecodePlan = "auto",
    *,
    device_type: str | None = None,
    backend: str = "plain",
    compiled: bool = False,
    max_positions: int | None = None,
) -> DecodeModel:
    """A :class:`DecodeModel` running ``model`` (whole, in eval mode) with ``plan`` (resolved by
    :func:`requested_plan` for ``device_type``, default the model's, the attention ``backend`` and whether the caller
    compiles the layers). Each layer gets the plan's fusions it can take, decided per layer: a fusion that does not
    concern a layer (the part it rewrites is of another type than the standard one, e.g. an MoE layer's ``mlp``:
    :func:`~mcore_infer.decode_layers.skipped_fusions`) stays off for it under any plan; with a strict plan
    (anything but ``auto``) a standard part that cannot take one raises a ValueError naming the layer and what it
    lacks. Nothing is set on ``model`` or its modules. ``max_positions``: the decode model gathers each step's
    rotary tables from a :class:`~mcore_infer.rope_table.RotaryTable` of that many positions (the same values the
    model's RoPE computes), for positions below it only."""
    if model.training:
        raise ValueError("prepare_for_decode needs a model in eval mode: call model.eval() first")
    if not (model.pre_process and model.post_process):
        raise ValueError("serving needs the whole model on each TP rank (pipeline stages are not supported)")
    device_type = device_type or next(model.parameters()).device.type
    wanted, strict = requested_plan(plan, device_type=device_type, backend=backend, compiled=compiled)
    wrappers: dict[str, nn.Module] = {}
    applied: dict[str, Any] = dict.fromkeys(LAYER_FUSIONS, False)
    off: dict[tuple[str, str], list[str]] = {}  # (fusion, why) -> the layers it stays off for
    for key, layer in model.decoder.layers.items():
        fusions = _layer_fusions(layer, f"decoder.layers.{key}", model, wanted, strict, off)
        fusions["pdl"] &= any(fusions[k] for k in ROW_KERNELS)  # (measured with the row kernels only)
        if any(fusions.values()):
            wrappers[key] = fused_layer(layer, fusions, wanted.launches)
        else:
            wrappers[key] = PlainDecodeLayer(layer)
        applied = {name: on or fusions[name] for name, on in applied.items()}
    for (fusion, why), keys in off.items():
        log.info("decode plan: %s stays off for layers %s: %s", fusion, ",".join(keys), why)
    resolved = replace(wanted, **applied)
    head = resolved.norm_linear and _norm_linear_head(model)
    gemv_head = resolved.norm_gemv and _norm_linear_head(model)
    table = None
    if max_positions and model.rotary is not None:
        table = RotaryTable(model.rotary, max_positions, model.embedding.word_embeddings.weight.dtype)
    embed_off = _embed_rope_off(model, table) if resolved.embed_rope else None
    if embed_off:
        log.info("decode plan: embed_rope stays off: %s", embed_off)
        resolved = replace(resolved, embed_rope=False)
    log.info("decode plan: %s", {k: v for k, v in resolved.to_dict().items() if v})
    return DecodeModel(model, wrappers, resolved, head, gemv_head, table)


def _embed_rope_off(model: GPTModel, table: RotaryTable | None) -> str | None:
    """Why the embedding and the rotary rows are not one gather kernel for ``model`` (None: they are). Like a layer
    fusion whose part is of another type, it is off under any plan where it does not concern the model (no RoPE
    table: a model without RoPE, or no ``max_positions``); the row kernels it comes with need tp=1 anyway."""
    if table is None:
        return "no rotary table (a model without RoPE, or no max_positions)"
    if model.ctx.tp.size != 1:
        return f"the embedding is split over tp={model.ctx.tp.size} ranks"
    if model.embedding.position_embeddings is not None:
        return "learned position embeddings"
    return None


def _layer_fusions(
    layer: nn.Module,
    name: str,
    model: GPTModel,
    wanted: DecodePlan,
    strict: bool,
    off: dict[tuple[str, str], list[str]],
) -> dict[str, bool]:
    """The fusions of ``wanted`` that ``layer`` takes; with ``strict``, a ValueError for any its standard parts cannot
    take. Each fusion it does not take is noted in ``off`` under its reason."""
    skipped = skipped_fusions(layer)
    missing = missing_for_fusions(layer, model.config, model.ctx.tp.size)
    fusions = wanted.layer_fusions
    for fusion, on in fusions.items():
        if not on:
            continue
        if fusion in skipped:
            why = f"{skipped[fusion]} (its own forward runs)"
        elif missing[fusion]:
            if strict:
                raise ValueError(
                    f"DecodePlan.{fusion} cannot apply to {name}: {'; '.join(missing[fusion])}; "
                    f"use a plan without {fusion} (or decode_kernels='auto') for this model"
                )
            why = "; ".join(missing[fusion])
        else:
            continue
        off.setdefault((fusion, why), []).append(name.rsplit(".", 1)[-1])
        fusions[fusion] = False
    return fusions


def _norm_linear_head(model: GPTModel) -> bool:
    """Whether the final norm and the output layer can run as one ``norm_linear`` (or ``norm_row_linear``) call."""
    head = model.output_layer
    return bool(
        head.bias is None
        and not head.gather_output
        and not head.sequence_parallel
        and isinstance(model.decoder.final_layernorm, RMSNorm)
    )
