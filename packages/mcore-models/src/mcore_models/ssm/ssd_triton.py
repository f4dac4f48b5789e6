"""Triton kernels for the Mamba-2 chunked SSD scan (state space duality, Dao & Gu 2024), forward and backward.

Per head ``h`` (group ``g = h // (H // G)`` for ``B`` and ``C``): ``state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T``
and ``y_t = state_t C_t + D_h x_t``, computed over chunks of ``L = chunk_size`` positions. With ``cum`` the inclusive
cumulative sum of ``dt A`` within a chunk, the forward is four kernels: ``dt`` (bias, softplus, clamp, ``cum``), the
chunk states ``S_c = sum_j exp(cum_last - cum_j) dt_j x_j B_j^T``, the pass over chunks (``state_in_{c+1} =
exp(cum_last) state_in_c + S_c``, parallel over batch, head and state tiles), and the chunk output ``y_i = sum_{j<=i}
(C_i . B_j) exp(cum_i - cum_j) dt_j x_j + exp(cum_i) state_in C_i + D x_i``. The backward runs the same chunk-state
kernel on ``exp(cum_i) dy_i C_i^T``, the same pass in reverse (the gradient of every chunk's state and of the initial
state), a kernel over columns ``j`` (``dx``, ``dB``, ``d dt``), one over rows ``i`` (``dC``) and a per-chunk kernel
that turns the gradient of ``cum`` into those of ``dt``, ``A``, ``dt_bias`` and ``D``. All math is float32 (matrix
products in TF32 for 16-bit inputs, or on 16-bit operands with :data:`LOW_PRECISION_DOTS`; IEEE float32 for float32
inputs); ``y`` comes back in ``x``'s dtype, the final states in float32.

The kernels read ``x``, ``dy`` ``[b, s, H, P]``, ``B``, ``C`` ``[b, s, G, N]`` and ``dt`` ``[b, s, H]`` through
their batch and position strides, so the mixer's views (``x``, ``B`` and ``C`` slices of the convolution's output,
``dt`` a transposed slice of the in-projection's) are read in place, not copied; only the last dimensions must be
dense (strides ``(P, 1)``, ``(N, 1)``, ``1``: :func:`_in_place`), or that input is copied contiguous. The outputs
(``y`` and the gradients) are contiguous.

The forward and backward are ``torch.library`` custom ops (opaque to ``torch.compile``) under a
``torch.autograd.Function``. They run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``);
the PyTorch path is ``mcore_models.ssm.ssd.ssd_scan(impl="torch")``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mcore_models.ssm._launch import check_devices, interpreting

__all__ = ["ssd_scan_triton"]

TILES: dict[str, dict[str, int]] = {
    "16bit": {"_ROWS": 64, "_WARPS": 4, "_STAGES": 1, "_BWD_ROWS": 64, "_BWD_WARPS": 4, "_BWD_STAGES": 1,
              "_GRP_ROWS": 64, "_GRP_WARPS": 4},
    "tf32": {"_ROWS": 32, "_WARPS": 4, "_STAGES": 3, "_BWD_ROWS": 32, "_BWD_WARPS": 4, "_BWD_STAGES": 3,
             "_GRP_ROWS": 32, "_GRP_WARPS": 4},
}  # fmt: skip
"""The chunk kernels' tiles by product operands (``16bit``: :data:`LOW_PRECISION_DOTS` with 16-bit inputs;
``tf32`` otherwise, float32 inputs' IEEE products included): ``_ROWS`` positions per row/column block inside a chunk
(at most; at least 16, ``tl.dot``'s smallest tile), ``_WARPS`` warps per program and ``_STAGES`` Triton's software
pipeline depth (``num_stages``: the loop's loads buffered that many iterations deep in shared memory) in the
forward, ``_BWD_*`` the same for the backward's column and row kernels, ``_GRP_*`` for the kernels of
:data:`BACKWARD` ``"groups"``. The fastest of ``bench/ssd_bench.py --tune`` (batch 8, seq 4096, 64 heads of 64,
state 128, chunk 256): rows and warps on one H200, 8.16 ms forward + backward with 16-bit products, 15.6 ms TF32;
the stages on one H100, where one stage each way took the 16-bit scan from 8.10 to 6.07 ms (two stages backward
6.31; ``bench/results/ssm/h100-scan-tune-stages.json``); the group kernels' on one H100, 4.79 ms at 64 rows and 4
warps against 5.44 at 8 warps and 5.89 at 32 rows (``bench/results/ssm/h100-scan-tune-groups.json``). At Triton's
default of 3 stages the backward's kernels take 123 and 132 KB of shared memory and an SM holds one program; at one,
66 and 49 KB, and it holds two (``bench/kernel_registers.py``). The TF32 tiles keep Triton's default stages (not
measured)."""
BACKWARD = "groups"
"""How the backward takes the gradients of ``B`` and ``C`` (and their parts of the gradient of ``cum``): ``"groups"``,
through one ``L x L`` matrix per group and chunk summed over the group's heads first
(:mod:`mcore_models.ssm._ssd_group_kernels`); ``"heads"``, every head's products with its own ``x`` and ``dy``
(``bwd_cols``, ``bwd_rows``) into float32 ``[b, s, H, N]`` buffers summed over the group's heads after. For
``mamba2-1.3b``'s heads (64 to a group, P 64, N 128, chunks of 256 in blocks of 64) ``groups`` does about 32
against 71 MFLOP of products per head and chunk and writes no per-head buffers: the scan forward + backward 4.81
against 5.69 ms at batch 8 x 4096, 4.84 against 5.79 at 2 x 16k, 9.91 against 12.09 at 1 x 64k (1.18-1.22x; one
H100, one call: ``python bench/ssd_bench.py --seq 4096 16384 65536 --backward groups heads``,
``bench/results/ssm/h100-scan-backward.json``)."""
_STATE_BLOCK = 1024  # state elements per program in the pass over chunks
LOW_PRECISION_DOTS = True
"""16-bit inputs: the chunk kernels' matrix products take 16-bit operands (the inputs' dtype, float32
accumulation; the elementwise math stays float32), as Mamba-2's published kernels do, instead of TF32 products of
float32 operands: 1.9x faster on one H200 (``bench/ssd_bench.py --dots tf32 16bit --tune``). ``False`` gives the
TF32 products."""


def _tiles(x: torch.Tensor) -> dict[str, int]:
    return TILES["16bit" if LOW_PRECISION_DOTS and x.dtype in (torch.bfloat16, torch.float16) else "tf32"]


def _kernels() -> dict[str, Any]:
    from mcore_models.ssm import _ssd_group_kernels, _ssd_kernels

    return {**_ssd_kernels.kernels(), **_ssd_group_kernels.kernels()}


def _pass_tiles(pn: int) -> tuple[int, int]:
    """The pass over chunks' state elements a program, and its programs per batch row and head."""
    bs = min(_STATE_BLOCK, _pow2(pn))
    return bs, -(-pn // bs)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _dot_dtypes(x: torch.Tensor) -> dict[str, Any]:
    """The chunk kernels' matrix-product operands: rounded to ``DOT`` (float32, giving TF32 products for 16-bit
    inputs, or with :data:`LOW_PRECISION_DOTS` the 16-bit input dtype) and multiplied as ``DOT2``: ``DOT`` on GPUs;
    float32 under Triton's interpreter, whose ``tl.dot`` of 16-bit operands is wrong (it multiplies their bit
    patterns; the products of 16-bit values are exact in float32, so the result is the 16-bit product's)."""
    import triton.language as tl

    dot = tl.float32
    if LOW_PRECISION_DOTS and x.dtype in (torch.bfloat16, torch.float16):
        dot = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    return {"DOT": dot, "DOT2": tl.float32 if interpreting() else dot}


def _blocks(x: torch.Tensor, B: torch.Tensor, chunk_size: int, rows: int) -> dict[str, Any]:
    """The shape constants of the chunk kernels (tiles padded to powers of two, at least 16 for ``tl.dot``)."""
    H, P = x.shape[2:]
    G, N = B.shape[2:]
    prec = "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32"
    bm = max(16, min(rows, _pow2(chunk_size)))
    return {"H": H, "G": G, "P": P, "N": N, "L": chunk_size, "BP": max(16, _pow2(P)), "BN": max(16, _pow2(N)),
            "BM": bm, "PREC": prec, **_dot_dtypes(x)}  # fmt: skip


def _dims(x: torch.Tensor, B: torch.Tensor, chunk_size: int) -> tuple[int, int, int, int, int, int]:
    b, s, H, P = x.shape
    return b, s, H, P, B.shape[3], -(-s // chunk_size)


def _in_place(t: torch.Tensor) -> bool:
    """Whether the kernels read ``t`` (``[b, s, H, P]``, ``[b, s, G, N]`` or ``[b, s, H]``) through its batch and
    position strides as it is: its last dimensions dense (strides ``(P, 1)``; ``dt``'s last stride 1)."""
    return t.stride()[2:] == ((t.shape[3], 1) if t.dim() == 4 else (1,))


def _strided(*ts: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The inputs as the kernels read them (each itself, or a contiguous copy where :func:`_in_place` is false) and
    their batch and position strides, in order."""
    ts = tuple(t if _in_place(t) else t.contiguous() for t in ts)
    return ts, tuple(d for t in ts for d in t.stride()[:2])


Fwd = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("mcore_models::ssd_scan_fwd", mutates_args=())
def _ssd_fwd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None,
             chunk_size: int, dt_softplus: bool, dt_lo: float, dt_hi: float) -> Fwd:  # fmt: skip
    """``(y, final_states, state_in per chunk, processed dt, cum)``: the last three are kept for the backward."""
    k = _kernels()
    b, s, H, P, N, nc = _dims(x, B, chunk_size)
    (x, B, C, dt), (xs_b, xs_t, bs_b, bs_t, cs_b, cs_t, dts_b, dts_t) = _strided(x, B, C, dt)
    A = A.contiguous()
    f32: dict[str, Any] = {"device": x.device, "dtype": torch.float32}
    dtp, cum = torch.empty(b, H, s, **f32), torch.empty(b, H, s, **f32)
    bias = dt_bias.contiguous() if dt_bias is not None else A
    k["dt_fwd"][(nc, b * H)](dt, bias, A, dtp, cum, s, dts_b, dts_t, dt_lo, dt_hi, H=H, L=chunk_size,
                             BL=_pow2(chunk_size), HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus)  # fmt: skip
    tiles = _tiles(x)
    cfg = _blocks(x, B, chunk_size, tiles["_ROWS"])
    bm, launch = cfg.pop("BM"), {"num_warps": tiles["_WARPS"], "num_stages": tiles["_STAGES"]}
    states = torch.empty(b, nc, H, P, N, **f32)
    k["chunk_state"][(nc, b * H)](x, B, dtp, cum, states, s, nc, xs_b, xs_t, bs_b, bs_t, BK=bm, FROM_END=True,
                                  **launch, **cfg)  # fmt: skip
    final = torch.empty(b, H, P, N, **f32)
    init = initial_states.contiguous() if initial_states is not None else final
    bs, nt = _pass_tiles(P * N)
    k["state_pass"][(b * H, nt)](states, init, final, cum, states, final, s, nc, H=H, PN=P * N, L=chunk_size, BS=bs,
                                 HAS_INIT=initial_states is not None, REVERSE=False)  # fmt: skip
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    d = D.contiguous() if D is not None else A
    grid = (-(-chunk_size // bm), nc, b * H)
    k["chunk_out"][grid](x, B, C, dtp, cum, states, d, y, s, nc, xs_b, xs_t, bs_b, bs_t, cs_b, cs_t, BM=bm,
                         HAS_D=D is not None, **launch, **cfg)  # fmt: skip
    return y, final, states, dtp, cum


@_ssd_fwd.register_fake
def _(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
      D: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None,
      chunk_size: int, dt_softplus: bool, dt_lo: float, dt_hi: float) -> Fwd:  # fmt: skip
    b, s, H, P, N, nc = _dims(x, B, chunk_size)
    f32: dict[str, Any] = {"device": x.device, "dtype": torch.float32}
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(b, H, P, N, **f32),
            x.new_empty(b, nc, H, P, N, **f32), x.new_empty(b, H, s, **f32), x.new_empty(b, H, s, **f32))  # fmt: skip


Grads = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


@torch.library.custom_op("mcore_models::ssd_scan_bwd", mutates_args=())
def _ssd_bwd(dy: torch.Tensor, dfinal: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
             states: torch.Tensor, dtp: torch.Tensor, cum: torch.Tensor, chunk_size: int, dt_softplus: bool,
             dt_lo: float, dt_hi: float) -> Grads:  # fmt: skip
    """``(dx, d dt, dA, dB, dC, dD, d dt_bias, d initial_states)``; ``dD`` and ``d dt_bias`` float32 when absent,
    ``d initial_states`` float32."""
    k = _kernels()
    b, s, H, P, N, nc = _dims(x, B, chunk_size)
    (x, B, C, dy, dt), strides = _strided(x, B, C, dy, dt)
    tile_strides, (cs_b, cs_t, ys_b, ys_t), (dts_b, dts_t) = strides[:8], strides[4:8], strides[8:]  # x, B, C, dy
    A = A.contiguous()
    f32: dict[str, Any] = {"device": x.device, "dtype": torch.float32}
    tiles = _tiles(x)
    cfg = _blocks(x, B, chunk_size, tiles["_BWD_ROWS"])
    bm, launch = cfg.pop("BM"), {"num_warps": tiles["_BWD_WARPS"], "num_stages": tiles["_BWD_STAGES"]}
    ds = torch.empty(b, nc, H, P, N, **f32)  # the direct gradient of state_in_c, then the gradient of S_c
    k["chunk_state"][(nc, b * H)](dy, C, dtp, cum, ds, s, nc, ys_b, ys_t, cs_b, cs_t, BK=bm, FROM_END=False,
                                  num_warps=tiles["_WARPS"], num_stages=tiles["_STAGES"], **cfg)  # fmt: skip
    bs, nt = _pass_tiles(P * N)
    dinit, tpart = torch.empty(b, H, P, N, **f32), torch.empty(b, nc, H, nt, **f32)
    dfin = dfinal.contiguous().float() if dfinal is not None else dinit
    k["state_pass"][(b * H, nt)](ds, dfin, dinit, cum, states, tpart, s, nc, H=H, PN=P * N, L=chunk_size, BS=bs,
                                 HAS_INIT=dfinal is not None, REVERSE=True)  # fmt: skip
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    d = D.contiguous() if D is not None else A
    grid = (-(-chunk_size // bm), nc, b * H)
    cols = (x, B, C, dy, dtp, cum, ds, d, dx)
    if BACKWARD == "groups":
        aux, dB, dC, dt_blocks = _group_bwd(k, cols, states, tile_strides, chunk_size, tiles, cfg)
        k["bwd_cols"][grid](*cols, dx, aux, s, nc, *tile_strides, BM=bm, HAS_D=D is not None, PER_HEAD_DB=False,
                            **launch, **cfg)  # fmt: skip
    else:
        G = B.shape[2]
        db, dc = torch.empty(b, s, H, N, **f32), torch.empty(b, s, H, N, **f32)  # per head: summed over groups below
        aux = torch.empty(6, b, H, s, **f32)  # dt_bwd's rows: one block of plus and minus d cum partial sums
        k["bwd_cols"][grid](*cols, db, aux, s, nc, *tile_strides, BM=bm, HAS_D=D is not None, PER_HEAD_DB=True,
                            **launch, **cfg)  # fmt: skip
        k["bwd_rows"][grid](x, B, C, dy, dtp, cum, states, dc, aux, s, nc, *tile_strides, BM=bm, **launch, **cfg)
        dB = db.view(b, s, G, H // G, N).sum(3).to(B.dtype)
        dC = dc.view(b, s, G, H // G, N).sum(3).to(C.dtype)
        dt_blocks = {"NB": 1, "BM": _pow2(chunk_size), "PLUS_STATE": False}
    ddt, parts = torch.empty_like(dt, memory_format=torch.contiguous_format), torch.empty(3, b, nc, H, **f32)
    bias = dt_bias.contiguous() if dt_bias is not None else A
    k["dt_bwd"][(nc, b * H)](dt, bias, A, dtp, aux, tpart, ddt, parts, s, nc, nt, dts_b, dts_t, dt_lo, dt_hi, H=H,
                             L=chunk_size, BL=_pow2(chunk_size), BT=_pow2(nt), HAS_BIAS=dt_bias is not None,
                             SOFTPLUS=dt_softplus, **dt_blocks)  # fmt: skip
    dD = parts[2].sum((0, 1)).to(D.dtype if D is not None else torch.float32)
    dbias = parts[1].sum((0, 1)).to(dt_bias.dtype if dt_bias is not None else torch.float32)
    return dx, ddt, parts[0].sum((0, 1)).to(A.dtype), dB, dC, dD, dbias, dinit


def _group_bwd(k: dict[str, Any], cols: tuple[torch.Tensor, ...], states: torch.Tensor, tile_strides: tuple[int, ...],
               chunk_size: int, tiles: dict[str, int], cfg: dict[str, Any]) -> tuple[Any, ...]:  # fmt: skip
    """:data:`BACKWARD` ``"groups"``: ``dB`` and ``dC`` through ``dCB``, one ``L x L`` matrix per group and chunk,
    and the state terms summed over the group's heads (:mod:`mcore_models.ssm._ssd_group_kernels`). Returns the
    ``AUX`` rows for ``bwd_cols`` and ``dt_bwd`` (filled here but for rows 0 and 2), ``dB``, ``dC`` and
    ``dt_bwd``'s block constants."""
    x, B, C, dy, dtp, cum, ds = cols[:7]
    xs_b, xs_t, bs_b, bs_t, cs_b, cs_t, ys_b, ys_t = tile_strides
    b, s, H, _, _, nc = _dims(x, B, chunk_size)
    G = B.shape[2]
    f32: dict[str, Any] = {"device": x.device, "dtype": torch.float32}
    bm = max(16, min(tiles["_GRP_ROWS"], _pow2(chunk_size)))
    nb = -(-chunk_size // bm)
    launch = {"num_warps": tiles["_GRP_WARPS"], "num_stages": tiles["_BWD_STAGES"]}
    aux = torch.empty(4 + 2 * nb, b, H, s, **f32)
    dcb = torch.empty(b, nc, G, chunk_size, chunk_size, **f32)  # blocks above the diagonal are never read
    k["bwd_dcb"][(nb * (nb + 1) // 2, nc, b * G)](x, B, C, dy, dtp, cum, dcb, aux, s, nc, *tile_strides, BM=bm,
                                                  NB=nb, **launch, **cfg)  # fmt: skip
    dB, dC = (torch.empty(b, s, G, t.shape[3], device=x.device, dtype=t.dtype) for t in (B, C))
    k["bwd_dbdc"][(nb, nc, b * G)](dy, B, C, dcb, cum, dtp, states, dC, aux, s, nc, ys_b, ys_t, bs_b, bs_t, cs_b,
                                   cs_t, BM=bm, NB=nb, FOR_B=False, **launch, **cfg)  # fmt: skip
    k["bwd_dbdc"][(nb, nc, b * G)](x, C, B, dcb, cum, dtp, ds, dB, aux, s, nc, xs_b, xs_t, cs_b, cs_t, bs_b, bs_t,
                                   BM=bm, NB=nb, FOR_B=True, **launch, **cfg)  # fmt: skip
    return aux, dB, dC, {"NB": nb, "BM": bm, "PLUS_STATE": True}


@_ssd_bwd.register_fake
def _(dy: torch.Tensor, dfinal: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
      B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None, states: torch.Tensor,
      dtp: torch.Tensor, cum: torch.Tensor, chunk_size: int, dt_softplus: bool, dt_lo: float,
      dt_hi: float) -> Grads:  # fmt: skip
    b, _, H, P, N, _ = _dims(x, B, chunk_size)
    like = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, dt, A, B, C)]
    dD, dbias = (A.new_empty(H, dtype=t.dtype if t is not None else torch.float32) for t in (D, dt_bias))
    return (*like, dD, dbias, x.new_empty(b, H, P, N, dtype=torch.float32))  # type: ignore[return-value]


class _SSDScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None,
                chunk_size: int, dt_softplus: bool, dt_lo: float, dt_hi: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        cfg = (chunk_size, dt_softplus, dt_lo, dt_hi)
        y, final, states, dtp, cum = _ssd_fwd(x, dt, A, B, C, D, dt_bias, initial_states, *cfg)
        ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, initial_states, states, dtp, cum)
        ctx.cfg = cfg
        return y, final

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dfinal: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, dt, A, B, C, D, dt_bias, init, states, dtp, cum = ctx.saved_tensors
        grads = _ssd_bwd(dy, dfinal, x, dt, A, B, C, D, dt_bias, states, dtp, cum, *ctx.cfg)
        dx, ddt, dA, dB, dC, dD, dbias, dinit = grads
        return (dx, ddt, dA, dB, dC, dD if D is not None else None, dbias if dt_bias is not None else None,
                dinit.to(init.dtype) if init is not None else None, None, None, None, None)  # fmt: skip


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           chunk_size: int, tensors: list[torch.Tensor]) -> None:  # fmt: skip
    if x.dim() != 4 or B.dim() != 4 or B.shape != C.shape or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"ssd_scan: x [b, s, H, P] and B, C [b, s, G, N]; got {tuple(x.shape)}, {tuple(B.shape)}, "
                         f"{tuple(C.shape)}")  # fmt: skip
    H, G = x.shape[2], B.shape[2]
    if dt.shape != x.shape[:3] or A.shape != (H,) or H % G or chunk_size < 1 or x.shape[1] == 0:
        raise ValueError(f"ssd_scan: dt [b, s, H], A [H], H % G == 0, chunk_size >= 1 and s >= 1; got dt "
                         f"{tuple(dt.shape)}, A {tuple(A.shape)}, G={G}, chunk_size={chunk_size}")  # fmt: skip
    check_devices("ssd_scan_triton", tensors, "; use impl='torch'")


def ssd_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD scan: ``y`` ``[b, s, H, P]`` in ``x``'s dtype (and the final states ``[b, H, P, N]``, float32,
    with ``return_final_states``); differentiable in every tensor argument. ``dt`` is raw: ``dt_bias`` is added,
    then softplus (``dt_softplus``), then the clamp to ``dt_limit``."""
    tensors = [t for t in (x, dt, A, B, C, D, dt_bias, initial_states) if t is not None]
    _check(x, dt, A, B, C, chunk_size, tensors)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    y, final = _SSDScan.apply(x, dt, A, B, C, D, dt_bias, initial_states, chunk_size, dt_softplus, lo, hi)
    return (y, final) if return_final_states else y
