"""The greedy draw: each row's argmax as one Triton kernel, torch's ``argmax(-1)`` bit for bit.

``torch.argmax`` of one row of a 32k vocabulary took 10.6 µs on an H200, a decode step's largest kernel after the
weight-streaming GEMMs and the attention. Here program ``(r, c)`` reduces chunk ``c`` of row ``r`` (``BLOCK``
logits) to its first NaN or else its largest value and that value's first index, stores them, and takes the row's
counter with an atomic add (:mod:`~mcore_infer.kernels._counters`); the last of the row's programs to finish picks
the row's answer from the chunks' (the first NaN, else the largest value, ties to the lowest index: torch's rule)
and resets the counter. On the CPU outside ``TRITON_INTERPRET=1``, and for float64, it is ``argmax(-1)``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mcore_infer.kernels._counters import zeroed_counters
from mcore_infer.kernels.norm_linear import _use_triton, gdc_launch

__all__ = ["row_argmax"]

BLOCK = 2048
_KERNEL: Any = None
_FAILED: str | None = None
"""Why the kernel could not run (it is then never tried again), else None."""
log = logging.getLogger(__name__)


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit  # type: ignore[misc]
    def argmax(X, PV, PI, PN, CNT, OUT, V, CHUNKS, stride_x,  # type: ignore[no-untyped-def]
               BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
        if GDC:  # (a programmatic dependent: the logits are read after the kernel that writes them is done)
            gdc_launch_dependents()
            gdc_wait()
        r = tl.program_id(0)
        c = tl.program_id(1)
        big = 2147483647
        offs = c * BLOCK + tl.arange(0, BLOCK)
        inside = offs < V
        x = tl.load(X + r.to(tl.int64) * stride_x + offs, mask=inside, other=float("-inf")).to(tl.float32)
        nan = (x != x) & inside
        first_nan = tl.min(tl.where(nan, offs, big), 0)
        x = tl.where(nan, float("-inf"), x)
        m = tl.max(x, 0)
        first_max = tl.min(tl.where((x == m) & inside, offs, big), 0)
        slot = r * CHUNKS + c
        tl.store(PV + slot, m)
        tl.store(PI + slot, tl.where(first_nan < big, first_nan, first_max))
        tl.store(PN + slot, (first_nan < big).to(tl.int32))
        tl.debug_barrier()  # the chunk's result stored before the counter is released
        if tl.atomic_add(CNT + r, 1, sem="acq_rel") == CHUNKS - 1:
            cs = tl.arange(0, CHUNKS_PAD)
            valid = cs < CHUNKS
            vals = tl.load(PV + r * CHUNKS + cs, mask=valid, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(PI + r * CHUNKS + cs, mask=valid, other=big, cache_modifier=".cg")
            nans = tl.load(PN + r * CHUNKS + cs, mask=valid, other=0, cache_modifier=".cg")
            nan_idx = tl.min(tl.where(nans > 0, idxs, big), 0)
            best = tl.max(vals, 0)
            best_idx = tl.min(tl.where(valid & (vals == best), idxs, big), 0)
            tl.store(OUT + r, tl.where(nan_idx < big, nan_idx, best_idx).to(tl.int64))
            tl.atomic_xchg(CNT + r, 0)

    _KERNEL = argmax
    return _KERNEL


def row_argmax(logits: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[rows, vocab]`` logits (int64 ``[rows]``): the first index of each row's largest
    value, or of its first NaN. ``out`` (int64 ``[rows]``, contiguous): written and returned instead of a new
    tensor (the engine passes the next decode step's input ids, so the step needs no copy of them). ``pdl``: launched
    as a programmatic dependent of the kernel before it (Hopper and later)."""
    global _FAILED
    if out is not None and (out.shape != logits.shape[:1] or out.dtype != torch.int64 or not out.is_contiguous()):
        raise ValueError(f"row_argmax: out must be contiguous int64 [{logits.shape[0]}], got {out.dtype} "
                         f"{tuple(out.shape)}")  # fmt: skip
    if _FAILED is not None or logits.dim() != 2 or not _use_triton(logits) or 0 in logits.shape:
        return _torch_argmax(logits, out)
    rows, v = logits.shape
    counters = zeroed_counters(logits.device, rows, "argmax")
    if counters is None or logits.stride(-1) != 1:
        return _torch_argmax(logits, out)
    chunks = -(-v // BLOCK)
    pv = torch.empty(rows, chunks, device=logits.device, dtype=torch.float32)
    pi = torch.empty(rows, chunks, device=logits.device, dtype=torch.int32)
    pn = torch.empty(rows, chunks, device=logits.device, dtype=torch.int32)
    if out is None:
        out = torch.empty(rows, device=logits.device, dtype=torch.int64)
    try:
        _kernel()[(rows, chunks)](logits, pv, pi, pn, counters, out, v, chunks, logits.stride(0), BLOCK=BLOCK,
                                  CHUNKS_PAD=max(2, 1 << (chunks - 1).bit_length()), num_warps=8,
                                  **gdc_launch(logits, pdl))  # fmt: skip
    except Exception as e:  # a Triton that cannot compile it: torch's argmax from now on, said once
        _FAILED = f"{type(e).__name__}: {e}"
        log.warning("the argmax kernel failed (%s); greedy draws use torch.argmax", _FAILED)
        return _torch_argmax(logits, out)
    return out


def _torch_argmax(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return logits.argmax(-1)
    return torch.argmax(logits, -1, out=out)
