"""Weight-streaming GEMMs of a few rows (batch-1 decoding), split over K, with SwiGLU folded into the loads.

A decode step multiplies one row (a few rows) by each weight matrix: the time is the weight's bytes over the
bandwidth the kernel reaches. A 2048-wide output in blocks of 32 features is 64 programs, half an H200's SMs, so the
kernel here also splits K: program ``(i, s)`` computes output features ``[i * BLOCK_N, ...)`` over the K range of
split ``s`` and writes float32 partial sums ``[splits, M, N]`` (one split writes the result in the output dtype).

:func:`swiglu_down` is the MLP's down projection of a gated MLP with its activation inside: it reads the up projection's
``[gate | up]`` output and computes ``silu(gate) * up`` (each rounded to the input dtype, as eager 16-bit PyTorch ops
round them; the model's own SwiGLU rounds once) as it loads it, so the activation is not a kernel of its own.
:func:`linear_partials` and :func:`swiglu_down_partials` leave the float32 partial sums for a consumer that adds them
where it reads them (:func:`add_deferred`); :func:`row_linear` returns the summed product. Each is a custom op
(``mcore_infer::...``: a compiled layer keeps it in its graph); without Triton, or on the CPU outside
``TRITON_INTERPRET=1``, it computes the same with PyTorch ops.

Each entry point takes ``launch`` (a :class:`Launch`: ``SPLITS``, ``BLOCK_N``, ``BLOCK_K``, ``WARPS``;
``Launch.parse("8,16,256,4")`` reads the form a benchmark sweep prints); None is :func:`heuristic_launch` (one split
for :func:`row_linear`). A serving run passes launches through :class:`mcore_infer.decode.DecodeLaunches`;
``bench/gemv_bench.py --fma-sweep`` times the launches against cuBLAS.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mcore_infer.kernels.norm_linear import MAX_ROWS, _use_triton, gdc_launch, parse_ints

__all__ = [
    "FMA_MAX_ROWS",
    "MAX_ROWS",
    "Launch",
    "add_deferred",
    "check_deferred",
    "gemv_partials",
    "heuristic_launch",
    "linear_partials",
    "row_linear",
    "swiglu_down",
    "swiglu_down_partials",
    "swiglu_down_reference",
]

BLOCK_K = 256
FMA_MAX_ROWS = 4  # up to this many rows the kernel accumulates elementwise products instead of an MMA
_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit  # type: ignore[misc]
    def _gemv_step(X, W, acc, rows, cols, k0, M, N, K, stride_xm, stride_wn, w,  # type: ignore[no-untyped-def]
                   BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, FMA: tl.constexpr, HAVE_W: tl.constexpr):  # fmt: skip
        """``acc`` plus the products of K step ``k0`` (its weight tile ``w`` when ``HAVE_W``, else loaded here)."""
        dtype = X.dtype.element_ty
        ks = k0 + tl.arange(0, BLOCK_K)
        m2 = (rows[:, None] < M) & (ks[None, :] < K)
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=m2, other=0.0)
        if SWIGLU:  # X is [gate | up]: the input is silu(gate) * up, each rounded to X's dtype
            up = tl.load(X + rows[:, None] * stride_xm + K + ks[None, :], mask=m2, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            x = (act * up).to(dtype)
        if not HAVE_W:
            w = tl.load(W + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                        other=0.0)  # fmt: skip
        if FMA:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        elif dtype == tl.float32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        return acc

    globals()["_gemv_step"] = _gemv_step  # Triton resolves a kernel's callees among its module's globals

    @triton.jit  # type: ignore[misc]
    def gemv(  # type: ignore[no-untyped-def]
        X,
        W,
        Y,
        M,
        N,
        K,
        K_PER,
        stride_xm,
        stride_wn,
        stride_ym,
        stride_ys,
        M_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SWIGLU: tl.constexpr,
        FMA: tl.constexpr,
        GDC: tl.constexpr,
        PAIR: tl.constexpr,
    ):
        # FMA (a few rows, M_PAD <= FMA_MAX_ROWS): products accumulated elementwise in a float32
        # [rows, BLOCK_N, BLOCK_K] register tile and reduced over K once after the loop. An MMA of at least 16 padded
        # rows wastes most of its work at one row, and compiles to ~250 registers per thread here. Else tl.dot.
        pid = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, M_PAD)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        if FMA:
            acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
        else:
            acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        k_lo = split * K_PER
        # GDC (a programmatic dependent launch): the first weight tile is loaded before waiting for the kernel this
        # one depends on, whose output X is read after gdc_wait. PAIR (a split of two K steps): the second tile's
        # load is in flight too before the input is read. The loop below stays as the compiler pipelines it.
        if GDC:
            gdc_launch_dependents()
        if GDC or PAIR:
            ks = k_lo + tl.arange(0, BLOCK_K)
            w0 = tl.load(W + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                         other=0.0)  # fmt: skip
        if GDC:
            gdc_wait()
        if PAIR:
            ks1 = ks + BLOCK_K
            w1 = tl.load(W + cols[:, None] * stride_wn + ks1[None, :], mask=(cols[:, None] < N) & (ks1[None, :] < K),
                         other=0.0)  # fmt: skip
        if GDC or PAIR:
            acc = _gemv_step(X, W, acc, rows, cols, k_lo, M, N, K, stride_xm, stride_wn, w0, BLOCK_K, SWIGLU, FMA,
                             True)  # fmt: skip
            k_lo += BLOCK_K
        if PAIR:
            acc = _gemv_step(X, W, acc, rows, cols, k_lo, M, N, K, stride_xm, stride_wn, w1, BLOCK_K, SWIGLU, FMA,
                             True)  # fmt: skip
            k_lo += BLOCK_K
        for k0 in range(k_lo, (split + 1) * K_PER, BLOCK_K):
            acc = _gemv_step(X, W, acc, rows, cols, k0, M, N, K, stride_xm, stride_wn, None, BLOCK_K, SWIGLU, FMA,
                             False)  # fmt: skip
        if FMA:
            out = tl.sum(acc, axis=2)
        else:
            out = acc
        tl.store(Y + split * stride_ys + rows[:, None] * stride_ym + cols[None, :], out.to(Y.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))  # fmt: skip

    _KERNEL = gemv
    return _KERNEL


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gemv_partials(
    x: torch.Tensor,
    weight: torch.Tensor,
    splits: int,
    block_n: int = 32,
    block_k: int = BLOCK_K,
    swiglu: bool = False,
    out_dtype: torch.dtype = torch.float32,
    num_warps: int = 4,
    pdl: bool = False,
) -> torch.Tensor:
    """``[splits, M, N]`` partial products (in ``out_dtype``) whose sum over dim 0 is ``F.linear(x, weight)`` for
    ``x`` ``[M, K]`` (``[M, 2K]`` = ``[gate | up]`` with ``swiglu``: then of ``silu(gate) * up``), ``M`` at most 64,
    ``weight`` ``[N, K]``. The Triton kernel: on CUDA, or on the CPU under ``TRITON_INTERPRET=1``. Up to
    :data:`FMA_MAX_ROWS` rows it accumulates elementwise products (no MMA of padded rows); more rows use ``tl.dot``.
    ``pdl``: launched as a programmatic dependent of the kernel before it on Hopper and later (:func:`gdc_launch`)."""
    m, kx = x.shape
    n, k = weight.shape
    if kx != (2 * k if swiglu else k):
        raise ValueError(f"x has {kx} columns, expected {'2 x ' if swiglu else ''}{k} for a weight of {k} inputs")
    if m > 64:
        raise ValueError(f"gemv_partials takes at most 64 rows, got {m}")
    if splits < 1 or block_n < 8 or block_n & (block_n - 1):
        raise ValueError(f"splits={splits} must be >= 1 and block_n={block_n} a power of two >= 8")
    if m > FMA_MAX_ROWS and block_n < 16:
        block_n = 16  # tl.dot's smallest tile
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    block_k = min(block_k, max(16, 1 << (k - 1).bit_length()))
    per = _cdiv(_cdiv(k, splits), block_k) * block_k
    y = torch.empty(splits, m, n, dtype=out_dtype, device=x.device)
    if m:
        small = m <= FMA_MAX_ROWS
        _kernel()[(_cdiv(n, block_n), splits)](
            x, weight, y, m, n, k, per, x.stride(0), weight.stride(0), y.stride(1), y.stride(0),
            M_PAD=1 << (m - 1).bit_length() if small else max(16, 1 << (m - 1).bit_length()), BLOCK_N=block_n,
            BLOCK_K=block_k, SWIGLU=swiglu, FMA=small, num_warps=num_warps, PAIR=per == 2 * block_k,
            **gdc_launch(x, pdl),
        )  # fmt: skip
    return y


class Launch(NamedTuple):
    splits: int  # K split into this many ranges (float32 partial sums when more than one)
    block_n: int  # output features per program (a power of two >= 8; >= 16 above FMA_MAX_ROWS rows)
    block_k: int = BLOCK_K  # K elements per loop step (a power of two >= 16)
    warps: int = 4

    def __str__(self) -> str:  # the form :meth:`parse` reads
        return ",".join(str(v) for v in self)

    @classmethod
    def parse(cls, text: str) -> Launch:
        """A checked launch from ``SPLITS,BLOCK_N[,BLOCK_K,WARPS]`` (integers; 256 and 4 when left out)."""
        source = f"GEMV launch {text!r} (expected SPLITS,BLOCK_N[,BLOCK_K,WARPS], e.g. 8,16,256,4)"
        return cls(*parse_ints(text, source, (2, 4))).checked(source)

    def checked(self, source: str | None = None) -> Launch:
        """This launch, or a ValueError saying which field the kernel cannot take (``source`` opens the message)."""
        source = source or f"GEMV launch {self!r}"
        if self.splits < 1 or self.block_n < 8 or self.block_n & (self.block_n - 1):
            raise ValueError(f"{source}: SPLITS must be >= 1 and BLOCK_N a power of two >= 8")
        if self.block_k < 16 or self.block_k & (self.block_k - 1) or self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{source}: BLOCK_K must be a power of two >= 16 and WARPS one of 1, 2, 4, 8, 16")
        return self


def heuristic_launch(k: int, row: bool = False) -> Launch:
    """8 output features per program, 1,024 K elements per step, 4 warps, and K split in two where it spans at
    least four steps (one split for ``row``: an output the consumer needs summed). The best of 72 launches at each
    of llama-1b's shapes with the weights read from HBM (one H200, one row, CUDA graphs, ``bench/gemv_bench.py
    --fma-sweep --cold``): output projection 4.64 µs (cuBLAS 5.69), QKV 5.60 (6.43), fc2 10.66 (14.04), SwiGLU +
    fc2 11.65 (compiled SwiGLU + cuBLAS 15.07)."""
    block_n, block_k = 8, 1024
    return Launch(1 if row or k < 4 * block_k else 2, block_n, block_k, 4)


def _launch(k: int, values: list[int] | None, row: bool = False) -> Launch:
    """The launch an op was given (as its list of values), else the heuristic for a weight of ``k`` inputs."""
    return heuristic_launch(k, row) if values is None else Launch(*values)


def _values(launch: Launch | None) -> list[int] | None:
    """A launch as the ops take it (custom ops take no named tuples), checked."""
    return None if launch is None else list(launch.checked())


def swiglu_down_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused computation (PyTorch ops): what the kernel must equal."""
    gate, up = x.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight)


