"""The host side of the paged-attention kernel (:mod:`mcore_infer._triton_attention`): its launch settings, how many
programs share a token's blocks, and the layout checks of its inputs."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mcore_infer.kernels.norm_linear import parse_ints

__all__ = ["AttentionLaunch", "default_launch", "num_splits"]


class AttentionLaunch(NamedTuple):
    """How the paged-attention kernel walks a token's cache blocks.

    ``step``: blocks per loop step (a power of two; each step loads ``step`` blocks' keys and values as one tile,
    their block ids gathered from the table in one load, so a long context takes ``step`` times fewer dependent
    round trips); ``max_splits``: the most programs that share one token's blocks in small decode batches (a power of
    two, :func:`num_splits`); ``skip_empty``: with the combine in the kernel (``fold``), splits that get no block
    leave at once and the last of the others combines only theirs, or with a single split that has blocks (a short
    context) writes the output itself (1), instead of every split storing a state (0); ``warps`` per program;
    ``min_blocks``: the fewest blocks a split takes, so that a short context goes to fewer splits (with
    ``skip_empty``, the others leave at once: at 8 blocks and ``min_blocks`` 8 one program a KV group attends and
    writes the output, no partial state, no combine) while a long one still spreads over ``max_splits``."""

    step: int = 1
    max_splits: int = 16
    skip_empty: int = 0
    warps: int = 4
    min_blocks: int = 1

    def __str__(self) -> str:  # the form :meth:`parse` reads
        return ",".join(str(v) for v in self)

    @classmethod
    def parse(cls, text: str) -> AttentionLaunch:
        """A checked launch from ``STEP[,MAX_SPLITS[,SKIP_EMPTY[,WARPS[,MIN_BLOCKS]]]]`` (integers; 16, 0, 4 and 1
        when left out)."""
        source = (f"attention launch {text!r} (expected STEP[,MAX_SPLITS[,SKIP_EMPTY[,WARPS[,MIN_BLOCKS]]]], e.g. "
                  "4,16,1)")  # fmt: skip
        return cls(*parse_ints(text, source, (1, 2, 3, 4, 5))).checked(source)

    def checked(self, source: str | None = None) -> AttentionLaunch:
        """This launch, or a ValueError saying which field the kernel cannot take (``source`` opens the message)."""
        source = source or f"attention launch {self!r}"
        for name, value in (("STEP", self.step), ("MAX_SPLITS", self.max_splits)):
            if value < 1 or value & (value - 1) or value > 64:
                raise ValueError(f"{source}: {name}={value} must be a power of two from 1 to 64")
        if self.skip_empty not in (0, 1):
            raise ValueError(f"{source}: SKIP_EMPTY={self.skip_empty} must be 0 or 1")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{source}: WARPS={self.warps} must be one of 1, 2, 4, 8, 16")
        if not 1 <= self.min_blocks <= 4096:
            raise ValueError(f"{source}: MIN_BLOCKS={self.min_blocks} must be from 1 to 4096")
        return self


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


SMALL_STEP_TOKENS = 4
"""Steps of at most this many tokens (decoding one to four requests) take :data:`SMALL_STEP_LAUNCH` by default."""
SMALL_STEP_LAUNCH = AttentionLaunch(step=8, max_splits=16, skip_empty=1, warps=8, min_blocks=8)
"""The default launch of small steps: 8 blocks a loop step, empty splits skipped, 8 warps, splits of 8 blocks or more.
On one H100 (llama-1b, the row plan, same call) one request took 0.970 against 0.987 ms a token after a 128-token
prompt and 1.29 against 1.96 ms after a 16k prompt; 64 requests ran 14% slower under it (32,220 against 37,622
tokens/s) and the prefills' first tokens came later, so larger steps keep :class:`AttentionLaunch`'s defaults."""


def default_launch(tokens: int) -> AttentionLaunch:
    """The launch of a step of ``tokens`` tokens when the decode plan sets none: :data:`SMALL_STEP_LAUNCH` for at
    most :data:`SMALL_STEP_TOKENS`, else ``AttentionLaunch()``."""
    return SMALL_STEP_LAUNCH if tokens <= SMALL_STEP_TOKENS else AttentionLaunch()


def num_splits(tokens: int, groups: int, max_blocks: int, sms: int = 132, cap: int = 16) -> int:
    """How many programs share one token's blocks (flash-decoding): enough that a small decode batch still gives
    the GPU about two programs per SM, never more than ``cap`` or than a block-table row has blocks; 1 for big batches."""
    programs = tokens * groups
    if programs >= sms or max_blocks <= 1:
        return 1
    return min(cap, _pow2(max_blocks), _pow2(-(-2 * sms // programs)))


def _rotary_rows(
    rotary: tuple[torch.Tensor, torch.Tensor] | None, t: int, d: int, unused: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cos, sin) as ``[T, rot]`` rows, their row stride and ``rot``; without RoPE ``unused`` stands in for both
    (the kernels never read it when ``rot`` is 0)."""
    if rotary is None:
        return unused, unused, 0, 0
    cos, sin = (x.reshape(t, x.shape[-1]) for x in rotary)  # [T, 1, 1, rot] (one batch row per token) -> [T, rot]
    rot = cos.shape[-1]
    if rot > d or rot % 2:
        raise ValueError(f"rotary dims {rot} must be even and at most the head dim {d}")
    cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, cos.stride(0), rot


def _check_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, what: str) -> None:
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{what} needs unit-stride head dims and contiguous caches")


def _query_layout(q: torch.Tensor, groups: int) -> tuple[torch.Tensor, int, int, int]:
    """``q`` with a unit-stride head dim, its heads per group, and its group and head strides, for ``[T, heads, d]``
    or grouped ``[T, groups, heads / groups, d]`` queries."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if q.dim() == 4:
        return q, q.shape[2], q.stride(1), q.stride(2)
    hpg = q.shape[1] // groups
    return q, hpg, hpg * q.stride(1), q.stride(1)


def _split_scratch(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 running max, sum and accumulator of each split's partial softmax (``out`` stands in, unused, for one
    split)."""
    if splits == 1:
        return out, out, out
    t, heads, d = out.shape
    pm = torch.empty(t, heads, splits, device=out.device, dtype=torch.float32)
    return pm, torch.empty_like(pm), torch.empty(t, heads, splits, d, device=out.device, dtype=torch.float32)


_SMS: dict[str, int] = {}


def _sm_count(device: torch.device) -> int:
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return _SMS[key]
