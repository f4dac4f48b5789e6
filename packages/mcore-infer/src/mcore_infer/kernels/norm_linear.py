"""RMSNorm fused into the linear layer that follows it, for steps of a few rows (batch-1 decoding).

A decode step of one request multiplies a single row by each weight matrix: the GEMM is bound by reading the weight
(a few µs), and the norm in front of it is a kernel of its own that costs about as much as a small GEMM. One Triton
kernel does both, plus the residual add in front of the norm and, for a gated MLP, the SwiGLU after the up
projection::

    h = x + residual                               (rounded to x's dtype, as the unfused add)
    y = rms_norm(h, norm_weight, eps) @ weightᵀ    (computed as (1 / rms(h)) * ((h * norm_weight) @ weightᵀ))
    y = silu(y_gate) * y_up                        (``swiglu``: weight is [gate; up]; each half rounded first)

and returns ``(y, h)`` (``h`` is the next residual). Every program streams ``BLOCK_N`` output rows of the weight
(both halves for SwiGLU) over K in a loop shaped like a plain Triton GEMV: it loads the weight tile, the x (and
residual) and norm-weight slices, multiplies ``h * norm_weight`` and feeds the dot product(s), nothing else. The
row's scale 1 / rms(h) is the same for every output, so it multiplies the finished dot products. Where the sums of
squares come from is the constexpr ``NORM_MODE``:

- 0: accumulated inside the weight loop, from the same loads, with a row reduction in every step;
- 1 (the default): a short loop over K *after* the weight loop, re-reading the x (and residual) rows, which are a
  few KB and in L2 by then (a single step for one row of K <= 1024 * warps);
- 2: the same short loop *before* the weight loop (a two-pass kernel);
- 3: accumulated inside the weight loop as an elementwise [rows, BLOCK_K] tile, reduced once after it (registers
  instead of a reduction per step).

``h`` is stored by program 0 outside the weight loop in every mode (modes 1 and 2: in the short loop; 0 and 3: in
a short loop of its own after the weight loop), so nothing but loads, ``h * norm_weight`` and dots (and mode 0's and
3's squares) is left in the loop: a row reduction in every step of the loop is what makes it slow. On an H200
(rows=1, K=2048, bf16, CUDA graphs) mode 0 takes 48 / 101 / 203 µs for QKV (N=3072), fc1 + SwiGLU (N=8192) and the
LM head (N=32768), mode 1 9.0 / 21.9 / 39.9 at the default launches (the unfused add + norm + cuBLAS: 8.2 / 21.5 /
36.9, a plain Triton GEMV of the same weights: 5.3 / 18.3 / 33.2): mode 1 trails the unfused ops by 0.4-3 µs and
the plain GEMV by 4-7 µs, so serving leaves this kernel off unless a plan asks for it.

It is registered as the custom op ``mcore_infer::norm_linear``, so a compiled layer keeps it in its graph; without
Triton, or on the CPU outside ``TRITON_INTERPRET=1``, the op computes the same with PyTorch ops.

The launch (``NORM_MODE``, ``BLOCK_N`` output rows per program, warps, pipeline stages, ``BLOCK_K``) is the
``launch`` argument (a :class:`Launch`; ``Launch.parse("1,32,4,3")`` reads the ``MODE,BLOCK_N,WARPS,STAGES[,BLOCK_K]``
form a benchmark sweep prints), or, when it is None, the heuristic (:func:`heuristic_launch`). A serving run passes
it through :class:`mcore_infer.decode.DecodeLaunches`. ``BLOCK_K`` is clamped to K rounded up to a power of two (at
least 16).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["MAX_ROWS", "NORM_MODES", "Launch", "heuristic_launch", "norm_linear", "norm_linear_reference"]

MAX_ROWS = 16  # rows the kernel takes (one MMA tile of rows); more rows are a GEMM's job
NORM_MODES = (0, 1, 2, 3)
_NORM_PASS_ELEMS_PER_WARP = 1024  # the x / residual tile of the short loop (norm, h store): 32 values a thread
_KERNEL: Any = None
_ROW_PASS: Any = None  # the kernel's helper (a module global: Triton resolves called functions there)


class Launch(NamedTuple):
    """One launch of the kernel: where the sums of squares come from (``NORM_MODE``, see the module docstring),
    output rows per program, warps, software-pipeline stages of the weight loop and the K step."""

    mode: int
    block_n: int
    warps: int
    stages: int
    block_k: int = 256

    def __str__(self) -> str:  # the form :meth:`parse` reads
        return ",".join(str(v) for v in self)

    @classmethod
    def parse(cls, text: str) -> Launch:
        """A checked launch from ``MODE,BLOCK_N,WARPS,STAGES[,BLOCK_K]`` (integers; ``BLOCK_K`` defaults to 256)."""
        source = f"norm_linear launch {text!r} (expected MODE,BLOCK_N,WARPS,STAGES[,BLOCK_K], e.g. 1,32,4,3)"
        return cls(*parse_ints(text, source, (4, 5))).checked(source)

    def checked(self, source: str | None = None) -> Launch:
        """This launch, or a ValueError naming every field the kernel cannot take (``source`` opens the message)."""
        problems = []
        if self.mode not in NORM_MODES:
            problems.append(f"MODE must be one of {NORM_MODES}, got {self.mode}")
        if not (_pow2(self.block_n) and self.block_n >= 16):
            problems.append(f"BLOCK_N must be a power of two >= 16, got {self.block_n}")
        if not (_pow2(self.warps) and self.warps <= 32):
            problems.append(f"WARPS must be a power of two <= 32, got {self.warps}")
        if self.stages < 1:
            problems.append(f"STAGES must be >= 1, got {self.stages}")
        if not (_pow2(self.block_k) and self.block_k >= 16):
            problems.append(f"BLOCK_K must be a power of two >= 16, got {self.block_k}")
        if problems:
            raise ValueError(f"{source or f'norm_linear launch {self!r}'}: {'; '.join(problems)}")
        return self


def _kernel() -> Any:
    global _KERNEL, _ROW_PASS
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def _row_pass(  # type: ignore[no-untyped-def]
        X,
        R,
        H,
        M,
        K,
        stride_x,
        stride_r,
        stride_h,
        store,
        HAS_RES: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """h = x + residual over whole rows in a short loop: its per-row sums of squares, and h stored where
        ``store``. ``ROWS`` is 1 for a single row (then each step covers up to ``BLOCK`` columns of it)."""
        rows = tl.arange(0, ROWS)
        rmask = rows < M
        sq = tl.zeros([ROWS], tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            m2 = rmask[:, None] & (ks[None, :] < K)
            h = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=m2, other=0.0)
            if HAS_RES:
                h = h + tl.load(R + rows[:, None] * stride_r + ks[None, :], mask=m2, other=0.0)
            tl.store(H + rows[:, None] * stride_h + ks[None, :], h, mask=tl.where(store, m2, False))
            hf = h.to(tl.float32)
            sq += tl.sum(hf * hf, axis=1)
        return sq

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
        NORM_MODE: tl.constexpr,
        M_PAD: tl.constexpr,
        NORM_ROWS: tl.constexpr,
        NORM_BLOCK: tl.constexpr,
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
        if NORM_MODE == 2:  # two passes: the norm's short loop first
            sq = _ROW_PASS(X, R, H, M, K, stride_x, stride_r, stride_h, pid == 0, HAS_RES, NORM_ROWS, NORM_BLOCK)
        else:
            sq = tl.zeros([M_PAD], tl.float32)
        sq_tile = tl.zeros([M_PAD, BLOCK_K], tl.float32)  # mode 3's squares, summed over rows after the loop
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        # the weight loop: loads, h * g and the dot(s) (modes 0 and 3: and the squares of h), no stores
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
            g = tl.load(G + ks, mask=kmask, other=0.0)
            hf = h.to(tl.float32)
            if NORM_MODE == 0:
                sq += tl.sum(hf * hf, axis=1)
            if NORM_MODE == 3:
                sq_tile += hf * hf
            hg = (hf * g.to(tl.float32)[None, :]).to(dtype)
            if IEEE:
                acc += tl.dot(hg, tl.trans(w), input_precision="ieee")
                if SWIGLU:
                    acc_up += tl.dot(hg, tl.trans(wu), input_precision="ieee")
            else:
                acc += tl.dot(hg, tl.trans(w))
                if SWIGLU:
                    acc_up += tl.dot(hg, tl.trans(wu))
        if NORM_MODE == 3:
            sq = tl.sum(sq_tile, axis=1)
        if NORM_MODE == 1:  # the norm's short loop after the weights (x and residual are in L2 by now)
            sq = _ROW_PASS(X, R, H, M, K, stride_x, stride_r, stride_h, pid == 0, HAS_RES, NORM_ROWS, NORM_BLOCK)
        elif NORM_MODE != 2:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if pid == 0:  # modes 0 and 3: h, by program 0 alone, outside the weight loop
                _ROW_PASS(X, R, H, M, K, stride_x, stride_r, stride_h, pid == 0, HAS_RES, NORM_ROWS, NORM_BLOCK)
        rstd = 1.0 / tl.sqrt(sq / K + eps)  # [M_PAD] or, modes 1 and 2 with one row, [1]: broadcasts either way
        acc = acc * rstd[:, None]
        if SWIGLU:
            gate = acc.to(dtype).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            out = act * (acc_up * rstd[:, None]).to(dtype).to(tl.float32)
        else:
            out = acc
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], out.to(dtype), mask=rmask[:, None] & nmask[None, :])

    _ROW_PASS = _row_pass
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


_GDC: dict[int, bool] = {}


def gdc_launch(x: torch.Tensor, pdl: bool) -> dict[str, bool]:
    """The launch options of a kernel with grid-dependency control (a ``GDC`` constexpr: it signals at its start
    that the next kernel may launch, and waits for the kernel before it with ``gdc_wait`` before reading what that
    kernel writes): ``GDC`` on CUDA devices of compute capability 9.0 or later (Hopper; never under the
    interpreter), and ``launch_pdl`` (a programmatic dependent launch: the kernel starts while the one before it
    finishes) when ``pdl`` asks for it there."""
    if not x.is_cuda:
        return {"GDC": False}
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _GDC:
        _GDC[index] = torch.cuda.get_device_capability(index)[0] >= 9
    gdc = _GDC[index]
    return {"GDC": gdc, "launch_pdl": True} if gdc and pdl else {"GDC": gdc}


def parse_ints(text: str, source: str, counts: tuple[int, ...]) -> list[int]:
    """The comma-separated integers of a launch's text form; a ValueError opened by ``source`` unless there are
    ``counts`` of them."""
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"{source}: not a list of integers") from None
    if len(values) not in counts:
        raise ValueError(f"{source}: {len(values)} values")
    return values


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def heuristic_launch(n: int, k: int, swiglu: bool, sms: int) -> Launch:
    """The default launch: ``NORM_MODE`` 1 and the plain GEMV's K step (256) and stages (3); 64 output rows per
    program on 4 warps where that still leaves a program for every SM, else 32 rows on 2 warps. Measured on an
    H200 (rows=1, K=2048, µs): QKV (N=3072) 9.0 at (32, 2 warps), 9.9 at (32, 4), 11.8 at (64, 4); fc1 + SwiGLU
    (N=8192) 21.9 at (32, 2) and at (64, 4); LM head (N=32768) 39.9 at (64, 4), 42.0 at (32, 2), 51.1 at (32, 4).
    Mode 2 was within 0.5 µs of mode 1 at the same launch; mode 0 (a row reduction in every step) 3-5x slower."""
    if -(-n // 64) >= sms:
        return Launch(1, 64, 4, 3, 256)
    return Launch(1, 32, 2, 3, 256)


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


@torch.library.custom_op("mcore_infer::norm_linear", mutates_args=())
def _norm_linear_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    swiglu: bool,
    launch_values: list[int] | None,
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
        launch = heuristic_launch(n, k, swiglu, sms) if launch_values is None else Launch(*launch_values)
        k_pad = max(16, 1 << (k - 1).bit_length())
        norm_rows = 1 if m == 1 else MAX_ROWS
        _kernel()[(-(-n // launch.block_n),)](
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
            NORM_MODE=launch.mode,
            M_PAD=MAX_ROWS,
            NORM_ROWS=norm_rows,
            NORM_BLOCK=min(k_pad, _NORM_PASS_ELEMS_PER_WARP * launch.warps // norm_rows),
            BLOCK_N=launch.block_n,
            BLOCK_K=min(launch.block_k, k_pad),
            IEEE=x.dtype == torch.float32,
            num_warps=launch.warps,
            num_stages=launch.stages,
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
    launch_values: list[int] | None,
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
    launch: Launch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` as in the module docstring, for ``x`` (and ``residual``) ``[..., K]`` of at most :data:`MAX_ROWS`
    rows, ``weight`` ``[N, K]`` (``[2N, K]``, gate rows first, with ``swiglu``), no bias. Inference only.

    ``launch``: the kernel's launch; None: :func:`heuristic_launch` for this shape and device."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows > MAX_ROWS:
        raise ValueError(f"norm_linear takes at most {MAX_ROWS} rows, got {rows}: use the norm and a GEMM")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"norm_linear(swiglu=True) needs [gate; up] weight rows, got {weight.shape[0]} (odd)")
    values = None if launch is None else list(launch.checked())
    result: tuple[torch.Tensor, torch.Tensor] = _norm_linear_op(x, residual, norm_weight, eps, weight, swiglu, values)
    return result
