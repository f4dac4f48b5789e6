"""Self-attention: fused QKV projection in Megatron's grouped layout, RoPE, GQA, causal SDPA, output projection.

The fused QKV weight is ``[(heads + 2 * groups) * head_dim, hidden]`` laid out group by group: for each key/value
group, its query heads, then its key head, then its value head. Splitting it into equal row chunks gives each TP
rank whole groups, so no communication is needed inside attention.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mcore_models.config import TransformerConfig
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.norm import build_norm
from mcore_models.transformer.packed import DocumentMask, document_attention
from mcore_models.transformer.qkv_rope import qkv_rope
from mcore_models.transformer.rope import apply_rotary
from mcore_parallel.tensor import normal_init, scaled_normal_init

if TYPE_CHECKING:
    from mcore_models.spec import LayerSpec

__all__ = ["InferenceContext", "SelfAttention", "SDPACoreAttention"]

Rotary = tuple[torch.Tensor, torch.Tensor] | None
"""The rotary tables ``(cos, sin)`` of a step's positions, or None (no RoPE)."""

_TORCH_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)
_SDPA_BACKENDS: dict[str, list[SDPBackend] | None] = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


class InferenceContext(Protocol):
    """What an inference engine passes through ``GPTModel.forward`` to run attention over its KV cache.

    The tokens of one step are laid out as one flat sequence (``[s, 1, ...]``); the context knows which request each
    token belongs to, its position, and where its key/value go in the cache. ``attention`` stores this step's
    keys/values for the current layer and returns attention over each token's request cache (``[s, 1, heads * d]``).
    ``logits_index`` (or None for all) names the tokens whose logits the caller needs.

    ``GPTModel.forward`` sets ``layer_number`` before calling each layer, and ``attention`` reads it at call time:
    the layer number never appears inside a layer's own code, so ``torch.compile`` shares one compiled layer across
    all layers of a shape instead of specialising (and recompiling) on each layer's number.

    A context with a true ``fuses_rotary`` attribute applies RoPE itself: it receives the unrotated queries grouped
    as ``[s, 1, groups, heads / groups, d]``, the unrotated keys and ``rotary=(cos, sin)``.
    """

    logits_index: torch.Tensor | None
    layer_number: int

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...


