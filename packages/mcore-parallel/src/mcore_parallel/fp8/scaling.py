"""Scaling math: absolute maxima, scales, the FP8 cast, and the delayed-scaling state of one linear.

A tensor ``t`` is stored as ``q = cast(t * scale)`` with ``scale = fmt.max / amax(t) / 2**margin``, so its largest
element lands on the format's largest value; ``t ≈ q * scale_inv`` with ``scale_inv = 1 / scale`` (what
``torch._scaled_mm`` takes). The cast rounds to nearest and saturates at ``±fmt.max`` (values a delayed scale
pushes beyond the range are clamped, never turned into NaN). An all-zero tensor (or row) gets scale 1; a non-finite
maximum gives a non-finite result, so a diverged step still shows up in the loss.

Operands are 2-D and keep the contraction dimension last (``[rows, K]``): the layout both operands of
``torch._scaled_mm`` need (the second one is passed transposed, i.e. column-major). Tensorwise scales are 0-d,
rowwise scales ``[rows, 1]``.

On CUDA the tensorwise amax and every cast run as Triton kernels (:mod:`mcore_parallel.fp8.cast_triton`: one
reduction pass, one pass that writes the FP8 tensor and, where asked, its transpose from the same tile), when Triton
imports; the rowwise amax (and, without Triton, everything) as ``torch.compile``-generated kernels, called from the
eager FP8 linear (each helper a function of its own, with its own compile cache); elsewhere as plain PyTorch ops.
Both give the same bytes. ``CAST_KERNELS`` (``"auto"`` or ``"torch"``) picks, for benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mcore_parallel.fp8 import cast_triton
from mcore_parallel.fp8.recipe import Fp8Format
from mcore_parallel.state import Group
from mcore_parallel.tensor import _comm

__all__ = ["Fp8Tensor", "DelayedScaling", "amax_of", "scale_from_amax", "quantize", "current_scale", "ROLES"]

ROLES = ("input", "weight", "grad")
"""The tensors of one linear that delayed scaling tracks, in the order of its buffers' columns."""

_COMPILED: dict[str, Callable[..., Any]] = {}
CAST_KERNELS = "auto"
"""``auto``: the Triton casts on CUDA when Triton imports; ``torch``: the compiled PyTorch ops there too."""


def _triton(t: torch.Tensor) -> bool:
    return t.is_cuda and CAST_KERNELS == "auto" and cast_triton.available()


def _triton_amax(t: torch.Tensor, rowwise: bool) -> bool:
    """Whether ``t``'s amax is the Triton reduction (tensorwise, contiguous, on CUDA)."""
    return not rowwise and _triton(t) and t.is_contiguous()


def _kernel(name: str, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``fn`` compiled (once, shape-dynamic) for CUDA tensors; ``fn`` itself elsewhere."""
    if device.type != "cuda":
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


@dataclass(frozen=True)
class Fp8Tensor:
    """``data`` (float8, ``[rows, K]``) times ``scale_inv`` (float32: 0-d, or ``[rows, 1]`` per row)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: Fp8Format

    @property
    def rowwise(self) -> bool:
        return self.scale_inv.dim() > 0

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale_inv).to(dtype)

    def t(self) -> Fp8Tensor:
        """The transpose ``[K, rows]``, contiguous (tensorwise only: a rowwise scale would run along ``K``)."""
        if self.rowwise:
            raise ValueError("the transpose of a rowwise-scaled FP8 tensor needs a new quantisation, not a copy")
        return Fp8Tensor(self.data.t().contiguous(), self.scale_inv, self.fmt)


def _amax(t: torch.Tensor, rowwise: bool) -> torch.Tensor:
    a = t.abs()
    return (a.amax(dim=-1, keepdim=True) if rowwise else a.amax()).to(torch.float32)


def amax_of(t: torch.Tensor, rowwise: bool = False, group: Group | None = None) -> torch.Tensor:
    """The largest ``|t|`` (float32; per row of a 2-D ``t`` with ``rowwise``), the maximum over ``group`` when given
    (the tensor's elements are split over its ranks)."""
    if _triton_amax(t, rowwise):
        m = cast_triton.amax_triton(t)
    else:
        m = _kernel("amax_rowwise" if rowwise else "amax", _amax, t.device)(t, rowwise)
    if group is not None and group.size > 1:
        m = _comm.all_reduce(m.contiguous(), group, op=dist.ReduceOp.MAX)
    return m


