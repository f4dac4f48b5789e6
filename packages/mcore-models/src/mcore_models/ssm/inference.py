"""The inference forward of a Mamba-2 mixer over an engine's flat step of tokens, with per-request states.

An engine serves many requests in one step: their prefill chunks and decode tokens are one flat sequence
``[T, 1, hidden]``. Attention keeps each request's past in the paged KV cache; a Mamba layer keeps it in two
fixed-size states per request, held by the engine in one tensor per layer and indexed by the request's *slot*:

- the conv state ``[slots, conv_channels, d_conv - 1]`` (model dtype): the last ``d_conv - 1`` inputs of the causal
  depthwise convolution over ``[x, B, C]``;
- the SSM state ``[slots, H, P, N]`` (float32, or 16-bit to halve its memory and traffic: the step's math stays
  float32 and the state is rounded when stored; float64 for a float64 model): each head's recurrent state.

The step's context (the engine's inference context) carries a :class:`MambaStep` view under its ``mamba``
attribute (:class:`MambaStep` is the protocol): the current layer's two state tensors, one slot per request of
the step, and the host token ranges of the requests. Two paths:

- a *decode* step (every request one token: ``segments is None``, token ``i`` is request ``i``) runs the one-step
  recurrence vectorised over the batch: the conv window is the state plus the new input, the state becomes
  ``exp(dt A) state + dt x ⊗ B`` and ``y = state · C + D x``. It reads no host data and advances the states in place
  at the slot tensor's slots, so a CUDA graph can capture it (padded rows use a scratch slot). On CUDA it is two
  Triton kernels (:mod:`mcore_models.ssm.decode_triton`), else PyTorch ops (``MambaConfig.decode_kernel``, see
  :func:`uses_decode_kernel`);
- a *mixed* step (prefill chunks, with or without decode tokens) runs its chunks' causal conv continuing from their
  conv states and :func:`~mcore_models.ssm.ssd.ssd_scan` from their SSM states (``initial_states`` /
  ``return_final_states``), the chunks as the rows of one padded batch (:func:`plan_prefill` groups chunks of
  similar length, so padding stays below half the tokens): one conv and one scan per group and layer, not per
  request. A padded position gets the raw time step ``-inf``, so its step is ``softplus(-inf) = 0``: decay 1 and no
  input, the state passes through it unchanged (with a ``dt_limit`` whose lower bound is above 0 the chunks run one
  by one instead). Its one-token requests take the vectorised step together.

Either way the new states are written back to the requests' slots. A request that starts fresh has had its slot
zeroed by the engine before the step. The gated norm and ``out_proj`` (row-parallel: its all-reduce) run on the
whole step as in training. Tensor parallelism needs nothing more: each rank's states are those of its heads and
groups, as its mixer's parameters are.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from mcore_models.ssm.decode_triton import SSM_STATE_DTYPES
from mcore_models.ssm.ssd import _compute_dtype, _time_steps, ssd_scan

if TYPE_CHECKING:
    from mcore_models.ssm.mixer import Mamba2Mixer

__all__ = [
    "MambaStep",
    "PrefillGroup",
    "plan_prefill",
    "decode_step",
    "decode_step_torch",
    "mamba_state_shapes",
    "mixer_inference_forward",
    "uses_decode_kernel",
    "mix_projected",
    "scan_projected",
]


class MambaStep(Protocol):
    """What a Mamba mixer reads from an engine's inference context (``context.mamba``) in one step."""

    slots: torch.Tensor
    """``[R]`` int64 on the device: the state slot of each request of the step, in step order."""
    segments: list[tuple[int, int, int]] | None
    """Host ``(start, end, slot)`` token ranges of the step's requests; None for a decode step (token ``i`` is
    request ``i``, ``slots`` has one entry per token)."""
    decode: bool
    """``segments is None``, as a plain flag (compiled code guards on its value, not on the list)."""

    def states(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv ``[slots, C, d_conv - 1]`` and SSM ``[slots, H, P, N]`` states of layer ``layer_number``."""
        ...

    def single_tokens(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step with segments: the token rows of its one-token requests and their slots (device tensors,
        made once per step, shared by the layers), or None when it has none."""
        ...

    def prefill_groups(self) -> list[PrefillGroup]:
        """For a step with segments: its chunks of two or more tokens as :func:`plan_prefill` groups them (made once
        per step, shared by the layers)."""
        ...


@dataclass(frozen=True)
class PrefillGroup:
    """Prefill chunks of one step that run as one padded batch of ``count`` rows of ``length`` positions (chunk
    ``i`` at the start of row ``i``, longest first). Device tensors: ``slots`` ``[count]`` (each chunk's state
    slot), ``sizes`` ``[count]`` (its token count), ``rows`` ``[n]`` (the chunks' token rows in the step) and
    ``index`` ``[n]`` (where each of those tokens sits in the padded ``[count * length]`` layout)."""

    slots: torch.Tensor
    sizes: torch.Tensor
    rows: torch.Tensor
    index: torch.Tensor
    count: int
    length: int
    chunks: tuple[tuple[int, int, int], ...]
    """The chunks' host ``(start, end, slot)``, longest first."""


MAX_PADDING = 1.5
"""A prefill group's padded positions are at most this many times its tokens."""


def plan_prefill(segments: list[tuple[int, int, int]], device: torch.device | str) -> list[PrefillGroup]:
    """The chunks of two or more tokens among ``segments`` (host ``(start, end, slot)``) in padded groups: longest
    first, a chunk joins the current group while the group's padded size stays within :data:`MAX_PADDING` times
    its tokens."""
    chunks = sorted(((e - s, s, slot) for s, e, slot in segments if e - s > 1), key=lambda c: -c[0])
    groups: list[list[tuple[int, int, int]]] = []
    for chunk in chunks:
        g = groups[-1] if groups else None
        if g is not None and g[0][0] * (len(g) + 1) <= MAX_PADDING * (sum(c[0] for c in g) + chunk[0]):
            g.append(chunk)
        else:
            groups.append([chunk])
    out = []
    for g in groups:
        length = g[0][0]
        rows = [r for n, s, _ in g for r in range(s, s + n)]
        index = [i * length + j for i, (n, _, _) in enumerate(g) for j in range(n)]
        meta = torch.tensor([[slot for _, _, slot in g], [n for n, _, _ in g]], dtype=torch.int64)
        flat = torch.tensor([rows, index], dtype=torch.int64).to(device)
        meta = meta.to(device)
        spans = tuple((s, s + n, slot) for n, s, slot in g)
        out.append(PrefillGroup(meta[0], meta[1], flat[0], flat[1], len(g), length, spans))
    return out


def mamba_state_shapes(mixer: Mamba2Mixer) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per slot, this rank's conv state shape ``(channels, d_conv - 1)`` and SSM state shape ``(H, P, N)``."""
    m = mixer.mamba
    channels = mixer.d_local + 2 * mixer.gn_local
    return (channels, m.d_conv - 1), (mixer.heads_local, m.head_dim, m.d_state)


def mixer_inference_forward(mixer: Mamba2Mixer, h: torch.Tensor, context: Any) -> torch.Tensor:
    """The mixer over an engine step: ``h`` ``[T, 1, hidden]`` (the layer's normed input) → ``[T, 1, hidden]``;
    reads and writes this layer's states in ``context.mamba`` (a :class:`MambaStep`).

    Under ``torch.compile`` (the engine's compiled layers) a decode step is traced whole, the one-step recurrence
    fused with the projections' neighbours; only the look-up of the layer's states is not traced (it reads the
    context's ``layer_number``, which compiled code must not specialise on, as attention does). A mixed step's
    conv and scan, which read host token ranges, run untraced."""
    return mixer.out_proj(mix_projected(mixer, mixer.in_proj(h)[:, 0], context))


def mix_projected(mixer: Mamba2Mixer, zxbcdt: torch.Tensor, context: Any) -> torch.Tensor:
    """The mixer between its two projections over an engine step: the in-projection's output ``zxbcdt`` ``[T, 2d +
    2GN + H]`` (this rank's blocks) → the gated norm's output ``[T, 1, d]``, the out-projection's input; the conv and
    the scan (or the one-step recurrence) read and advance this layer's states (see :func:`mixer_inference_forward`,
    whose projections a decode plan may run as its own kernels)."""
    y, z = scan_projected(mixer, zxbcdt, context)
    return mixer.norm(y, z, kernel=False)  # type: ignore[no-any-return]


def scan_projected(mixer: Mamba2Mixer, zxbcdt: torch.Tensor, context: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mix_projected` before the gated norm: ``(y, z)``, each ``[T, 1, d]`` (``z`` a view of ``zxbcdt``), for
    a caller that runs the norm inside the out-projection."""
    d, gn, heads = mixer.d_local, mixer.gn_local, mixer.heads_local
    z, xbc, dt = zxbcdt.split([d, d + 2 * gn, heads], dim=-1)
    step: MambaStep | None = getattr(context, "mamba", None)
    if step is not None and step.decode:
        conv_state, ssm_state = _layer_states(context)
        y = decode_step(mixer, xbc, dt, step.slots, conv_state, ssm_state)
    else:
        y = _mix_states(mixer, xbc, dt, context)
    return y[:, None], z[:, None]


@torch.compiler.disable
def _layer_states(context: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The current layer's conv and SSM states (never traced: see :func:`mixer_inference_forward`)."""
    return context.mamba.states(context.layer_number)  # type: ignore[no-any-return]


@torch.compiler.disable
def _mix_states(mixer: Mamba2Mixer, xbc: torch.Tensor, dt: torch.Tensor, context: Any) -> torch.Tensor:
    """Conv and scan of a mixed step's tokens from (and back to) their requests' states: ``xbc`` ``[T, d + 2GN]``,
    raw ``dt`` ``[T, H]`` → ``y`` ``[T, d]``. Never traced by ``torch.compile``: it reads per-step host data."""
    step: MambaStep | None = getattr(context, "mamba", None)
    if step is None:
        raise NotImplementedError(
            "this inference context holds no Mamba states (context.mamba): serve Mamba and hybrid models with "
            "mcore-infer's engine, which keeps a conv and an SSM state per request"
        )
    conv_state, ssm_state = step.states(context.layer_number)
    if step.segments is None:
        return decode_step(mixer, xbc, dt, step.slots, conv_state, ssm_state)
    y = xbc.new_empty(xbc.shape[0], mixer.d_local)
    single = step.single_tokens()
    if single is not None:
        rows, slots = single
        y[rows] = decode_step(mixer, xbc[rows], dt[rows], slots, conv_state, ssm_state)
    padded_ok = mixer.mamba.dt_limit[0] == 0  # above 0, a padded step would not be the identity
    for group in step.prefill_groups():
        if group.count > 1 and padded_ok:
            y[group.rows] = prefill_group(mixer, xbc, dt, group, conv_state, ssm_state)
            continue
        for start, end, slot in group.chunks:  # one chunk at a time (a group of one needs no padding)
            y[start:end] = prefill_chunk(mixer, xbc[start:end], dt[start:end], slot, conv_state, ssm_state)
    return y


def _split_xbc(mixer: Mamba2Mixer, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[n, d + 2GN]`` (after the conv) → ``x`` ``[n, H, P]``, ``B``, ``C`` ``[n, G, N]``."""
    m = mixer.mamba
    x, B, C = xbc.split([mixer.d_local, mixer.gn_local, mixer.gn_local], dim=-1)
    n = xbc.shape[0]
    return (x.reshape(n, mixer.heads_local, m.head_dim), B.reshape(n, mixer.groups_local, m.d_state),
            C.reshape(n, mixer.groups_local, m.d_state))  # fmt: skip


def prefill_chunk(
    mixer: Mamba2Mixer,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    slot: int,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    """One request's ``n`` tokens (``xbc`` ``[n, d + 2GN]``, raw ``dt`` ``[n, H]``) from its states at ``slot``:
    the causal conv continues from the conv state and the chunked scan from the SSM state; both are written back.
    Returns ``y`` ``[n, d]``."""
    conv, m = mixer.conv1d, mixer.mamba
    window = torch.cat([conv_state[slot], xbc.t().to(conv_state.dtype)], dim=1)  # [C, d_conv - 1 + n]
    conv_state[slot] = window[:, window.shape[1] - (m.d_conv - 1) :]
    h = F.conv1d(window[None].to(xbc.dtype), conv.weight, conv.bias, groups=conv.weight.shape[0])[0]  # [C, n]
    x, B, C = _split_xbc(mixer, F.silu(h).t())
    A = -torch.exp(mixer.A_log.to(_compute_dtype(mixer.A_log)))
    y, final = ssd_scan(x[None], dt[None], A, B[None], C[None], chunk_size=m.chunk_size, D=mixer.D,
                        dt_bias=mixer.dt_bias, dt_softplus=True, dt_limit=m.dt_limit,
                        initial_states=ssm_state[slot][None].to(_state_compute_dtype(ssm_state)),
                        return_final_states=True, impl=m.scan)  # fmt: skip
    ssm_state[slot] = final[0].to(ssm_state.dtype)
    return y[0].reshape(y.shape[1], -1)


def prefill_group(
    mixer: Mamba2Mixer,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    group: PrefillGroup,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    """The chunks of ``group`` (their rows of the step's ``xbc`` ``[T, d + 2GN]`` and raw ``dt`` ``[T, H]``) as one
    padded batch from their states, as :func:`prefill_chunk` runs one: one conv and one scan; the states written
    back. Returns ``y`` ``[n, d]`` for ``group.rows``. Needs ``dt_limit``'s lower bound to be 0 (see the module
    docstring)."""
    conv, m = mixer.conv1d, mixer.mamba
    S, L, k = group.count, group.length, m.d_conv - 1
    channels = xbc.shape[1]
    padded = xbc.new_zeros(S * L, channels).index_copy_(0, group.index, xbc[group.rows])
    window = torch.cat(
        [conv_state[group.slots], padded.view(S, L, channels).transpose(1, 2).to(conv_state.dtype)], dim=2
    )  # [S, C, k + L] fmt: skip
    last = (group.sizes[:, None] + torch.arange(k, device=xbc.device))[:, None, :].expand(S, channels, k)
    conv_state[group.slots] = window.gather(2, last)  # each chunk's last k inputs (its old state if shorter)
    h = F.conv1d(window.to(xbc.dtype), conv.weight, conv.bias, groups=conv.weight.shape[0])  # [S, C, L]
    x, B, C = _split_xbc(mixer, F.silu(h).transpose(1, 2).reshape(S * L, channels))
    steps = dt.new_full((S * L, dt.shape[1]), float("-inf")).index_copy_(0, group.index, dt[group.rows])
    A = -torch.exp(mixer.A_log.to(_compute_dtype(mixer.A_log)))
    y, final = ssd_scan(x.view(S, L, *x.shape[1:]), steps.view(S, L, -1), A, B.view(S, L, *B.shape[1:]),
                        C.view(S, L, *C.shape[1:]), chunk_size=m.chunk_size, D=mixer.D, dt_bias=mixer.dt_bias,
                        dt_softplus=True, dt_limit=m.dt_limit,
                        initial_states=ssm_state[group.slots].to(_state_compute_dtype(ssm_state)),
                        return_final_states=True, impl=m.scan)  # fmt: skip
    ssm_state[group.slots] = final.to(ssm_state.dtype)
    return y.reshape(S * L, -1)[group.index]


_HAS_TRITON = importlib.util.find_spec("triton") is not None
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def uses_decode_kernel(mixer: Mamba2Mixer, xbc: torch.Tensor, ssm_state: torch.Tensor) -> bool:
    """Whether :func:`decode_step` runs the Triton kernels: ``mamba.decode_kernel`` is ``triton``, or ``auto`` on
    CUDA with Triton installed; and the input is bf16, fp16 or fp32 with a float32 or 16-bit SSM state (a float64 model always
    takes the PyTorch ops). Traceable: it reads only dtypes, devices and constants."""
    choice = mixer.mamba.decode_kernel
    if choice == "torch" or xbc.dtype not in _KERNEL_DTYPES or ssm_state.dtype not in SSM_STATE_DTYPES:
        return False
    return choice == "triton" or (xbc.is_cuda and _HAS_TRITON)


def decode_step(
    mixer: Mamba2Mixer,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    slots: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    """One token for each of ``b`` requests (``xbc`` ``[b, d + 2GN]``, raw ``dt`` ``[b, H]``, their ``slots``
    ``[b]``): the one-step recurrence; the states at ``slots`` are advanced in place (static shapes, device indices:
    capturable in a CUDA graph). Returns ``y`` ``[b, d]``. The Triton kernels
    (:mod:`mcore_models.ssm.decode_triton`) where :func:`uses_decode_kernel` says so, else
    :func:`decode_step_torch`."""
    if uses_decode_kernel(mixer, xbc, ssm_state):
        return _decode_kernel(mixer, xbc, dt, slots, conv_state, ssm_state)
    return decode_step_torch(mixer, xbc, dt, slots, conv_state, ssm_state)


@torch.compiler.disable
def _decode_kernel(
    mixer: Mamba2Mixer,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    slots: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    """The Triton decode step (never traced by ``torch.compile``: two opaque launches that write the states, as the
    attention kernels are called)."""
    from mcore_models.ssm.decode_triton import decode_step_triton

    return decode_step_triton(xbc, dt, slots, conv_state, ssm_state, conv_weight=mixer.conv1d.weight,
                              conv_bias=mixer.conv1d.bias, A_log=mixer.A_log, D=mixer.D, dt_bias=mixer.dt_bias,
                              dt_limit=mixer.mamba.dt_limit, groups=mixer.groups_local)  # fmt: skip


def _state_compute_dtype(ssm_state: torch.Tensor) -> torch.dtype:
    """The math of a step over ``ssm_state``: its own dtype, float32 for a 16-bit state (rounded only when stored)."""
    return torch.float32 if ssm_state.dtype in (torch.bfloat16, torch.float16) else ssm_state.dtype


def decode_step_torch(
    mixer: Mamba2Mixer,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    slots: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    """:func:`decode_step` in PyTorch ops, vectorised over the requests: the states at ``slots`` are gathered,
    advanced and written back (``index_select`` / ``index_copy_``)."""
    conv, m = mixer.conv1d, mixer.mamba
    cdt = _state_compute_dtype(ssm_state)
    window = torch.cat([conv_state.index_select(0, slots), xbc[:, :, None].to(conv_state.dtype)], dim=2)  # [b, C, K]
    conv_state.index_copy_(0, slots, window[:, :, 1:])
    h = (window.to(cdt) * conv.weight[:, 0].to(cdt)).sum(-1)
    if conv.bias is not None:
        h = h + conv.bias.to(cdt)
    x, B, C = _split_xbc(mixer, F.silu(h.to(xbc.dtype)).to(cdt))
    b, G = x.shape[0], mixer.groups_local
    steps = _time_steps(dt, mixer.dt_bias, True, m.dt_limit, cdt)  # [b, H]
    A = -torch.exp(mixer.A_log.to(cdt))
    xg = x.view(b, G, -1, m.head_dim)  # [b, G, R, P]
    state = ssm_state.index_select(0, slots).to(cdt).view(b, G, -1, m.head_dim, m.d_state)
    decay = torch.exp(steps * A).view(b, G, -1, 1, 1)
    state = decay * state + (steps.view(b, G, -1, 1) * xg)[..., None] * B[:, :, None, None, :]
    ssm_state.index_copy_(0, slots, state.view(b, -1, m.head_dim, m.d_state).to(ssm_state.dtype))
    y = torch.einsum("bgrpn,bgn->bgrp", state, C) + mixer.D.to(cdt).view(G, -1, 1) * xg
    return y.reshape(b, -1).to(xbc.dtype)