def _partial_splits(x: torch.Tensor, weight: torch.Tensor, values: list[int] | None) -> int:
    """How many partial sums the partials ops return for these inputs (1 on the PyTorch path)."""
    return _launch(weight.shape[1], values).splits if _use_triton(x) else 1


@torch.library.custom_op("mcore_infer::swiglu_down_partials", mutates_args=())
def _swiglu_down_partials_op(
    x: torch.Tensor, weight: torch.Tensor, launch_values: list[int] | None, pdl: bool = False
) -> torch.Tensor:
    if not _use_triton(x):
        return swiglu_down_reference(x, weight).float()[None]
    return _partials(x, weight, _launch(weight.shape[1], launch_values), swiglu=True, pdl=pdl)


@_swiglu_down_partials_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, launch_values: list[int] | None, pdl: bool = False) -> torch.Tensor:
    splits = _partial_splits(x, weight, launch_values)
    return x.new_empty(splits, *x.shape[:-1], weight.shape[0], dtype=torch.float32)


def _partials(x: torch.Tensor, weight: torch.Tensor, launch: Launch, swiglu: bool, pdl: bool) -> torch.Tensor:
    """The kernel's float32 partial sums ``[splits, ..., N]``."""
    parts = gemv_partials(x.reshape(-1, x.shape[-1]), weight, launch.splits, launch.block_n, launch.block_k,
                          swiglu=swiglu, num_warps=launch.warps, pdl=pdl)  # fmt: skip
    return parts.view(launch.splits, *x.shape[:-1], weight.shape[0])


