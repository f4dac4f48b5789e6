"""Triton kernels for the FP8 linear's casts: the absolute maximum of a tensor and its cast to FP8, with its
transpose written by the same pass.

A current-scaled FP8 GEMM needs two passes over its bf16 operand: one for the maximum (the scale depends on every
element) and one that writes ``q = clamp(t * scale, -fmax, fmax)`` in FP8. The weight gradient also needs the
transpose of the input and of the output gradient (cuBLASLt's FP8 GEMMs take row-major times column-major only), so
the cast writes ``q`` and ``qᵀ`` from the same tile: one read of ``t`` and two FP8 writes, the transpose done in the
program's registers and shared memory instead of a strided copy.

- ``amax_partials``: one program per block of ``BLOCK`` elements writes its block's maximum of ``|t|`` (NaN if
  the block holds one, so a diverged tensor still shows up); the maximum of the few thousand partials is one small
  PyTorch reduction.
- ``cast``: one program per ``[BM, BN]`` tile of a 2-D ``t`` (any row stride, contiguous rows) scales by a 0-d or
  per-row ``[rows, 1]`` scale, clamps, rounds to nearest (even) and writes ``q`` ``[rows, cols]`` and, where asked,
  ``qᵀ`` ``[cols, rows]``, both contiguous. With delayed scaling (the scale comes from earlier steps) it also
  folds the tile's maximum into the step's recorded maximum (an atomic max): one pass instead of two.

The rounding is the PyTorch ops' (``(t.float() * scale).clamp(-fmax, fmax).to(fp8)``), so the two paths give the
same bytes. They run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["available", "amax_triton", "cast_triton", "install", "quantize_args"]

_AMAX_BLOCK = 8192
_GRID = {torch.float8_e4m3fn: (127 - 6, 3), torch.float8_e5m2: (127 - 14, 2)}
"""FP8 dtype -> (float32 biased exponent of its smallest normal binade, its mantissa bits)."""
_BM, _BN = 64, 256  # the fastest of `fp8_linear_bench.py --tune-casts` tiles on one H200 for both of FC1's casts
_WARPS = 8
NATIVE_ROUNDING = True
"""The cast's rounding by the GPU's conversion instruction (``cvt.rn`` to FP8) instead of the float32 arithmetic
below: half the instructions per element for Hopper (23.5 -> 12.5 for a bf16 tile, ``bench/kernel_registers.py``'s
compile); the same bytes by the rule (round to nearest even of a value already clamped to the format). Used for
16-bit sources only: on one H200 (Triton 3.6) the bytes equalled PyTorch's for bf16 tiles, but the transposed
output of a float32 tile came back wrong (``test_native_rounding_gives_the_pytorch_bytes_on_the_gpu``), so float32
sources keep the arithmetic rounding. On since one H200 timed it (``bench/fp8_linear_bench.py --tune-casts``, with the
tile below): the transposing cast of FC1's output gradient 0.56 against 0.78 ms, of its input 0.083 against 0.113."""
_NATIVE_SOURCES = (torch.bfloat16, torch.float16)


@functools.cache
def available() -> bool:
    """Whether Triton imports (it comes with PyTorch's CUDA wheels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_HELPERS: dict[str, Any] = {}


def install(module_globals: dict[str, Any]) -> None:
    """Add :func:`_quantize` (a Triton function: a float32 tile scaled, clamped and rounded to FP8 exactly as
    :func:`cast_triton` does) to ``module_globals``, a kernel module's ``globals()`` (Triton looks up the functions
    a kernel calls among its module's globals), for kernels that cast their own output to FP8."""
    if not _HELPERS:
        _HELPERS.update(_define_helpers())
    module_globals.update(_HELPERS)


def quantize_args(dtype: torch.dtype, source: torch.dtype) -> dict[str, int]:
    """The constexpr arguments of :func:`_quantize` for an FP8 ``dtype`` (its grid) and a ``source`` tensor's dtype
    (:data:`NATIVE_ROUNDING` for 16-bit sources on the GPU: Triton's interpreter does not round its FP8 conversion
    as the instruction does, so interpreted kernels keep the arithmetic rounding)."""
    native = NATIVE_ROUNDING and source in _NATIVE_SOURCES and os.environ.get("TRITON_INTERPRET") != "1"
    return {"EMIN": _GRID[dtype][0], "MBITS": _GRID[dtype][1], "NATIVE": native}


