"""Per-request Mamba states beside the paged KV cache: one conv and one SSM state per request slot and Mamba layer.

A Mamba-2 layer's past is not a sequence of keys and values but two fixed-size states per request
(:mod:`mcore_models.ssm.inference`). :class:`MambaCache` holds them for every Mamba layer of this rank,
``[num_slots, ...]`` each, allocated once when the engine starts; :class:`SlotManager` hands the slots out. Slot 0 is
scratch (padded rows of a CUDA-graph batch advance it, as they write the KV cache's scratch block), so a cache for
``max_num_seqs`` requests has ``max_num_seqs + 1`` slots.

The scheduler takes a slot when it admits a request and frees it when the request finishes, is aborted or is
preempted (preemption recomputes from the prompt, so the slot is zeroed when the request is admitted again). The
step's batch names the slots whose requests start fresh; the runner zeroes them before the forward, on every TP
rank. :class:`MambaStepView` is the ``mamba`` attribute of the step's inference context that the mixers read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_models import GPTModel
from mcore_models.ssm.inference import PrefillGroup, mamba_state_shapes, plan_prefill
from mcore_models.ssm.mixer import Mamba2Mixer
from mcore_models.ssm.ssd import _compute_dtype

__all__ = ["MambaCache", "MambaStepView", "SlotManager", "attention_layer_numbers", "mamba_mixers", "ssm_state_dtype"]


def mamba_mixers(model: GPTModel) -> dict[int, Mamba2Mixer]:
    """The Mamba-2 mixers of ``model``'s layers, by layer number (empty for a model without Mamba layers)."""
    out = {}
    for key, layer in model.decoder.layers.items():
        mixer = getattr(layer, "mixer", None)
        if isinstance(mixer, Mamba2Mixer):
            out[int(key)] = mixer
    return out


def attention_layer_numbers(model: GPTModel) -> list[int]:
    """The layers of ``model`` that attend (and need KV-cache blocks): every layer of a GPT model, the ``*`` layers
    of a hybrid pattern."""
    numbers = list(model.layer_numbers)
    pattern = model.config.hybrid_pattern
    if pattern is None:
        return numbers
    kinds = pattern.replace("|", "")
    return [n for n in numbers if kinds[n] == "*"]


class SlotManager:
    """Free list of state slots ``1..num_slots - 1`` (0 is scratch)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: need at least 2 (one is reserved as scratch)")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no Mamba state slot is free")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot:
            self._free.append(slot)


@dataclass
class MambaCache:
    """Per Mamba layer (by layer number): conv states ``[num_slots, C, d_conv - 1]`` (model dtype) and SSM states
    ``[num_slots, H, P, N]`` (float32, or ``EngineConfig.mamba_ssm_dtype``; float64 for a float64 model), this rank's
    channels and heads. The layers' states
    are views of one tensor per kind when their shapes agree (the usual case), so a reset is two kernels."""

    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    num_slots: int
    stacked: list[torch.Tensor]
    """The tensors :meth:`reset` zeroes along dim 1 (``[layers, num_slots, ...]``); empty: it zeroes each layer's."""

    @classmethod
    def allocate(
        cls, mixers: dict[int, Mamba2Mixer], num_slots: int, device: torch.device, ssm_dtype: torch.dtype | None = None
    ) -> MambaCache:
        """Zeroed states; ``ssm_dtype``: the SSM states' (None: the scan's own, :func:`ssm_state_dtype`)."""
        conv, conv_whole = _states({n: (mamba_state_shapes(m)[0], m.conv1d.weight.dtype) for n, m in mixers.items()},
                                   num_slots, device)  # fmt: skip
        ssm, ssm_whole = _states({n: (mamba_state_shapes(m)[1], ssm_state_dtype(m, ssm_dtype))
                                  for n, m in mixers.items()}, num_slots, device)  # fmt: skip
        stacked = [conv_whole, ssm_whole] if conv_whole is not None and ssm_whole is not None else []
        return cls(conv, ssm, num_slots, stacked)

    @staticmethod
    def bytes_for(mixers: dict[int, Mamba2Mixer], num_slots: int, ssm_dtype: torch.dtype | None = None) -> int:
        """The memory :meth:`allocate` takes for ``num_slots`` slots."""
        total = 0
        for mixer in mixers.values():
            (c, k), (h, p, n) = mamba_state_shapes(mixer)
            conv_bytes = c * k * mixer.conv1d.weight.element_size()
            ssm_bytes = h * p * n * torch.empty((), dtype=ssm_state_dtype(mixer, ssm_dtype)).element_size()
            total += num_slots * (conv_bytes + ssm_bytes)
        return total

    def reset(self, slots: torch.Tensor) -> None:
        """Zero every layer's states at ``slots`` (requests that start fresh)."""
        if self.stacked:
            for t in self.stacked:
                t.index_fill_(1, slots, 0)
            return
        for t in (*self.conv.values(), *self.ssm.values()):
            t.index_fill_(0, slots, 0)


def ssm_state_dtype(mixer: Mamba2Mixer, requested: torch.dtype | None) -> torch.dtype:
    """The SSM state dtype of ``mixer``'s requests: ``requested``, except that a float64 model (the references of
    tests) keeps float64; None: the scan's own (float32, float64 for a float64 model)."""
    own = _compute_dtype(mixer.A_log)
    return own if requested is None or own == torch.float64 else requested


def _states(
    specs: dict[int, tuple[tuple[int, ...], torch.dtype]], num_slots: int, device: torch.device
) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    """Zeroed ``[num_slots, *shape]`` states per layer of ``specs`` (layer -> (shape, dtype)): views of one
    ``[layers, num_slots, *shape]`` tensor (returned too) when every layer's shape and dtype agree."""
    if len(set(specs.values())) != 1:
        return {n: torch.zeros(num_slots, *sh, dtype=dt, device=device) for n, (sh, dt) in specs.items()}, None
    shape, dtype = next(iter(specs.values()))
    whole = torch.zeros(len(specs), num_slots, *shape, dtype=dtype, device=device)
    return dict(zip(specs, whole.unbind(0))), whole


class MambaStepView:
    """The ``mamba`` attribute of a step's inference context (``mcore_models.ssm.inference.MambaStep``)."""

    def __init__(
        self, cache: MambaCache, slots: torch.Tensor, segments: list[tuple[int, int, int]] | None = None
    ) -> None:
        self.cache, self.slots, self.segments = cache, slots, segments
        self.decode = segments is None
        self._single: tuple[torch.Tensor, torch.Tensor] | None = None
        self._groups: list[PrefillGroup] | None = None
        single = [(s, slot) for s, e, slot in segments or [] if e - s == 1]
        if single:  # one copy per step, shared by the layers
            rows_slots = torch.tensor(single, dtype=torch.int64).t().to(slots.device)
            self._single = (rows_slots[0], rows_slots[1])

    def states(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.conv[layer_number], self.cache.ssm[layer_number]

    def single_tokens(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._single

    def prefill_groups(self) -> list[PrefillGroup]:
        if self._groups is None:
            self._groups = plan_prefill(self.segments or [], self.slots.device)
        return self._groups
