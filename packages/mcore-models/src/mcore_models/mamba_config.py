"""``MambaConfig``: the Mamba-2 (SSD) mixer part of a :class:`~mcore_models.config.TransformerConfig`.

The names follow Megatron-LM's ``MambaMixer`` and Hugging Face's ``Mamba2Config`` (``d_state`` is HF's
``state_size``, ``d_conv`` its ``conv_kernel``, ``dt_limit`` its ``time_step_limit``). The mixer's inner width is
``d_inner = expand * hidden_size``, split into ``nheads = d_inner / head_dim`` heads that share ``n_groups`` groups of
``B`` and ``C`` (Mamba-2's analogue of grouped-query attention). Tensor parallelism splits heads and groups, so both
must be divisible by the TP size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MambaConfig", "SCANS"]

Scan = Literal["auto", "torch", "triton"]
SCANS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class MambaConfig:
    """Sizes, initialisation and scan implementation of the Mamba-2 mixers of a model."""

    d_state: int = 128
    """State size N of each head's SSM (HF ``state_size``)."""
    d_conv: int = 4
    """Kernel width of the causal depthwise convolution over ``[x, B, C]`` (HF ``conv_kernel``)."""
    expand: int = 2
    """Inner width ``d_inner = expand * hidden_size``."""
    head_dim: int = 64
    """Channels P per SSM head; ``nheads = d_inner / head_dim``."""
    n_groups: int = 1
    """Groups of ``B`` and ``C``, each shared by ``nheads / n_groups`` heads (also the groups of the gated norm)."""
    chunk_size: int = 256
    """Chunk length of the chunked SSD scan (the quadratic within-chunk form is ``chunk_size``²)."""
    dt_min: float = 0.001
    """Smallest initial time step (dt is drawn log-uniform in ``[dt_min, dt_max]``)."""
    dt_max: float = 0.1
    """Largest initial time step."""
    dt_init_floor: float = 1e-4
    """Initial time steps are floored at this before ``dt_bias = softplus⁻¹(dt)``."""
    dt_limit: tuple[float, float] = (0.0, math.inf)
    """Clamp of ``softplus(dt + dt_bias)`` in the scan; ``(0, inf)`` = no clamp."""
    a_init_range: tuple[float, float] = (1.0, 16.0)
    """``A_log = log(U(a_init_range))``; ``A = -exp(A_log)``."""
    conv_bias: bool = True
    """Bias on the depthwise convolution."""
    norm_before_gate: bool = False
    """Gated norm order: False (Mamba-2's default) ``rmsnorm(y * silu(z))``; True ``rmsnorm(y) * silu(z)``."""
    scan: Scan = "auto"
    """SSD scan implementation: torch (chunked PyTorch ops), triton (``mcore_models.ssm.ssd_triton``; an error when it
    cannot be imported), auto (triton on CUDA when it imports, else torch). The same math; only speed differs."""
    decode_kernel: Scan = "auto"
    """The served mixer's one-token decode step (``mcore_models.ssm.inference.decode_step``): triton (two kernels,
    ``mcore_models.ssm.decode_triton``: the conv window, then the state update with the output; an error when they
    cannot run), torch (PyTorch ops, one kernel each), auto (triton on CUDA when Triton is installed, else torch).
    Float64 models always take the PyTorch ops. The same math; only speed differs. auto is the default: on one
    H200 the Triton step serves ``mamba2-1.3b`` at 2.5 ms per token at batch 1 against 5.6 ms (docs/performance.md)."""
    conv_kernel: Scan = "auto"
    """The full-sequence (training) forward's causal depthwise convolution with its SiLU: torch (``F.conv1d`` then
    ``F.silu``), triton (``mcore_models.ssm.conv_triton``: one kernel forward and two backward over the
    in-projection's layout, no transposes; an error when it cannot run), auto (triton on CUDA when Triton is
    installed, else torch). Float64 models always take the PyTorch ops; the served step's convolution is
    ``decode_kernel``'s. The same math; only speed differs. auto is the default: on one H200 the kernels take 2.2 ms forward + backward against 9.5 ms for
    ``mamba2-1.3b``'s layer at batch 8 x seq 4096 (``bench/mamba_conv_bench.py``)."""

    norm_kernel: Scan = "auto"
    """The full-sequence (training) forward's gated RMSNorm: torch (float32 ops through ``F.rms_norm``), triton
    (``mcore_models.ssm.norm_triton``: one kernel forward and one backward, each reading its inputs once; an error
    when it cannot run), auto (triton on CUDA when Triton is installed, else torch). Float64 models always take the
    PyTorch ops, and so does the served step. The same math; only speed differs. auto is the default: on one H100
    ``mamba2-1.3b`` trains 1.04x faster with the kernels than with the compiled PyTorch norm (micro-batch 4 x seq
    4096; ``bench/results/ssm/h100-norm.json``)."""

    def __post_init__(self) -> None:
        for name in ("dt_limit", "a_init_range"):  # a YAML or JSON file gives lists (and "inf" or Infinity)
            value = getattr(self, name)
            if isinstance(value, list | tuple):
                with contextlib.suppress(TypeError, ValueError):  # a value that is not a number: problems() says so
                    object.__setattr__(self, name, tuple(float(v) for v in value))

    def d_inner(self, hidden_size: int) -> int:
        """The mixer's inner width ``expand * hidden_size``."""
        return self.expand * hidden_size

    def nheads(self, hidden_size: int) -> int:
        """SSM heads ``d_inner / head_dim``."""
        return self.d_inner(hidden_size) // self.head_dim

    def problems(self, hidden_size: int, tp: int = 1) -> list[str]:
        """Every problem of this config for a model of width ``hidden_size`` at tensor-parallel size ``tp``."""
        p: list[str] = []
        for name in ("d_state", "d_conv", "expand", "head_dim", "n_groups", "chunk_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                p.append(f"mamba.{name}={v!r} must be a positive integer")
        p.extend(self._range_problems())
        for name in ("scan", "decode_kernel", "conv_kernel", "norm_kernel"):
            if getattr(self, name) not in SCANS:
                p.append(f"mamba.{name}={getattr(self, name)!r} is not one of {', '.join(SCANS)}")
        if p:
            return p
        d_inner = self.d_inner(hidden_size)
        if d_inner % self.head_dim:
            p.append(
                f"mamba.head_dim={self.head_dim} does not divide d_inner = mamba.expand * hidden_size = {d_inner}; "
                "choose a head_dim that divides it (or change expand)"
            )
            return p
        heads, groups = self.nheads(hidden_size), self.n_groups
        if heads % groups:
            p.append(
                f"mamba.n_groups={groups} does not divide the {heads} heads (d_inner / head_dim); "
                "use n_groups that divides it"
            )
        if heads % tp:
            p.append(
                f"mamba: the {heads} heads (d_inner / head_dim) are not divisible by the tensor-parallel size {tp}; "
                "use a tp that divides them (or change mamba.head_dim / expand)"
            )
        if groups % tp:
            p.append(
                f"mamba.n_groups={groups} is not divisible by the tensor-parallel size {tp}: every rank holds whole "
                f"groups of B and C; set n_groups to a multiple of {tp} or use tp <= n_groups that divides it"
            )
        return p

    def _range_problems(self) -> list[str]:
        p: list[str] = []
        if not self.dt_min > 0:
            p.append(f"mamba.dt_min={self.dt_min} must be positive")
        if not self.dt_max >= self.dt_min:
            p.append(f"mamba.dt_max={self.dt_max} must be >= mamba.dt_min={self.dt_min}")
        if not self.dt_init_floor >= 0:
            p.append(f"mamba.dt_init_floor={self.dt_init_floor} must be >= 0")
        for name, low_ok in (("dt_limit", lambda lo: lo >= 0), ("a_init_range", lambda lo: lo > 0)):
            v = getattr(self, name)
            pair = isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, float) for x in v)
            if not pair or not low_ok(v[0]) or not v[0] <= v[1]:
                bound = ">= 0" if name == "dt_limit" else "> 0"
                p.append(f"mamba.{name}={v!r} must be two numbers (low, high) with low {bound} and low <= high")
        return p

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
