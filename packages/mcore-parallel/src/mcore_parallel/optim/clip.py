"""Global gradient norm, clipping and zero counting across model-parallel (and data-parallel) ranks.

Each rank passes the gradients it *owns for the norm*: replicated parameters (no ``tensor_model_parallel``
attribute) only on tensor-parallel rank 0, the shared embedding only on the first pipeline stage. The squares are
summed locally and then over ``group`` (model-parallel ranks, plus data-parallel ranks under the distributed
optimizer where each holds a disjoint shard, or the world with data-parallel replicas passed by one rank only when
expert parameters are laid out differently), so each element is counted exactly once.
"""

from __future__ import annotations

import torch

from mcore_parallel.state import Group
from mcore_parallel.tensor import _comm

__all__ = [
    "global_grad_norm",
    "global_grad_norm_tensor",
    "clip_coefficient",
    "clip_grads_",
    "count_zeros",
    "count_zeros_tensor",
]


def _device(grads: list[torch.Tensor]) -> torch.device:
    return grads[0].device if grads else torch.device("cpu")


def global_grad_norm_tensor(
    grads: list[torch.Tensor], group: Group, device: torch.device | None = None
) -> torch.Tensor:
    """L2 norm over every element of ``grads`` on every rank of ``group``, as a float64 tensor of shape ``[1]`` on
    the device (no host synchronisation).

    Per-tensor norms come from one multi-tensor kernel (float32 accumulation, no float64 copy of the gradients);
    their squares are summed in float64, locally and over the group.
    """
    total = torch.zeros(1, dtype=torch.float64, device=device or _device(grads))
    if grads:
        norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32)
        total += torch.stack(norms).double().pow(2).sum()
    _comm.all_reduce(total, group)
    return total.sqrt_()


def global_grad_norm(grads: list[torch.Tensor], group: Group, device: torch.device | None = None) -> float:
    """:func:`global_grad_norm_tensor` as a Python float (synchronises with the device)."""
    return float(global_grad_norm_tensor(grads, group, device).item())


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` as a float32 tensor on ``total_norm``'s device."""
    return torch.clamp(max_norm / (total_norm.reshape(()) + 1e-6), max=1.0).float()


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: float | torch.Tensor) -> float | torch.Tensor:
    """Scale ``grads`` in place by ``max_norm / total_norm`` when that is below 1; returns the factor used.

    With a tensor ``total_norm`` the factor stays on the device (every gradient is multiplied, by 1 when no clipping
    is needed) and is returned as a tensor: no host synchronisation."""
    if isinstance(total_norm, torch.Tensor):
        coef_t = clip_coefficient(max_norm, total_norm)
        if grads:
            torch._foreach_mul_(grads, coef_t)
        return coef_t
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)
        return coef
    return 1.0


def count_zeros_tensor(grads: list[torch.Tensor], group: Group, device: torch.device | None = None) -> torch.Tensor:
    """Number of exactly-zero gradient elements over ``group``, as a float64 tensor of shape ``[1]`` on the device
    (no host synchronisation): one count-nonzero kernel per gradient."""
    total = torch.zeros(1, dtype=torch.float64, device=device or _device(grads))
    if grads:
        nonzero = torch.stack([torch.count_nonzero(g) for g in grads]).sum()
        total += sum(g.numel() for g in grads) - nonzero
    _comm.all_reduce(total, group)
    return total


def count_zeros(grads: list[torch.Tensor], group: Group, device: torch.device | None = None) -> int:
    """:func:`count_zeros_tensor` as a Python int (synchronises with the device)."""
    return int(count_zeros_tensor(grads, group, device).item())
