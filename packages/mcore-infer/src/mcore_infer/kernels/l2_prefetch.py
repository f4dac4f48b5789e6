"""A weight pulled into the GPU's L2 cache by a kernel that runs before the one that reads it.

A batch-1 decode step alternates kernels that stream weights from HBM (the projections' GEMVs) with the paged
attention, which reads little (a short context's keys and values) and leaves the memory system idle for its few
microseconds. Programs added to the attention's grid can use that time to prefetch the next kernel's weight (the
output projection's) into L2, so that kernel then reads it from there. The prefetch is a hint: it changes no value,
only where the next kernel finds its bytes.

Each added program issues one ``cp.async.bulk.prefetch.L2.global`` (Hopper, compute capability 9.0 and newer) for its
share of the weight, from one thread, and exits without waiting for the bytes. Under Triton's interpreter (which runs
no PTX) the programs do nothing. :func:`helper` is the Triton function a kernel calls; :func:`prefetch_args` the
launch arguments a kernel takes for it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Region", "helper", "prefetch_args", "supported"]


def supported(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device can prefetch into L2 this way (CUDA, compute capability 9.0 or newer); under
    ``TRITON_INTERPRET=1`` the programs are launched but do nothing (tests of the grid)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (9, 0)


Region = tuple[torch.Tensor, int]
"""A tensor and how many of its first bytes to prefetch."""


def prefetch_args(regions: Sequence[Region] | None, unused: torch.Tensor) -> dict[str, Any]:
    """The arguments of a kernel that calls :func:`helper` for up to two ``regions``: ``PF``/``pf_bytes`` and
    ``PF2``/``pf2_bytes`` (``unused`` and 0 where there is none), ``PF_ROWS`` (the rows of programs the kernel adds,
    one a region) and ``PF_ASM`` (they issue the prefetch: not under the interpreter). A region whose tensor is not
    contiguous or not 16-byte aligned, or of no bytes, is dropped."""
    kept = [(t, min(int(n), t.numel() * t.element_size())) for t, n in regions or ()
            if n > 0 and t.is_contiguous() and t.data_ptr() % 16 == 0]  # fmt: skip
    if len(kept) > 2:
        raise ValueError(f"prefetch_args: {len(kept)} regions; the kernels take two at most")
    (pf, nbytes), (pf2, nbytes2) = [*kept, (unused, 0), (unused, 0)][:2]
    rows = len(kept)
    return {"PF": pf, "pf_bytes": nbytes, "PF2": pf2, "pf2_bytes": nbytes2, "PF_ROWS": rows,
            "PF_ASM": rows > 0 and os.environ.get("TRITON_INTERPRET") != "1"}  # fmt: skip


@functools.cache
def helper() -> Any:
    """``_prefetch_l2(PF, nbytes, i, n, ASM)``: program ``i`` of ``n`` prefetches its share of the ``nbytes`` bytes
    at ``PF`` (shares of whole 128-byte lines; sizes in multiples of 16 bytes, as the instruction takes them)."""
    import triton
    import triton.language as tl

    globals()["tl"] = tl  # (Triton's interpreter looks for triton.language among a jit function's globals)

    @triton.jit  # type: ignore[misc]
    def _prefetch_l2(PF, nbytes, i, n, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
        share = (nbytes // n + 127) // 128 * 128
        start = i.to(tl.int64) * share
        size = tl.minimum(share, nbytes - start) // 16 * 16
        if ASM:  # noqa: SIM102  (a constexpr test, then one at run time)
            if size > 0:
                base = PF.to(tl.pointer_type(tl.int8)) + start
                # thread 0 prefetches `size` ($2) bytes from `base` ($1) into L2 ($0: an unused result)
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; .reg .b32 r; mov.u32 r, %tid.x; setp.eq.u32 p, r, 0; "
                    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                    "=r,l,r", [base, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip

    return _prefetch_l2