def _scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    amax = amax.to(torch.float32)
    return torch.where(amax > 0, top / amax, torch.ones_like(amax))


def scale_from_amax(amax: torch.Tensor, fmt: Fp8Format, margin: int = 0) -> torch.Tensor:
    """``fmt.max / amax / 2**margin`` (float32), 1 where ``amax`` is 0 (an all-zero tensor is stored exactly)."""
    return _scale(amax, fmt.max / 2.0**margin)


def _amax_scale(t: torch.Tensor, rowwise: bool, top: float) -> torch.Tensor:
    return _scale(_amax(t, rowwise), top)


def current_scale(t: torch.Tensor, fmt: Fp8Format, rowwise: bool, margin: int, group: Group | None) -> torch.Tensor:
    """The scale of ``t`` from its own absolute maximum (over ``group`` when its elements are split there); one
    kernel on CUDA when no group is involved."""
    if (group is None or group.size == 1) and not _triton_amax(t, rowwise):
        return _kernel("amax_scale", _amax_scale, t.device)(t, rowwise, fmt.max / 2.0**margin)
    return scale_from_amax(amax_of(t, rowwise, group), fmt, margin)


def _cast(t: torch.Tensor, scale: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q = (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def _cast_transposed(
    t: torch.Tensor, scale: torch.Tensor, fmax: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    return q, q.t().contiguous(), scale.reciprocal()


def quantize(t: torch.Tensor, fmt: Fp8Format, scale: torch.Tensor) -> Fp8Tensor:
    """``t`` (2-D, ``[rows, K]``) in ``fmt`` with ``scale`` (0-d, or ``[rows, 1]``)."""
    if _triton(t):
        q, _ = cast_triton.cast_triton(t, scale, fmt.max, fmt.dtype, False)
        return Fp8Tensor(q, scale.reciprocal(), fmt)
    q, inv = _kernel("cast", _cast, t.device)(t, scale, fmt.max, fmt.dtype)
    return Fp8Tensor(q, inv, fmt)


def quantize_with_transpose(t: torch.Tensor, fmt: Fp8Format, scale: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
    """``quantize(t)`` and its transpose from one pass (tensorwise ``scale`` only)."""
    if _triton(t):
        q, qt = cast_triton.cast_triton(t, scale, fmt.max, fmt.dtype, True)
        inv = scale.reciprocal()
        return Fp8Tensor(q, inv, fmt), Fp8Tensor(qt, inv, fmt)  # type: ignore[arg-type]
    q, qt, inv = _kernel("cast_t", _cast_transposed, t.device)(t, scale, fmt.max, fmt.dtype)
    return Fp8Tensor(q, inv, fmt), Fp8Tensor(qt, inv, fmt)


class DelayedScaling(nn.Module):
    """The delayed-scaling state of one linear: for its input, weight and output gradient (:data:`ROLES`), the
    absolute maxima of the last ``history_len`` optimizer steps and the scales computed from them.

    ``amax_history`` (``[history_len, 3]``, newest first) and ``scale`` (``[3]``; 0 = no history yet) are
    persistent buffers, saved in checkpoints; ``amax`` (``[3]``) collects the current step's maxima (the largest over
    its micro-batches, recomputed forwards included) until :meth:`roll` pushes them into the history. The maxima
    are local to a rank while a step runs: :func:`~mcore_parallel.fp8.fp8_step` reduces them over the ranks that hold
    pieces or copies of the layer's tensors before rolling, so every rank keeps the same history, the history of the
    whole (unsharded) tensor.

    Gradient maxima are kept per unit of loss weight: a pipeline schedule backpropagates each micro-batch's loss
    times ``grad_weight`` (1 / micro-batches per rank, times an fp16 loss scale and the context-parallel size in
    mcore-train), which depends on the layout, so the history holds ``|g| / grad_weight`` and the scale is taken back by the current weight. The
    histories then do not depend on the layout: a checkpoint resumes at another dp size with the right scales.
    """

    amax_history: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    amax_raw: torch.Tensor
    """This step's maxima that the fused casts folded in, not yet divided by the gradient weight (:meth:`step_amax`)."""
    _scratch: torch.Tensor
    _fmax: torch.Tensor
    _weights: torch.Tensor

    def __init__(
        self, history_len: int, algo: str, margin: int, formats: tuple[Fp8Format, Fp8Format, Fp8Format], device: Any
    ) -> None:
        super().__init__()
        self.algo, self.margin, self.formats = algo, margin, formats
        self.register_buffer("amax_history", torch.zeros(history_len, 3, device=device))
        self.register_buffer("scale", torch.zeros(3, device=device))
        self.register_buffer("amax", torch.zeros(3, device=device), persistent=False)
        self.register_buffer("amax_raw", torch.zeros(3, device=device), persistent=False)
        self.register_buffer("_scratch", torch.zeros(1, device=device), persistent=False)
        self.register_buffer("_fmax", torch.tensor([f.max for f in formats], device=device), persistent=False)
        self.register_buffer("_weights", torch.ones(3, device=device), persistent=False)
        """Each role's loss weight: 1 for the input and the weight, :attr:`grad_weight` for the gradient."""
        self.initialized = False
        """Whether the scales hold values (after a roll or a load); read from the buffer once while false."""
        self._grad_weight = 1.0
        self._kernel_scales: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        self.recording = True
        """Whether casts record their maxima (off inside an evaluation's ``fp8_step(update_scaling=False)``)."""

    @property
    def grad_weight(self) -> float:
        """The weight of each micro-batch's loss in this step's backward (set by ``fp8_step``). Changing it first
        folds the maxima kernels recorded under the old weight into :attr:`amax`."""
        return self._grad_weight

    @grad_weight.setter
    def grad_weight(self, weight: float) -> None:
        if weight != self._grad_weight:
            self._fold_raw()
            self._grad_weight = weight
            with torch.no_grad():
                self._weights[2] = weight  # (a fill on the device, no copy from the host)

    def saved_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers a checkpoint keeps (the current step's maxima are not: a checkpoint is taken between
        steps)."""
        return {"amax_history": self.amax_history, "scale": self.scale}

    def ready(self) -> bool:
        """Whether the stored scales are set (one host read while they were not)."""
        if not self.initialized:
            self.initialized = bool((self.scale > 0).all().item())
        return self.initialized

    def record(self, role: int, amax: torch.Tensor) -> None:
        """Keep ``amax`` (a 0-d tensor) if it is the largest of ``role`` in this step so far (while recording)."""
        if not self.recording:
            return
        slot = self.amax[role : role + 1]
        torch.maximum(slot, amax.reshape(1).to(slot.dtype), out=slot)

    def scale_for(self, role: int, t: torch.Tensor, group: Group | None) -> torch.Tensor:
        """The scale to cast ``t`` (this step's tensor of ``role``) with; records ``t``'s absolute maximum. Before
        any history exists, ``t``'s own maximum over ``group``; after, the stored scale (1 for a tensor whose every
        recorded maximum was 0)."""
        fmt = self.formats[role]
        weight = self.grad_weight if role == 2 else 1.0
        if not self.ready():
            a = amax_of(t, False, group)
            self.record(role, a / weight)
            return scale_from_amax(a, fmt, self.margin)
        self.record(role, amax_of(t) / weight)
        return self._scales()[0][role]

    def quantize(
        self, role: int, t: torch.Tensor, group: Group | None, transpose: bool
    ) -> tuple[Fp8Tensor, Fp8Tensor | None]:
        """``t`` cast with :meth:`scale_for`'s scale (and its transpose with ``transpose``). Once a history exists
        the scale is known before ``t`` is read, so on CUDA one Triton pass casts it and records its maximum."""
        fmt = self.formats[role]
        if not (self.ready() and _triton(t)):
            scale = self.scale_for(role, t, group)
            if transpose:
                return quantize_with_transpose(t, fmt, scale)
            return quantize(t, fmt, scale), None
        scale, inv, amax = self.kernel_scale(role)
        q, qt = cast_triton.cast_triton(t, scale, fmt.max, fmt.dtype, transpose, amax_out=amax)
        return Fp8Tensor(q, inv, fmt), None if qt is None else Fp8Tensor(qt, inv, fmt)

    def kernel_scale(self, role: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a kernel that casts a tensor of ``role`` itself (once :meth:`ready`): the scale to cast with (the
        stored one, with this step's gradient weight for the gradient), its reciprocal (the FP8 tensor's
        ``scale_inv``) and the one-element float32 slot the kernel folds the tensor's absolute maximum into (+inf for
        a NaN): :attr:`amax_raw`'s entry of ``role`` while recording, else a scratch slot.

        No kernel runs here: the scales are computed once for the stored scales and gradient weight (again after
        :meth:`roll`, a load or a new weight), and the kernels' maxima stay unweighted until :meth:`step_amax`, so a
        cast costs its own kernel only (the small scale and maximum kernels around each cast were 1-2% of an FP8
        training step)."""
        scale, inv = self._scales()
        slot = self.amax_raw[role : role + 1] if self.recording else self._scratch
        return scale[role], inv[role], slot

    def _scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        # (inference mode in the key: scales made under it are inference tensors, which a training step cannot save)
        key = (id(self.scale), self.scale._version, self._grad_weight, torch.is_inference_mode_enabled())
        if self._kernel_scales is None or self._kernel_scales[0] != key:
            with torch.no_grad():
                scale = torch.where(self.scale > 0, self.scale / self._weights, torch.ones_like(self.scale))
                # each role's scale 16 bytes from the next: cuBLAS takes a scale (scale_inv to torch._scaled_mm)
                # at a 16-byte aligned address only (CUBLAS_STATUS_NOT_SUPPORTED at offset 4 or 8)
                padded = F.pad(torch.stack([scale, scale.reciprocal()])[..., None], (0, 3))
                self._kernel_scales = (key, padded[0, :, 0], padded[1, :, 0])
        return self._kernel_scales[1], self._kernel_scales[2]

    def _fold_raw(self) -> None:
        """Fold the kernels' unweighted maxima into :attr:`amax` (per unit of loss weight) and clear them."""
        with torch.no_grad():
            self.amax.copy_(self.step_amax())
            self.amax_raw.zero_()

    def step_amax(self) -> torch.Tensor:
        """This step's maxima so far (``[3]``, per unit of loss weight): :attr:`amax` and the kernels' maxima."""
        return step_amaxes([self])[0]

    def roll(self, amax: torch.Tensor) -> None:
        """End of a step: push ``amax`` (``[3]``, this step's maxima reduced over the ranks; non-finite entries
        count as 0) into the history and recompute the scales (a tensor whose reference maximum is 0 keeps its
        scale). :func:`roll_all` does the same for many states at once."""
        roll_all([self], amax[None])

    def extra_repr(self) -> str:
        return f"history={self.amax_history.shape[0]}, algo={self.algo}, margin={self.margin}"


def step_amaxes(states: Sequence[DelayedScaling]) -> torch.Tensor:
    """The step's maxima so far of each state (``[len(states), 3]``, per unit of loss weight: :meth:`step_amax`),
    with a handful of kernels for them all."""
    amax, raw, weights = (torch.stack([getattr(s, n) for s in states]) for n in ("amax", "amax_raw", "_weights"))
    return torch.maximum(amax, raw / weights)


def roll_all(states: Sequence[DelayedScaling], amax: torch.Tensor) -> None:
    """:meth:`DelayedScaling.roll` of each state with its row of ``amax`` (``[len(states), 3]``), the states of one
    history length, algorithm, margin, formats and device rolled together by a few kernels over stacked copies (a
    step of llama-1b in FP8 rolls 65 layers: one by one that was some 20 small kernels and three host-to-device
    copies each)."""
    batches: dict[tuple[Any, ...], list[int]] = {}
    for i, s in enumerate(states):
        key = (s.amax_history.shape, s.amax_history.dtype, s.amax_history.device, s.algo, s.margin, s.formats)
        batches.setdefault(key, []).append(i)
    with torch.no_grad():
        for rows in batches.values():
            batch = [states[i] for i in rows]
            first = batch[0]
            a = amax if len(rows) == len(states) else amax[torch.tensor(rows, device=amax.device)]
            a = torch.nan_to_num(a.to(first.amax_history.dtype), nan=0.0, posinf=0.0, neginf=0.0)
            history = torch.stack([s.amax_history for s in batch])  # [states, history_len, 3], newest first
            history = torch.cat([a[:, None], history[:, :-1]], 1)
            ref = history.amax(1) if first.algo == "max" else a
            old = torch.stack([s.scale for s in batch])
            new = torch.where(ref > 0, (first._fmax / 2.0**first.margin) / ref, old)
            torch._foreach_copy_([s.amax_history for s in batch], list(history.unbind(0)))
            torch._foreach_copy_([s.scale for s in batch], list(new.unbind(0)))
            torch._foreach_zero_([t for s in batch for t in (s.amax, s.amax_raw)])
            for s in batch:
                s.initialized = True