def _summed(x: torch.Tensor, weight: torch.Tensor, launch: Launch, swiglu: bool, pdl: bool) -> torch.Tensor:
    """The kernel's product in ``x``'s dtype: written directly at one split, else its float32 partials summed."""
    x2 = x.reshape(-1, x.shape[-1])
    sp, bn, bk, warps = launch
    if sp == 1:
        y = gemv_partials(x2, weight, 1, bn, bk, swiglu=swiglu, out_dtype=x.dtype, num_warps=warps, pdl=pdl)[0]
    else:
        y = gemv_partials(x2, weight, sp, bn, bk, swiglu=swiglu, num_warps=warps, pdl=pdl).sum(0).to(x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("mcore_infer::swiglu_down", mutates_args=())
def _swiglu_down_op(
    x: torch.Tensor, weight: torch.Tensor, launch_values: list[int] | None, pdl: bool = False
) -> torch.Tensor:
    if not _use_triton(x):
        return swiglu_down_reference(x, weight)
    return _summed(x, weight, _launch(weight.shape[1], launch_values), swiglu=True, pdl=pdl)


@_swiglu_down_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, launch_values: list[int] | None, pdl: bool = False) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    rows = x.numel() // max(1, x.shape[-1])
    if rows > MAX_ROWS:
        raise ValueError(f"swiglu_down takes at most {MAX_ROWS} rows, got {rows}: use SwiGLU and a GEMM")
    if x.shape[-1] != 2 * weight.shape[1]:
        raise ValueError(f"swiglu_down: x has {x.shape[-1]} columns, expected [gate | up] = 2 x {weight.shape[1]}")


