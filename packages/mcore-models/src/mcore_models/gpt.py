"""``GPTModel``: embedding → transformer layers → final norm → output layer → loss or logits.

One class serves every pipeline stage: ``pre_process`` builds the embedding (first stage), ``post_process`` the final
norm and output layer (last stage), and ``layers`` says which global layer numbers this stage holds. Parameter names
use global layer numbers (``decoder.layers.7.mlp.linear_fc1.weight``), so they do not change with TP or PP, and each
parameter is drawn from a seed derived from its name, so the unsharded weights do not depend on the layout either.
On a stage without ``pre_process`` the input hidden states come from :meth:`set_input_tensor` (the pipeline schedule
calls it). Activations inside are ``[sequence, batch, hidden]``; inputs and outputs are batch-first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.backends import check_backend_device, layer_spec, output_linear
from mcore_models.config import TransformerConfig
from mcore_models.embedding import LanguageModelEmbedding
from mcore_models.hybrid import hybrid_spec
from mcore_models.spec import LayerSpec, default_spec
from mcore_models.transformer.attention import InferenceContext
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.layer import TransformerLayer
from mcore_models.transformer.packed import DocumentMask, document_mask, document_positions, mask_kwargs
from mcore_models.transformer.rope import RotaryEmbedding
from mcore_parallel import Group, ShardedTensor, shard_info
from mcore_parallel.fp8 import DelayedScaling
from mcore_parallel.tensor import (
    RNGStatesTracker,
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    linear_vocab_parallel_cross_entropy,
    normal_init,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
)

__all__ = ["GPTModel"]

EMBEDDING_KEY = "embedding.word_embeddings.weight"
_FUSED_LOSS_CHUNK_ELEMENTS = 1 << 27
"""Logits per chunk of the fused loss (128 M: 512 MB in float32, whatever the vocabulary)."""


class GPTModel(nn.Module):
    """A GPT-style decoder (GPT-2 and Llama families), tensor/sequence-parallel and pipeline-stage aware."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        tp: Group | None = None,
        sequence_parallel: bool = False,
        pre_process: bool = True,
        post_process: bool = True,
        layers: range | None = None,
        spec: LayerSpec | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
        ep: Group | None = None,
        expert_tp: Group | None = None,
        balance: Group | None = None,
    ) -> None:
        """``ep``, ``expert_tp``, ``balance``: the groups of the MoE layers (see
        :class:`~mcore_models.transformer.context.ModelContext`; one-member groups when not given)."""
        super().__init__()
        tp = tp or Group.single("tp")
        config.check_parallel(tp.size)
        check_backend_device(config, device)
        layers = range(config.num_layers) if layers is None else layers
        if layers.step != 1 or layers.start < 0 or layers.stop > config.num_layers:
            raise ValueError(f"layers={layers} must be a contiguous range inside [0, {config.num_layers})")
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        self.layer_numbers = layers
        self.ctx = ModelContext(tp, sequence_parallel and tp.size > 1, rng_tracker, device, config.seed, ep=ep,
                                expert_tp=expert_tp, balance=balance)  # fmt: skip
        spec = spec or default_spec()
        if config.hybrid_pattern is not None and spec.layer is TransformerLayer:  # layers from the pattern
            spec = hybrid_spec(spec)
        self.padded_vocab_size = padded_vocab_size(config.vocab_size, tp.size, config.make_vocab_size_divisible_by)
        self.input_tensor: torch.Tensor | None = None

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.ctx)
        self.rotary: RotaryEmbedding | None = None
        if config.position_embedding == "rope":
            rot = int(config.head_dim * config.rotary_percent)
            self.rotary = RotaryEmbedding(rot, config.rotary_base, config.rope_scaling, device)
        specs = {i: layer_spec(spec, config, i) for i in layers}  # the backend's classes (mcore_models.backends)
        self.decoder = TransformerBlock(
            {str(i): specs[i].layer(config, self.ctx, specs[i], i, f"decoder.layers.{i}") for i in layers},
            spec.norm(config, config.hidden_size, device, self.ctx.sequence_parallel) if post_process else None,
        )
        if post_process:
            tied = config.share_embeddings_and_output_weights
            self.output_layer = output_linear(config)(  # (FP8 with output in fp8_modules)
                config.hidden_size,
                self.padded_vocab_size,
                tp=tp,
                bias=False,
                sequence_parallel=self.ctx.sequence_parallel,
                pad_rows=self.padded_vocab_size - config.vocab_size,
                skip_weight_allocation=tied and pre_process,
                init_method=normal_init(config.init_method_std),
                seed=self.ctx.seed_for(EMBEDDING_KEY if tied else "output_layer.weight"),
                dtype=config.dtype,
                device=device,
            )
            if tied and not pre_process:  # a copy of the first stage's embedding, kept in sync by the runtime
                self.output_layer.weight.shared_embedding = True  # type: ignore[union-attr]
        if pre_process and not post_process and config.share_embeddings_and_output_weights:
            self.embedding.word_embeddings.weight.shared_embedding = True  # type: ignore[attr-defined]
        self._full_recompute = self._recompute_set(config) if config.recompute == "full" else set()
        if config.recompute_mlp:  # the MLPs of the first recompute_num_layers layers (all by default)
            recomputed = self._recompute_set(config)
            for key, layer in self.decoder.layers.items():
                if hasattr(layer, "recompute_mlp"):
                    layer.recompute_mlp = bool(layer.recompute_mlp) and int(key) in recomputed  # type: ignore[assignment]
        self._compiled_loss: Any = None  # set by compile_layers (one tensor-parallel rank)
        self._fused_vocab_loss = False  # set by compile_layers (several tensor-parallel ranks)

    def _recompute_set(self, config: TransformerConfig) -> set[int]:
        """The layer numbers recompute covers: the stage's first ``recompute_num_layers`` (None = all)."""
        n = len(self.layer_numbers) if config.recompute_num_layers is None else config.recompute_num_layers
        return set(list(self.layer_numbers)[:n])

    # ----------------------------------------------------------------------------------------------- forward
    def compile_layers(self, dynamic: bool = False, mode: str | None = None) -> None:
        """``torch.compile`` each transformer layer in place (names, checkpoints and the layer objects unchanged).

        Fuses the elementwise work between matmuls (norms, RoPE, SwiGLU, residual adds). Layers of one shape share
        the compiled code. ``dynamic=True`` keeps the token count symbolic (every step a different shape);
        ``mode`` is ``torch.compile``'s (e.g. ``max-autotune-no-cudagraphs``).
        """
        for layer in self.decoder.layers.values():
            layer.compile(dynamic=dynamic, mode=mode)
        if self.post_process and self.ctx.tp.size == 1 and not dynamic:
            # the unfused loss on one tensor-parallel rank: one fused pass over the bf16 logits each way instead of
            # ~8 eager float32 passes (and no float32 softmax kept for backward)
            self._compiled_loss = torch.compile(_token_cross_entropy, dynamic=False)
        elif self.post_process and not dynamic:
            # vocabulary-parallel: the same in three compiled passes with the all-reduces between them
            self._fused_vocab_loss = True

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states from the previous pipeline stage (``[s (/ tp), b, hidden]``)."""
        self.input_tensor = tensor

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        gather_logits: bool = False,
        inference_context: InferenceContext | None = None,
        document_ids: torch.Tensor | DocumentMask | None = None,
        decoder_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage: :meth:`embed`, each layer in turn, then (last stage) :meth:`head`.

        ``input_ids``, ``position_ids``, ``labels``: ``[b, s]``. Returns, on the last stage, the per-token loss
        ``[b, s]`` (float32) when ``labels`` are given, else logits ``[b, s, vocab / tp]`` (``[b, s, vocab]`` with
        ``gather_logits``); on other stages the hidden states ``[s (/ tp), b, hidden]`` for the next stage.

        ``inference_context`` (an engine's :class:`InferenceContext`, batch 1 of flat tokens) makes attention read
        and write the engine's KV cache; only the rows in its ``logits_index`` get logits.

        ``document_ids`` (packed sequences): the document id of every token ``[b, s]``, or a
        :class:`~mcore_models.transformer.packed.DocumentMask` made from them; attention stays inside each document,
        and without ``position_ids`` the positions restart at every document.

        ``decoder_input``: the first layer's input ``[s (/ tp under SP), b, hidden]`` in place of the embedding of
        ``input_ids`` (which may then be None), e.g. word embeddings with image embeddings spliced in
        (:class:`~mcore_models.multimodal.LlavaModel`); Megatron-Core's argument of the same name.
        """
        mask = self._document_mask(document_ids, inference_context)
        if mask is not None and position_ids is None:
            position_ids = document_positions(mask.document_ids)
        hidden, rotary = self.embed(input_ids, position_ids, decoder_input=decoder_input)
        hidden = self._run_layers(hidden, rotary, mask, inference_context)
        if not self.post_process:
            return hidden
        if inference_context is not None and inference_context.logits_index is not None:
            hidden = hidden.index_select(0, inference_context.logits_index)
        return self.head(hidden, labels, gather_logits=gather_logits)

    def _run_layers(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        mask: DocumentMask | None,
        inference_context: InferenceContext | None,
    ) -> torch.Tensor:
        """This stage's layers in order. With ``defer_residual_add`` (no inference context), a transformer layer
        followed by another leaves its last residual add to it (``TransformerLayer.forward``'s ``pending`` and
        ``defer``); a layer of another kind, or one recomputed whole, gets the sum."""
        layers = list(self.decoder.layers.items())
        recomputed = [inference_context is None and self.training and int(key) in self._full_recompute
                      for key, _ in layers]  # fmt: skip
        takes = [self.config.defer_residual_add and inference_context is None and isinstance(layer, TransformerLayer)
                 and not again for (_, layer), again in zip(layers, recomputed)]  # fmt: skip
        pending: torch.Tensor | None = None
        for i, (key, layer) in enumerate(layers):
            if inference_context is not None:
                inference_context.layer_number = int(key)  # read by its attention (see InferenceContext)
            if pending is not None and not takes[i]:
                hidden, pending = hidden + pending, None
            if recomputed[i]:
                hidden = self.ctx.recompute(_LayerCall(layer, mask), hidden, *(rotary or ()))
            elif takes[i]:
                defer = i + 1 < len(layers) and takes[i + 1]
                out = layer(hidden, rotary, None, **mask_kwargs(mask), pending=pending, defer=defer)
                hidden, pending = out if defer else (out, None)
            else:
                hidden = layer(hidden, rotary, inference_context, **mask_kwargs(mask))
        return hidden if pending is None else hidden + pending

    def _document_mask(
        self, document_ids: torch.Tensor | DocumentMask | None, inference_context: InferenceContext | None
    ) -> DocumentMask | None:
        if document_ids is None:
            return None
        if inference_context is not None:
            raise ValueError("document_ids (packed sequences) are for training; an inference context was given too")
        if "M" in (self.config.hybrid_pattern or ""):
            raise ValueError(
                "packed sequences (document_ids) with Mamba layers: the scan would carry state across documents; "
                "train this hybrid_pattern unpacked"
            )
        return document_ids if isinstance(document_ids, DocumentMask) else document_mask(document_ids)

    def embed(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        *,
        decoder_input: torch.Tensor | None = None,
        rotary: nn.Module | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The first layer's input ``[s (/ tp), b, hidden]`` (``decoder_input`` when given, else the embedding on the
        first stage, else the tensor of :meth:`set_input_tensor`) and the rotary tables ``(cos, sin)`` of the
        positions (None without RoPE), from ``rotary`` when given (called as the model's ``RotaryEmbedding`` is:
        a serving engine's precomputed table), else from the model's."""
        if decoder_input is not None:
            hidden = decoder_input
            s = hidden.shape[0] * (self.ctx.tp.size if self.ctx.sequence_parallel else 1)
            pos = self._positions(position_ids, s, hidden.device)
        elif self.pre_process:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids")
            s = input_ids.shape[1]
            pos = self._positions(position_ids, s, input_ids.device)
            hidden = self.embedding(input_ids.t(), pos)
        else:
            if self.input_tensor is None:
                raise RuntimeError("set_input_tensor() was not called on a stage without pre_process")
            hidden = self.input_tensor
            s = hidden.shape[0] * (self.ctx.tp.size if self.ctx.sequence_parallel else 1)
            pos = self._positions(position_ids, s, hidden.device)
        if self.rotary is None:
            return hidden, None
        return hidden, (rotary if rotary is not None else self.rotary)(pos, hidden.dtype)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer's weight ``[vocab / tp, hidden]`` (the embedding's when they are tied)."""
        w = self.output_layer.weight
        if w is None:
            w = self.embedding.word_embeddings.weight
        assert w is not None
        return w

    def head(
        self, hidden: torch.Tensor, labels: torch.Tensor | None = None, *, gather_logits: bool = False
    ) -> torch.Tensor:
        """The last stage's final norm, output layer and loss over the last layer's output ``[s, b, hidden]``: the
        per-token loss ``[b, s]`` with ``labels``, else the logits (see :meth:`forward`)."""
        assert self.decoder.final_layernorm is not None
        hidden = self.decoder.final_layernorm(hidden)
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        if labels is not None and self.config.cross_entropy_fusion:
            return self._fused_loss(hidden, weight, labels)
        logits = self.output_layer(hidden, weight=weight)  # [s, b, V / tp]
        return self.finish_logits(logits, labels, gather_logits=gather_logits)

    def finish_logits(
        self, logits: torch.Tensor, labels: torch.Tensor | None = None, *, gather_logits: bool = False
    ) -> torch.Tensor:
        """The output layer's logits ``[s, b, vocab / tp]`` as :meth:`forward` returns them: batch-first (gathered
        over the TP group and unpadded with ``gather_logits``), or the per-token loss ``[b, s]`` with ``labels``."""
        if labels is None:
            if gather_logits:
                logits = gather_from_tp_region(logits, self.ctx.tp)[..., : self.config.vocab_size]
            return logits.transpose(0, 1)
        if self._compiled_loss is not None and self.training:
            return self._compiled_loss(logits, labels.t(), self.config.vocab_size).t()
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.ctx.tp, vocab_size=self.config.vocab_size,
                                            fused=self._fused_vocab_loss and self.training)  # fmt: skip
        return loss.t()

    def _fused_loss(self, hidden: torch.Tensor, weight: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[b, s]`` with the output projection and cross-entropy fused chunk by chunk."""
        tp = self.ctx.tp
        w = self.output_layer.weight if weight is None else weight
        assert w is not None
        if self.ctx.sequence_parallel:
            hidden = gather_from_sp_region(hidden, tp, tensor_parallel_output_grad=True)
        else:
            hidden = copy_to_tp_region(hidden, tp)
        chunk = max(1, _FUSED_LOSS_CHUNK_ELEMENTS // w.shape[0])
        loss = linear_vocab_parallel_cross_entropy(hidden, w, labels.t(), tp, vocab_size=self.config.vocab_size,
                                                   chunk_tokens=chunk)  # fmt: skip
        return loss.t()

    def _positions(self, position_ids: torch.Tensor | None, s: int, device: torch.device) -> torch.Tensor:
        if position_ids is None:
            return torch.arange(s, device=device)[:, None]
        return position_ids.t()

    # ---------------------------------------------------------------------------------------- state handling
    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """Every parameter as its piece of the global (unsharded, unpadded) tensor, keyed by a stable name.

        A last stage's copy of a tied embedding is listed under the embedding's key as a replica.
        """
        out: dict[str, ShardedTensor] = {}
        for name, param in self.named_parameters():
            if getattr(param, "shared_embedding", False) and name == "output_layer.weight":
                info = shard_info(EMBEDDING_KEY, param, self.ctx.tp)
                out[f"{EMBEDDING_KEY}@output"] = ShardedTensor(
                    EMBEDDING_KEY, info.local, info.global_shape, info.pieces, replica=True
                )
                continue
            group = self.ctx.expert_tensor_parallel if getattr(param, "expert_parallel", False) else self.ctx.tp
            out[name] = shard_info(name, param, group)
        return out

    def runtime_state_dict(self) -> dict[str, ShardedTensor]:
        """The state beyond the parameters that a training checkpoint keeps: the FP8 backend's delayed-scaling
        buffers (amax histories and scales, ``...linear_qkv.fp8_scaling.amax_history``). Each is the same on every
        rank of the stage (the step reduces it), so it is saved once as a replicated array and loads at any layout;
        each is optional, so a checkpoint without it (another backend or recipe) loads and leaves it fresh."""
        out: dict[str, ShardedTensor] = {}
        for name, module in self.named_modules():
            if isinstance(module, DelayedScaling):
                for buf_name, buf in module.saved_buffers().items():
                    key = f"{name}.{buf_name}"
                    out[key] = dataclasses.replace(shard_info(key, buf, self.ctx.tp), optional=True)
        return out

    def load_global_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's pieces from global tensors (e.g. a converted Hugging Face state dict)."""
        mine = self.sharded_state_dict()
        wanted = {info.key for info in mine.values()}
        missing = sorted(wanted - set(state))
        unexpected = sorted(set(state) - wanted)
        if strict and (missing or unexpected):
            raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for info in mine.values():
            if info.key in state:
                info.load_from(state[info.key].to(info.local.device))

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """Gather every parameter of this stage into its global tensor (all TP ranks must call; small models)."""
        out = {}
        for info in self.sharded_state_dict().values():
            if info.key in out:
                continue
            full = torch.zeros(info.global_shape, dtype=info.local.dtype, device=info.local.device)
            info.scatter_into(full)
            expert = getattr(info.local, "expert_parallel", False)
            tp = self.ctx.expert_tensor_parallel if expert else self.ctx.tp
            if tp.size > 1 and getattr(info.local, "tensor_model_parallel", False):
                torch.distributed.all_reduce(full, group=tp.pg)
            if expert and self.ctx.expert_parallel.size > 1:  # each ep rank holds other experts
                torch.distributed.all_reduce(full, group=self.ctx.expert_parallel.pg)
            out[info.key] = full
        return out


class TransformerBlock(nn.Module):
    """This stage's layers, keyed by global layer number, and (on the last stage) the final norm."""

    def __init__(self, layers: dict[str, nn.Module], final_layernorm: nn.Module | None) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(layers)
        self.final_layernorm = final_layernorm


def _token_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token float32 cross-entropy of ``logits[..., :vocab_size]`` (the unpadded vocabulary) and ``target``."""
    x = logits[..., :vocab_size].float()
    loss = F.cross_entropy(x.reshape(-1, vocab_size), target.reshape(-1), reduction="none")
    return loss.view(target.shape)


class _LayerCall:
    """``layer(hidden, (cos, sin))`` with the rotary tables as separate tensors, as checkpointing needs (and a packed
    micro-batch's document mask)."""

    def __init__(self, layer: nn.Module, document_mask: DocumentMask | None = None) -> None:
        self.layer, self.document_mask = layer, document_mask

    def __call__(self, hidden: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        rot = (rotary[0], rotary[1]) if rotary else None
        return self.layer(hidden, rot, **mask_kwargs(self.document_mask))
