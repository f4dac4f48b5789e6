"""Zeroed int32 counters that kernels take with atomic adds and leave zero again, kept per device and user.

A kernel whose last program to finish a group of programs does the group's final step (the paged attention's split
combine, the argmax over a row's chunks) counts the group's finished programs in one counter; that last program
resets it. The counters are zeroed once and kept: a CUDA graph that captured a kernel replays it on the same
address, so no buffer once handed out is ever freed.
"""

from __future__ import annotations

import torch

__all__ = ["zeroed_counters"]

_KEPT: dict[tuple[str, str], list[torch.Tensor]] = {}


def zeroed_counters(device: torch.device, n: int, user: str) -> torch.Tensor | None:
    """At least ``n`` int32 zeros on ``device`` for ``user`` (each kernel call leaves them zero), or None inside a
    CUDA-graph capture when none are large enough yet (the caller then takes its path without counters)."""
    kept = _KEPT.setdefault((str(device), user), [])
    if kept and kept[-1].numel() >= n:
        return kept[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    kept.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return kept[-1]