def _define_helpers() -> dict[str, Any]:
    import triton
    import triton.language as tl

    globals()["tl"] = tl  # (Triton's interpreter looks for triton.language among a jit function's globals)

    @triton.jit  # type: ignore[misc]
    def _quantize(x, s, fmax, dtype, EMIN: tl.constexpr, MBITS: tl.constexpr, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
        """``x * s`` (float32) clamped to ``±fmax`` and rounded to nearest even in the FP8 ``dtype``."""
        # fmax in float32 whatever the launch typed it as: inductor, launching these kernels from a compiled graph,
        # types a Python float float64, which would make y float64 (no float64 -> FP8 conversion: Triton fails)
        f = tl.full([], fmax, tl.float32)
        y = tl.minimum(tl.maximum(x * s, -f, propagate_nan=tl.PropagateNan.ALL), f, propagate_nan=tl.PropagateNan.ALL)
        if NATIVE:  # the GPU's own conversion, round to nearest even (y is already within the format's range)
            q = y.to(dtype, fp_downcast_rounding="rtne")
        else:
            # round to nearest even on the format's grid in float32 (the spacing of y's binade, or of the smallest
            # normal binade below it): (y + M) - M with M = 1.5 * 2^23 * spacing; the cast of a value on the grid is
            # exact (the sign bit put back: a small negative value rounds to -0, as the PyTorch cast gives)
            bits = y.to(tl.int32, bitcast=True)
            e = tl.maximum((bits >> 23) & 0xFF, EMIN)
            magic = (((e - MBITS + 23) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
            r = ((y + magic) - magic).to(tl.int32, bitcast=True) | (bits & -2147483648)
            q = tl.where(y == y, r.to(tl.float32, bitcast=True), y).to(dtype)  # NaN stays NaN
        return q

    @triton.jit  # type: ignore[misc]
    def _abs_nan_inf(x):  # type: ignore[no-untyped-def]
        """``|x|`` with NaN as +inf (a maximum over it is +inf where ``x`` holds a NaN: one reduction, not two)."""
        return tl.where(x != x, float("inf"), tl.abs(x))

    @triton.jit  # type: ignore[misc]
    def _tile_amax(a):  # type: ignore[no-untyped-def]
        """The largest element of a 2-D tile ``a = _abs_nan_inf(x)``: the largest ``|x|``, +inf if ``x`` holds a NaN
        (the history counts that as 0). It calls no other helper: the helpers here reach each other as variables of
        this function, which inductor, launching a kernel from a compiled graph, does not emit with the kernel."""
        return tl.max(tl.max(a, axis=1), axis=0)

    helpers = {"_quantize": _quantize, "_abs_nan_inf": _abs_nan_inf, "_tile_amax": _tile_amax}
    globals().update(helpers)
    return helpers


_quantize: Any = None  # the helpers (set by install: Triton looks a kernel's callees up among these globals)
_abs_nan_inf: Any = None
_tile_amax: Any = None


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    install(globals())

    @triton.jit  # type: ignore[misc]
    def amax_partials(T, OUT, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(T + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.max(tl.abs(x), axis=0)
        nan = tl.sum((x != x).to(tl.int32), axis=0)
        tl.store(OUT + pid, tl.where(nan > 0, float("nan"), a))

    @triton.jit  # type: ignore[misc]
    def cast(T, SCALE, Q, QT, AMAX, rows, cols, t_row, fmax,  # type: ignore[no-untyped-def]
             AMAX_OUT: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, ROWWISE: tl.constexpr, TRANSPOSE: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, NATIVE: tl.constexpr):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        mask = (rm[:, None] < rows) & (rn[None, :] < cols)
        x = tl.load(T + rm[:, None] * t_row + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        if AMAX_OUT:  # this tile's largest |t| into AMAX
            tl.atomic_max(AMAX, _tile_amax(_abs_nan_inf(x)))
        if ROWWISE:
            s = tl.load(SCALE + rm, mask=rm < rows, other=1.0)[:, None]
        else:
            s = tl.load(SCALE)
        q = _quantize(x, s, fmax, Q.dtype.element_ty, EMIN, MBITS, NATIVE)
        tl.store(Q + rm[:, None] * cols + rn[None, :], q, mask=mask)
        if TRANSPOSE:
            tl.store(
                QT + rn[:, None] * rows + rm[None, :], tl.trans(q), mask=(rn[:, None] < cols) & (rm[None, :] < rows)
            )

    return {"amax_partials": amax_partials, "cast": cast}


def amax_triton(t: torch.Tensor) -> torch.Tensor:
    """The largest ``|t|`` (0-d float32; NaN if ``t`` holds one) of a contiguous tensor."""
    flat = t.reshape(-1)
    n = flat.numel()
    blocks = max(1, -(-n // _AMAX_BLOCK))
    partials = torch.empty(blocks, dtype=torch.float32, device=t.device)
    if n == 0:
        return partials.zero_().amax()
    _kernels()["amax_partials"][(blocks,)](flat, partials, n, BLOCK=_AMAX_BLOCK, num_warps=_WARPS)
    return partials.amax()


def cast_triton(
    t: torch.Tensor,
    scale: torch.Tensor,
    fmax: float,
    dtype: torch.dtype,
    transpose: bool,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t`` (2-D, rows contiguous) scaled by ``scale`` (0-d, or ``[rows, 1]``), clamped to ``±fmax`` and cast to
    ``dtype``; with ``transpose`` also the transpose, contiguous. ``amax_out`` (a one-element float32 tensor): the
    largest ``|t|`` is folded into it by the same pass (``max(amax_out, amax(t))``; +inf if ``t`` holds a NaN), for
    delayed scaling, whose scale is known before the tensor is read."""
    rows, cols = t.shape
    if t.stride(1) != 1:
        t = t.contiguous()
    q = torch.empty(rows, cols, dtype=dtype, device=t.device)
    qt = torch.empty(cols, rows, dtype=dtype, device=t.device) if transpose else None
    rowwise = scale.dim() > 0
    grid = (max(1, -(-rows // _BM)), max(1, -(-cols // _BN)))
    if rows and cols:
        amax = amax_out if amax_out is not None else scale
        _kernels()["cast"][grid](t, scale.reshape(-1).to(torch.float32), q, q if qt is None else qt, amax, rows, cols,
                                 t.stride(0), float(fmax), AMAX_OUT=amax_out is not None, ROWWISE=rowwise, TRANSPOSE=transpose, BM=_BM, BN=_BN,
                                 num_warps=_WARPS, **quantize_args(dtype, t.dtype))  # fmt: skip
    return q, qt