def swiglu_down(x: torch.Tensor, weight: torch.Tensor, launch: Launch | None = None, pdl: bool = False) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight)`` for ``x = [gate | up]`` ``[..., 2K]`` of at most :data:`MAX_ROWS` rows
    and ``weight`` ``[N, K]`` (no bias): one kernel reading ``x`` and the weight (split over K, the float32 partial
    sums added by a second, small one). Inference only."""
    _check(x, weight)
    result: torch.Tensor = _swiglu_down_op(x, weight, _values(launch), pdl)
    return result


def swiglu_down_partials(
    x: torch.Tensor, weight: torch.Tensor, launch: Launch | None = None, pdl: bool = False
) -> torch.Tensor:
    """:func:`swiglu_down` left as its float32 partial sums ``[splits, ..., N]`` (one on the PyTorch path), for a
    consumer that adds them where it reads them (:func:`add_deferred`: the next layer's residual add and norm are
    then one kernel, as without this fusion)."""
    _check(x, weight)
    result: torch.Tensor = _swiglu_down_partials_op(x, weight, _values(launch), pdl)
    return result


def _check_row(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    rows = x.numel() // max(1, x.shape[-1])
    if rows > FMA_MAX_ROWS:
        raise ValueError(f"{name} takes at most {FMA_MAX_ROWS} rows, got {rows}: use F.linear")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: x has {x.shape[-1]} columns, the weight {weight.shape[1]} inputs")


@torch.library.custom_op("mcore_infer::linear_partials", mutates_args=())
def _linear_partials_op(
    x: torch.Tensor, weight: torch.Tensor, launch_values: list[int] | None, pdl: bool = False
) -> torch.Tensor:
    if not _use_triton(x):
        return F.linear(x, weight).float()[None]
    return _partials(x, weight, _launch(weight.shape[1], launch_values), swiglu=False, pdl=pdl)


@_linear_partials_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, launch_values: list[int] | None, pdl: bool = False) -> torch.Tensor:
    splits = _partial_splits(x, weight, launch_values)
    return x.new_empty(splits, *x.shape[:-1], weight.shape[0], dtype=torch.float32)


def linear_partials(
    x: torch.Tensor, weight: torch.Tensor, launch: Launch | None = None, pdl: bool = False
) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for at most :data:`FMA_MAX_ROWS` rows as float32 split-K partial sums
    ``[splits, ..., N]`` (one on the PyTorch path) for :func:`add_deferred` (the residual add and norm after an
    attention output projection then sum them: no sum kernel, and no cuBLAS split-K reduction)."""
    _check_row("linear_partials", x, weight)
    result: torch.Tensor = _linear_partials_op(x, weight, _values(launch), pdl)
    return result