class SDPACoreAttention(nn.Module):
    """Causal (with ``attention_causal=False``: bidirectional) scaled-dot-product attention over ``[s, b, heads, d]``
    queries and ``[s, b, groups, d]`` keys/values.

    Uses ``F.scaled_dot_product_attention`` (flash / cuDNN / memory-efficient kernels on GPU) with native GQA when
    the installed torch has it.
    """

    def __init__(self, config: TransformerConfig, ctx: ModelContext) -> None:
        super().__init__()
        self.dropout, self.ctx = config.attention_dropout, ctx
        self.backends = _SDPA_BACKENDS[config.attention_backend]
        # torch's memory-efficient kernel takes no grouped keys/values (enable_gqa): they are repeated for it
        self.native_gqa = _TORCH_GQA and config.attention_backend != "efficient"
        self.contiguous = config.attention_contiguous
        self.causal = config.attention_causal

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_mask: DocumentMask | None = None
    ) -> torch.Tensor:
        if document_mask is not None:
            return self._packed(q, k, v, document_mask)
        s, b, heads, d = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        if self.contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        p = self.dropout if self.training else 0.0
        kwargs: dict[str, Any] = {}
        if k.shape[1] != heads:
            if self.native_gqa:
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(heads // k.shape[1], dim=1)
                v = v.repeat_interleave(heads // v.shape[1], dim=1)
        backend = sdpa_kernel(self.backends) if self.backends is not None and q.is_cuda else nullcontext()
        with self.ctx.model_parallel_rng() if p > 0 else nullcontext(), backend:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal, **kwargs)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)

    def _packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
        """Packed sequences: causal attention inside each document of the row (:mod:`~.packed`)."""
        if not self.causal:
            raise ValueError("packed sequences (document_mask) need causal attention; attention_causal is false")
        s, b, heads, d = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        p = self.dropout if self.training else 0.0
        gqa = k.shape[1] != heads
        if gqa and not self.native_gqa:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
            gqa = False
        with self.ctx.model_parallel_rng() if p > 0 else nullcontext():
            out = document_attention(q, k, v, mask, dropout_p=p, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


class SelfAttention(nn.Module):
    def __init__(
        self, config: TransformerConfig, ctx: ModelContext, spec: LayerSpec, prefix: str, selective_recompute: bool
    ) -> None:
        super().__init__()
        tp = ctx.tp
        self.ctx, self.selective_recompute = ctx, selective_recompute
        self.heads = config.num_attention_heads // tp.size
        self.groups = config.query_groups // tp.size
        self.head_dim = config.head_dim
        qkv_out = (config.num_attention_heads + 2 * config.query_groups) * self.head_dim
        common = dict(tp=tp, sequence_parallel=ctx.sequence_parallel, dtype=config.dtype, device=ctx.device)
        self.linear_qkv = spec.column_linear(
            config.hidden_size,
            qkv_out,
            bias=config.qkv_bias,
            init_method=normal_init(config.init_method_std),
            seed=ctx.seed_for(f"{prefix}.linear_qkv.weight"),
            **common,
        )
        if config.qk_layernorm:
            # each TP rank normalises only its own heads, so these replicated weights get partial gradients:
            # mark them like sequence-parallel parameters, whose gradients are summed over the TP group
            self.q_layernorm = build_norm(config, self.head_dim, ctx.device, sequence_parallel=tp.size > 1)
            self.k_layernorm = build_norm(config, self.head_dim, ctx.device, sequence_parallel=tp.size > 1)
        else:
            self.q_layernorm = self.k_layernorm = None  # type: ignore[assignment]
        self.core_attention = spec.core_attention(config, ctx)
        self.rope_kernel = config.rope_kernel == "triton"
        out_init = (
            scaled_normal_init(config.init_method_std, config.num_layers)
            if config.scaled_output_init
            else normal_init(config.init_method_std)
        )
        self.linear_proj = spec.row_linear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init_method=out_init,
            seed=ctx.seed_for(f"{prefix}.linear_proj.weight"),
            **common,
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        inference_context: InferenceContext | None = None,
        document_mask: DocumentMask | None = None,
    ) -> torch.Tensor:
        """``x`` ``[s, b, hidden]`` → the QKV projection, :meth:`attend`, the output projection (``document_mask``:
        packed sequences, attention inside each document only)."""
        return self.linear_proj(self.attend(self.linear_qkv(x), rotary, inference_context, document_mask))

    def attend(
        self,
        qkv: torch.Tensor,
        rotary: Rotary,
        inference_context: InferenceContext | None = None,
        document_mask: DocumentMask | None = None,
    ) -> torch.Tensor:
        """The attention between the two projections: the QKV projection's output ``[s, b, groups * (heads /
        groups + 2) * d]`` (this rank's groups) → ``[s, b, heads * d]``, the output projection's input. Splits q, k
        and v, applies q/k norms and RoPE, and runs causal attention, or ``inference_context.attention`` over an
        engine's KV cache."""
        s, b = qkv.shape[:2]
        per_group = self.heads // self.groups
        qkv = qkv.view(s, b, self.groups, per_group + 2, self.head_dim)
        v = qkv[:, :, :, per_group + 1]
        fused_rope = rotary is not None and self.q_layernorm is None
        if inference_context is not None and fused_rope and getattr(inference_context, "fuses_rotary", False):
            # the context's kernels read q/k/v in place and rotate q and k as they load them
            q_grouped, k = qkv[:, :, :, :per_group], qkv[:, :, :, per_group]
            return inference_context.attention(q_grouped, k, v, rotary=rotary)
        if rotary is not None and self.q_layernorm is None:
            cos, sin = rotary
            if self.rope_kernel and inference_context is None and cos.shape[-1] == self.head_dim:
                # training: split and rotate in one kernel each way (mcore_models.transformer.qkv_rope)
                q, k, v = qkv_rope(qkv.view(s, b, -1), cos, sin, self.groups, self.head_dim)
            else:
                # queries and keys of every group rotated together: one set of elementwise kernels instead of two
                qk = apply_rotary(qkv[:, :, :, : per_group + 1], cos[:, :, :, None], sin[:, :, :, None])
                q = qk[:, :, :, :per_group].reshape(s, b, self.heads, self.head_dim)
                k = qk[:, :, :, per_group]
        else:
            q = qkv[:, :, :, :per_group].reshape(s, b, self.heads, self.head_dim)
            k = qkv[:, :, :, per_group]
            if self.q_layernorm is not None:
                q, k = self.q_layernorm(q), self.k_layernorm(k)
            if rotary is not None:
                cos, sin = rotary
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if inference_context is not None:
            return inference_context.attention(q, k, v)
        if document_mask is not None:  # packed sequences: the core attention gets the documents' mask
            core = partial(self.core_attention, document_mask=document_mask)
            return self.ctx.recompute(core, q, k, v) if self.selective_recompute and self.training else core(q, k, v)
        if self.selective_recompute and self.training:
            return self.ctx.recompute(self.core_attention, q, k, v)
        return self.core_attention(q, k, v)
