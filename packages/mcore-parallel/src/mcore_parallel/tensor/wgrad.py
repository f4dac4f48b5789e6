"""The weight gradient of mcore's linear autograd functions, added straight into ``main_grad`` when fused
(``DDPConfig.gradient_accumulation_fusion``), and the parameter it goes to under activation recompute."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fuses_wgrad", "keep_owner", "weight_grad", "wgrad_owner"]


def fuses_wgrad(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s gradient goes straight into its ``main_grad`` (``DDPConfig.gradient_accumulation_fusion``)."""
    return bool(getattr(weight, "fuse_wgrad_accumulation", False)) and hasattr(weight, "main_grad")


def keep_owner(ctx: Any, weight: torch.Tensor, fuse: bool) -> None:
    """Remember the parameter whose ``main_grad`` a fused weight gradient goes into.

    The weight in ``ctx.saved_tensors`` is not always that parameter: under activation recompute
    (``torch.utils.checkpoint``, non-reentrant) the backward unpacks the tensors saved by the re-run forward, which the
    checkpoint stores detached, so they share the data but have none of the parameter's attributes (``main_grad``,
    ``grad_added_to_main_grad``). The ctx of the first forward is the one backward sees, so the parameter is kept on it.
    """
    ctx.wgrad_owner = weight if fuse else None


def wgrad_owner(ctx: Any, saved: torch.Tensor) -> torch.Tensor:
    """The parameter kept by :func:`keep_owner` (``saved`` when the gradient is not fused)."""
    owner = ctx.wgrad_owner
    return saved if owner is None else owner


def weight_grad(weight: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor, fuse: bool) -> torch.Tensor:
    """``g2ᵀ x2``, the gradient of ``weight`` in ``y = x Wᵀ`` (2-D views). With ``fuse`` it is added into
    ``weight.main_grad`` by the GEMM itself (float32 accumulation of bf16/fp16 inputs on CUDA) and an uninitialised
    placeholder is returned so that autograd's accumulation hooks still run; the DDP hook sees
    ``grad_added_to_main_grad`` and drops it. With ``fuse``, ``weight`` must be the parameter itself (see
    :func:`keep_owner`), not a tensor saved for backward."""
    if not fuse:
        return g2.t().matmul(x2)
    main = weight.main_grad  # type: ignore[attr-defined]
    if main.is_cuda and g2.dtype in (torch.bfloat16, torch.float16) and main.dtype == torch.float32:
        torch.ops.aten.addmm.dtype_out(main, g2.t(), x2, torch.float32, out=main)
    elif g2.dtype == main.dtype:
        main.addmm_(g2.t(), x2)
    else:  # reduced precision on the CPU: the same GEMM as the unfused path, then the float32 add
        main.add_(g2.t().matmul(x2))
    weight.grad_added_to_main_grad = True  # type: ignore[attr-defined]
    return torch.empty_like(weight)
