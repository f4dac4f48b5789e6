"""Triton helpers shared by the kernels that take the residual add and RMSNorm before their weight-streaming loop
(:mod:`~mcore_infer.kernels.fused_mlp`, :mod:`~mcore_infer.kernels.norm_gemv`), and :func:`row_operands`, their
inputs as the kernels read them.

Triton resolves the functions a kernel calls among the globals of the kernel's module: :func:`install` puts the
helpers there (once Triton is imported, from the module's kernel factory)."""

from __future__ import annotations

from typing import Any

import torch

_HELPERS: dict[str, Any] = {}


def row_operands(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Size, bool]:
    """``(x2, r2, shape, parts)``: ``x`` as ``[splits, rows, width]`` (one split unless it is the float32 partial
    sums of ``residual``, ``parts``) with unit stride, the residual as ``[rows, width]`` (no residual: ``x2[0]``),
    and the rows' shape."""
    shape = x.shape if residual is None else residual.shape
    width = shape[-1]
    rows = int(torch.Size(shape).numel()) // width
    parts = residual is not None and x.dim() == residual.dim() + 1
    x2 = x.reshape(x.shape[0] if parts else 1, rows, width)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = x2[0] if residual is None else residual.reshape(rows, width).contiguous()
    return x2, r2, shape, parts


def install(module_globals: dict[str, Any]) -> None:
    """Define the helpers (once) and add them to ``module_globals`` (a kernel module's ``globals()``)."""
    if not _HELPERS:
        _HELPERS.update(_define())
    module_globals.update(_HELPERS)


def _define() -> dict[str, Any]:
    import triton
    import triton.language as tl

    globals()["tl"] = tl  # (Triton's interpreter looks for triton.language among a jit function's globals)

    @triton.jit  # type: ignore[misc]
    def _residual_sum(X, R, rows, cols, M, H, stride_xs, stride_xm, stride_rm, dtype,  # type: ignore[no-untyped-def]
                      SPLITS: tl.constexpr, PARTS: tl.constexpr):  # fmt: skip
        """``h = x + residual`` at ``cols`` of ``rows``, rounded to ``dtype`` once (float32 partial sums of x
        added in float32), as float32."""
        m2 = (rows[:, None] < M) & (cols[None, :] < H)
        h = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if PARTS:
            for sp in range(SPLITS):
                h += tl.load(X + sp * stride_xs + rows[:, None] * stride_xm + cols[None, :], mask=m2, other=0.0)
        else:
            h += tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        return h.to(dtype).to(tl.float32)

    @triton.jit  # type: ignore[misc]
    def _input_tile(X, R, NW, inv, rows, ks, M, H, stride_xs, stride_xm, stride_rm, dtype,  # type: ignore[no-untyped-def]
                    SPLITS: tl.constexpr, PARTS: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
        """The input at ``ks`` of ``rows`` as float32: X itself, or with ``NORM`` the residual sum normalised by
        ``inv`` (each row's 1 / rms) and scaled by the norm weight, rounded as ``F.rms_norm`` rounds."""
        if NORM:
            h = _residual_sum(X, R, rows, ks, M, H, stride_xs, stride_xm, stride_rm, dtype, SPLITS, PARTS)
            nw = tl.load(NW + ks, mask=ks < H, other=0.0).to(tl.float32)
            x = ((h * inv[:, None]).to(dtype).to(tl.float32) * nw[None, :]).to(dtype).to(tl.float32)
        else:
            x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < H),
                        other=0.0).to(tl.float32)  # fmt: skip
        return x

    @triton.jit  # type: ignore[misc]
    def _row_stats(X, R, rows, d, M, H, eps, stride_xs, stride_xm, stride_rm, dtype,  # type: ignore[no-untyped-def]
                   SPLITS: tl.constexpr, PARTS: tl.constexpr):  # fmt: skip
        """``(1 / rms, h)`` of each row of ``h = x + residual`` over the whole row (``d``: every column, padded)."""
        h = _residual_sum(X, R, rows, d, M, H, stride_xs, stride_xm, stride_rm, dtype, SPLITS, PARTS)
        return 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / H + eps), h

    helpers = {"_residual_sum": _residual_sum, "_input_tile": _input_tile, "_row_stats": _row_stats}
    globals().update(helpers)  # (the helpers call each other: they are looked up among this module's globals)
    return helpers
