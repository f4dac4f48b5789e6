"""RMSNorm fused into the linear layer that follows it, for steps of a few rows (batch-1 decoding).

A decode step of one request multiplies a single row by each weight matrix: the GEMM is bound by reading the weight
(a few µs), and the norm in front of it is a kernel of its own that costs about as much as a small GEMM. One Triton
kernel does both, plus the residual add in front of the norm and, for a gated MLP, the SwiGLU after the up
projection::

    h = x + residual                               (rounded to x's dtype, as the unfused add)
    y = rms_norm(h, norm_weight, eps) @ weightᵀ    (computed as (1 / rms(h)) * ((h * norm_weight) @ weightᵀ))
    y = silu(y_gate) * y_up                        (``swiglu``: weight is [gate; up]; each half rounded first)

and returns ``(y, h)`` (``h`` is the next residual). Every program streams ``BLOCK_N`` output rows of the weight
(both halves for SwiGLU) in one pass over the input: the row's scale 1 / rms(h) is the same for every output, so
it multiplies the finished dot products, and the sum of squares is taken from the same loads (a first pass for
the norm cost ~4 µs a call on an H200, more than the norm kernel it replaced). It is registered as the custom op
``mcore_models::norm_linear``, so a compiled layer keeps it in its graph; without Triton, or on the CPU outside
``TRITON_INTERPRET=1``, the op computes the same with PyTorch ops.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["MAX_ROWS", "norm_linear", "norm_linear_reference"]

MAX_ROWS = 16  # rows the kernel takes (one MMA tile of rows); more rows are a GEMM's job
_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def norm_gemv(  # type: ignore[no-untyped-def]
        X,
        R,
        H,
        G,
        W,
        Y,
        M,
        N,
        K,
        eps,
        stride_x,
        stride_r,
        stride_h,
        stride_w,
        stride_y,
        HAS_RES: tl.constexpr,
        SWIGLU: tl.constexpr,
        M_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        dtype = Y.dtype.element_ty
        rows = tl.arange(0, M_PAD)
        rmask = rows < M
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        # one pass: W (h * g) and the rows' sums of squares together; the per-row 1 / rms is applied at the end,
        # so no program waits for a norm before streaming its weights
        sq = tl.zeros([M_PAD], tl.float32)  # per-row sums of squares (a [M_PAD, BLOCK_K] accumulator costs registers)
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            m2 = rmask[:, None] & kmask[None, :]
            wmask = nmask[:, None] & kmask[None, :]
            w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=wmask, other=0.0)
            if SWIGLU:
                wu = tl.load(W + (cols[:, None] + N) * stride_w + ks[None, :], mask=wmask, other=0.0)
            h = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=m2, other=0.0)
            if HAS_RES:
                h = h + tl.load(R + rows[:, None] * stride_r + ks[None, :], mask=m2, other=0.0)
            tl.store(H + rows[:, None] * stride_h + ks[None, :], h, mask=m2 & (pid == 0))
            hf = h.to(tl.float32)
            sq += tl.sum(hf * hf, axis=1)
            g = tl.load(G + ks, mask=kmask, other=0.0).to(tl.float32)
            hg = (hf * g[None, :]).to(dtype)
            if IEEE:
                acc += tl.dot(hg, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(hg, tl.trans(w))
            if SWIGLU:
                if IEEE:
                    acc_up += tl.dot(hg, tl.trans(wu), input_precision="ieee")
                else:
                    acc_up += tl.dot(hg, tl.trans(wu))
        rstd = 1.0 / tl.sqrt(sq / K + eps)
        acc = acc * rstd[:, None]
        if SWIGLU:
            gate = acc.to(dtype).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            out = act * (acc_up * rstd[:, None]).to(dtype).to(tl.float32)
        else:
            out = acc
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], out.to(dtype), mask=rmask[:, None] & nmask[None, :])

    _KERNEL = norm_gemv
    return _KERNEL


def _use_triton(x: torch.Tensor) -> bool:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False  # float64 (reference checks) takes the PyTorch path
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# (rows per program, warps) forced by a benchmark sweep (``bench/gemv_bench.py --norm-linear``); None: heuristic
_LAUNCH_OVERRIDE: tuple[int, int] | None = None


def _launch_config(n: int, sms: int) -> tuple[int, int]:
    """(output rows per program, warps): 32 rows, or 16 when that leaves fewer than two programs per SM; 4 warps."""
    if _LAUNCH_OVERRIDE is not None:
        return _LAUNCH_OVERRIDE
    return (32 if -(-n // 32) >= 2 * sms else 16), 4


def norm_linear_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    swiglu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation (PyTorch ops): what the kernel must equal."""
    h = x if residual is None else x + residual
    y = F.linear(F.rms_norm(h, norm_weight.shape, norm_weight, eps), weight)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y, h.clone() if residual is None else h


@torch.library.custom_op("mcore_models::norm_linear", mutates_args=())
def _norm_linear_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    swiglu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_triton(x):
        return norm_linear_reference(x, residual, norm_weight, eps, weight, swiglu)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = x2 if residual is None else residual.reshape(-1, k)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    h = torch.empty(m, k, dtype=x.dtype, device=x.device)
    if m:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        block_n, warps = _launch_config(n, sms)
        _kernel()[(-(-n // block_n),)](
            x2,
            r2,
            h,
            norm_weight,
            weight,
            y,
            m,
            n,
            k,
            eps,
            x2.stride(0),
            r2.stride(0),
            h.stride(0),
            weight.stride(0),
            y.stride(0),
            HAS_RES=residual is not None,
            SWIGLU=swiglu,
            M_PAD=16,
            BLOCK_N=block_n,
            BLOCK_K=256 if k >= 256 else 64,
            IEEE=x.dtype == torch.float32,
            num_warps=warps,
        )
    return y.view(*x.shape[:-1], n), h.view(x.shape)


@_norm_linear_op.register_fake
def _(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    swiglu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return x.new_empty(*x.shape[:-1], n), x.new_empty(x.shape)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    swiglu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` as in the module docstring, for ``x`` (and ``residual``) ``[..., K]`` of at most :data:`MAX_ROWS`
    rows, ``weight`` ``[N, K]`` (``[2N, K]``, gate rows first, with ``swiglu``), no bias. Inference only."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows > MAX_ROWS:
        raise ValueError(f"norm_linear takes at most {MAX_ROWS} rows, got {rows}: use the norm and a GEMM")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"norm_linear(swiglu=True) needs [gate; up] weight rows, got {weight.shape[0]} (odd)")
    result: tuple[torch.Tensor, torch.Tensor] = _norm_linear_op(x, residual, norm_weight, eps, weight, swiglu)
    return result
