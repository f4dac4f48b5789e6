"""The SSD scan of Mamba-2 (Dao & Gu 2024, "Transformers are SSMs"), chunked, in PyTorch ops.

Each head ``h`` runs the selective state-space recurrence over the sequence::

    dt_t    = clamp(softplus(dt_raw_t + dt_bias), dt_limit)
    state_t = exp(dt_t A) state_{t-1} + dt_t x_t ⊗ B_t          state [P, N]
    y_t     = state_t C_t + D x_t

with ``A`` a negative scalar per head and ``B``, ``C`` of the head's group. The chunked form (SSD's block
decomposition of the semiseparable matrix) splits the sequence into chunks of ``chunk_size``:

1. within each chunk, the quadratic (attention-like) form ``y = (L ∘ C Bᵀ) (dt x)`` with the decay mask
   ``L[l, s] = exp(sum_{s < k <= l} dt_k A)`` (the "segment sum");
2. each chunk's final state as if it started from zero;
3. the recurrence over chunks, ``h_c = exp(sum of the chunk's dt A) h_{c-1} + state_c`` (the same segment sum over the
   chunk totals, as one matmul);
4. each position's contribution from the state entering its chunk, ``C_l exp(cumsum dt A)_l h_{c-1}``.

Everything runs in float32 (float64 for float64 inputs) and differentiates through PyTorch's autograd. A sequence
that is not a multiple of ``chunk_size`` is padded with ``dt = 0`` steps, identities of the recurrence, so the final
state is exact. Heads of one group share ``B`` and ``C`` through a ``[G, H / G]`` view; they are never repeated.

``impl="triton"`` (or ``"auto"`` on CUDA) runs ``mcore_models.ssm.ssd_triton.ssd_scan_triton`` instead, which takes
the same arguments.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F

__all__ = ["ssd_scan", "ssd_reference"]

logger = logging.getLogger(__name__)

Impl = Literal["auto", "torch", "triton"]
NO_LIMIT = (0.0, math.inf)


@overload
def ssd_scan(
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
    dt_limit: tuple[float, float] = NO_LIMIT,
    initial_states: torch.Tensor | None = None,
    return_final_states: Literal[False] = False,
    impl: Impl = "torch",
) -> torch.Tensor: ...


@overload
def ssd_scan(
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
    dt_limit: tuple[float, float] = NO_LIMIT,
    initial_states: torch.Tensor | None = None,
    return_final_states: Literal[True],
    impl: Impl = "torch",
) -> tuple[torch.Tensor, torch.Tensor]: ...


def ssd_scan(
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
    dt_limit: tuple[float, float] = NO_LIMIT,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    impl: Impl = "torch",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's SSD scan, chunked.

    ``x`` ``[b, s, H, P]``; ``dt`` ``[b, s, H]`` raw (``dt_bias`` added, then softplus when ``dt_softplus``, then
    clamped to ``dt_limit``); ``A`` ``[H]`` (negative, ``-exp(A_log)``); ``B``, ``C`` ``[b, s, G, N]`` (head ``h``
    uses group ``h // (H / G)``); ``D`` ``[H]`` skip; ``initial_states`` ``[b, H, P, N]``.

    Returns ``y`` ``[b, s, H, P]`` in ``x``'s dtype and, with ``return_final_states``, the state after the last
    position ``[b, H, P, N]`` (float32; float64 for float64 inputs). ``impl``: ``torch`` (this module), ``triton``
    (``mcore_models.ssm.ssd_triton``; an error when it cannot be imported) or ``auto`` (triton for CUDA tensors when
    it imports, else torch).
    """
    _check_shapes(x, dt, A, B, C, D, dt_bias, initial_states, chunk_size)
    args = dict(chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                initial_states=initial_states, return_final_states=return_final_states)  # fmt: skip
    kernel = _triton_kernel(impl, x)
    if kernel is not None:
        return kernel(x, dt, A, B, C, **args)  # type: ignore[no-any-return]
    return _ssd_torch(x, dt, A, B, C, **args)  # type: ignore[arg-type]


@functools.cache
def _import_triton() -> tuple[Callable[..., Any] | None, str]:
    """``ssd_scan_triton`` and ``""``, or None and why it could not be imported."""
    try:
        from mcore_models.ssm.ssd_triton import ssd_scan_triton  # type: ignore[import-not-found,unused-ignore]
    except Exception as e:  # a missing module, a missing triton, or a kernel that fails to build
        return None, f"{type(e).__name__}: {e}"
    return ssd_scan_triton, ""


def _triton_kernel(impl: str, x: torch.Tensor) -> Callable[..., Any] | None:
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"ssd_scan impl={impl!r} is not one of auto, torch, triton")
    if impl == "torch" or (impl == "auto" and not x.is_cuda):
        return None
    kernel, why = _import_triton()
    if kernel is None and impl == "triton":
        raise RuntimeError(
            f"ssd_scan(impl='triton'): mcore_models.ssm.ssd_triton.ssd_scan_triton is not usable ({why}); "
            "use impl='torch' (or 'auto', which falls back to it)"
        )
    if kernel is None:
        logger.debug("ssd_scan(impl='auto'): the Triton scan is not usable (%s); running the PyTorch scan", why)
    return kernel