@torch.library.custom_op("mcore_infer::row_linear", mutates_args=())
def _row_linear_op(
    x: torch.Tensor, weight: torch.Tensor, launch_values: list[int] | None, pdl: bool = False
) -> torch.Tensor:
    if not _use_triton(x):
        return F.linear(x, weight)
    return _summed(x, weight, _launch(weight.shape[1], launch_values, row=True), swiglu=False, pdl=pdl)


@_row_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, launch_values: list[int] | None, pdl: bool = False) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def row_linear(x: torch.Tensor, weight: torch.Tensor, launch: Launch | None = None, pdl: bool = False) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for at most :data:`FMA_MAX_ROWS` rows with the one-row kernel, one split by
    default (the output in ``x``'s dtype, for a consumer that needs it summed: the QKV projection)."""
    _check_row("row_linear", x, weight)
    result: torch.Tensor = _row_linear_op(x, weight, _values(launch), pdl)
    return result


def check_deferred(name: str, x: torch.Tensor, residual: torch.Tensor | None) -> None:
    """A ValueError opened by ``name`` unless ``x`` can be added to ``residual`` as :func:`add_deferred` adds it: of
    the residual's shape or its partial sums ``[splits, *residual.shape]`` (no residual: any ``x``)."""
    if residual is not None and (x.shape[-residual.dim() :] != residual.shape or x.dim() > residual.dim() + 1):
        raise ValueError(f"{name}: x {tuple(x.shape)} is neither residual's shape {tuple(residual.shape)} "
                         "nor its partials")  # fmt: skip


def add_deferred(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``x + residual`` for a deferred residual add, where ``x`` may be the partial sums ``[splits, *shape]`` of
    :func:`swiglu_down_partials`: then added in float32 and rounded once to the residual's dtype (the unfused path
    rounds the projection's output first: the same up to one rounding)."""
    if x.dim() != residual.dim() + 1:
        return x + residual
    total = residual.float()
    for part in x.unbind(0):
        total = total + part
    return total.to(residual.dtype)