def _check_shapes(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    chunk_size: int,
) -> None:
    if x.dim() != 4 or B.dim() != 4:
        raise ValueError(f"ssd_scan: x must be [b, s, H, P] and B, C [b, s, G, N]; got {tuple(x.shape)}, "
                         f"{tuple(B.shape)}")  # fmt: skip
    b, s, H, P = x.shape
    G, N = B.shape[2:]
    wanted: dict[str, tuple[torch.Tensor | None, tuple[int, ...]]] = {
        "dt": (dt, (b, s, H)),
        "A": (A, (H,)),
        "B": (B, (b, s, G, N)),
        "C": (C, (b, s, G, N)),
        "D": (D, (H,)),
        "dt_bias": (dt_bias, (H,)),
        "initial_states": (initial_states, (b, H, P, N)),
    }
    for name, (t, shape) in wanted.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"ssd_scan: {name} has shape {tuple(t.shape)}, expected {shape} (x is {tuple(x.shape)})")
    if G < 1 or H % G:
        raise ValueError(f"ssd_scan: the {H} heads are not divisible by the {G} groups of B and C")
    if chunk_size < 1:
        raise ValueError(f"ssd_scan: chunk_size={chunk_size} must be positive")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 tensors, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _time_steps(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool, limit: tuple[float, float], dtype: torch.dtype
) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), limit)`` in ``dtype``."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if softplus:
        dt = F.softplus(dt)
    if tuple(limit) != NO_LIMIT:
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(a[..., j + 1 : i + 1])`` for ``i >= j``, ``-inf`` above the diagonal.

    Summed along a masked copy rather than as a difference of cumulative sums, so long chunks keep the precision of
    short ones; the ``-inf`` entries become exact zeros (and zero gradients) under ``exp``."""
    T = a.shape[-1]
    below = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    seg = a[..., None].expand(*a.shape, T).masked_fill(~below, 0.0).cumsum(-2)
    return seg.masked_fill(~below.logical_or(torch.eye(T, dtype=torch.bool, device=a.device)), -math.inf)


def _ssd_torch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    initial_states: torch.Tensor | None,
    return_final_states: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    b, s, H, P = x.shape
    G, N = B.shape[2:]
    R, L, cdt = H // G, chunk_size, _compute_dtype(x)
    pad = -s % L
    c = (s + pad) // L
    steps = F.pad(_time_steps(dt, dt_bias, dt_softplus, dt_limit, cdt), (0, 0, 0, pad))  # dt = 0: identity steps
    xc = F.pad(x.to(cdt), (0, 0, 0, 0, 0, pad)).reshape(b, c, L, G, R, P)
    Bc = F.pad(B.to(cdt), (0, 0, 0, 0, 0, pad)).reshape(b, c, L, G, N)
    Cc = F.pad(C.to(cdt), (0, 0, 0, 0, 0, pad)).reshape(b, c, L, G, N)
    steps = steps.reshape(b, c, L, G, R)
    dA = (steps * A.to(cdt).view(G, R)).permute(0, 3, 4, 1, 2)  # [b, G, R, c, L]
    dA_cum = dA.cumsum(-1)
    xdt = xc * steps[..., None]  # [b, c, L, G, R, P]

    # 1. within chunks: y[l] = sum_{s <= l} (C_l . B_s) exp(segsum)[l, s] dt_s x_s
    scores = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)[:, :, None] * torch.exp(_segsum(dA))  # [b, G, R, c, L, L]
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", scores, xdt)

    # 2. each chunk's final state from a zero start
    to_end = torch.exp(dA_cum[..., -1:] - dA_cum)  # [b, G, R, c, L]
    states = torch.einsum("bclgn,bgrcl,bclgrp->bcgrpn", Bc, to_end, xdt)

    # 3. the recurrence over chunks as one matmul with the chunk-level decay mask
    if initial_states is None:
        start = states.new_zeros(b, 1, G, R, P, N)
    else:
        start = initial_states.to(cdt).reshape(b, 1, G, R, P, N)
    chunk_decay = torch.exp(_segsum(F.pad(dA_cum[..., -1], (1, 0))))  # [b, G, R, c + 1, c + 1]
    states = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, torch.cat([start, states], dim=1))

    # 4. the state entering each chunk, carried to each of its positions
    y = y + torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", Cc, states[:, :-1], torch.exp(dA_cum))
    if D is not None:
        y = y + xc * D.to(cdt).view(G, R, 1)
    out = y.reshape(b, c * L, H, P)[:, :s].to(x.dtype)
    if return_final_states:
        return out, states[:, -1].reshape(b, H, P, N)
    return out


def ssd_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = NO_LIMIT,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of :func:`ssd_scan` one position at a time (for tests: slow, plain, the same arguments)."""
    _check_shapes(x, dt, A, B, C, D, dt_bias, initial_states, 1)
    b, s, H, P = x.shape
    N, cdt = B.shape[3], _compute_dtype(x)
    repeat = H // B.shape[2]
    xs, Bh, Ch = x.to(cdt), B.to(cdt).repeat_interleave(repeat, 2), C.to(cdt).repeat_interleave(repeat, 2)
    steps = _time_steps(dt, dt_bias, dt_softplus, dt_limit, cdt)
    state = xs.new_zeros(b, H, P, N) if initial_states is None else initial_states.to(cdt)
    ys = []
    for t in range(s):
        decay = torch.exp(steps[:, t] * A.to(cdt))  # [b, H]
        state = decay[..., None, None] * state + (steps[:, t, :, None] * xs[:, t])[..., None] * Bh[:, t, :, None]
        y = torch.einsum("bhpn,bhn->bhp", state, Ch[:, t])
        ys.append(y if D is None else y + D.to(cdt)[:, None] * xs[:, t])
    out = torch.stack(ys, dim=1).to(x.dtype) if ys else x.new_zeros(x.shape)
    return (out, state) if return_final_states else out
