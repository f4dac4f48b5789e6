"""``Mamba2Mixer``: Mamba-2's selective state-space mixer, tensor- and sequence-parallel over heads.

Parameters (global shapes; ``d = expand * hidden``, ``H = d / head_dim`` heads, ``G`` groups of state size ``N``):

========================  ==================================  ============================================
``in_proj.weight``        ``[2d + 2GN + H, hidden]``          rows ``[z, x, B, C, dt]`` (Hugging Face's layout)
``conv1d.weight``         ``[d + 2GN, 1, d_conv]``            depthwise, channels ``[x, B, C]``
``conv1d.bias``           ``[d + 2GN]``                       when ``conv_bias``
``dt_bias``, ``A_log``,   ``[H]``                             ``A = -exp(A_log)``; ``D`` the skip
``D``
``norm.weight``           ``[d]``                             gated RMSNorm over groups of ``d / G``
``out_proj.weight``       ``[hidden, d]``
========================  ==================================  ============================================

Forward on ``[s, b, hidden]``: ``in_proj`` → split ``z | xBC | dt`` → causal depthwise conv + SiLU on ``xBC`` →
split ``x | B | C`` → :func:`~mcore_models.ssm.ssd.ssd_scan` → ``norm(y, z)`` → ``out_proj``.

Tensor parallelism splits heads: each of the five blocks of ``in_proj`` is split over the ranks on its own
(``ColumnParallelLinear(blocks=...)``), so rank ``r`` holds ``[z_r, x_r, B_r, C_r, dt_r]``: its heads, their
groups (``n_groups % tp == 0``) and their time steps; the convolution's channels, ``dt_bias``, ``A_log``, ``D`` and
the norm weight are split the same way and ``out_proj`` is row-parallel, so nothing is exchanged inside the mixer.
Under sequence parallelism ``in_proj`` all-gathers the sequence and ``out_proj`` reduce-scatters it, as attention
does; the convolution and the scan see the whole sequence. Every parameter is drawn as the full tensor from
``ctx.seed_for(name)`` and sliced, so the global weights do not depend on the TP size.
"""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.errors import ConfigError
from mcore_models.mamba_config import MambaConfig
from mcore_models.ssm.ssd import _compute_dtype, ssd_scan
from mcore_models.transformer.context import ModelContext
from mcore_parallel.tensor import init_sharded_, normal_init, scaled_normal_init, set_tp_attributes
from mcore_parallel.tensor.init import InitMethod

if TYPE_CHECKING:
    from mcore_models.spec import LayerSpec

__all__ = ["Mamba2Mixer", "GatedRMSNorm", "CausalConv1d", "dt_bias_init", "a_log_init", "gated_rms_norm"]

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _takes_kernel(impl: str, x: torch.Tensor) -> bool:
    """Whether a layer whose ``mamba.*_kernel`` is ``impl`` runs its Triton kernels on ``x``: triton always, auto on
    CUDA when Triton is installed, torch never; float64 models always take the PyTorch ops."""
    if impl == "torch" or x.dtype == torch.float64:
        return False
    return impl == "triton" or (x.is_cuda and _HAS_TRITON)


def _uniform(low: float, high: float) -> InitMethod:
    def init(t: torch.Tensor, generator: torch.Generator | None) -> object:
        return t.uniform_(low, high, generator=generator)

    return init


def _constant(value: float) -> InitMethod:
    def init(t: torch.Tensor, generator: torch.Generator | None) -> object:
        return t.fill_(value)

    return init


def dt_bias_init(m: MambaConfig) -> InitMethod:
    """``softplus⁻¹(dt)`` with ``dt`` log-uniform in ``[dt_min, dt_max]``, floored at ``dt_init_floor`` (Mamba-2)."""
    lo, hi = math.log(m.dt_min), math.log(m.dt_max)

    def init(t: torch.Tensor, generator: torch.Generator | None) -> object:
        u = torch.rand(t.shape, generator=generator, dtype=t.dtype, device=t.device)
        dt = torch.exp(u * (hi - lo) + lo).clamp(min=m.dt_init_floor)
        return t.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt + log(1 - exp(-dt))) = dt

    return init


def a_log_init(m: MambaConfig) -> InitMethod:
    """``log(U(a_init_range))``."""
    lo, hi = m.a_init_range

    def init(t: torch.Tensor, generator: torch.Generator | None) -> object:
        return t.uniform_(lo, hi, generator=generator).log_()

    return init


def _split_param(
    ctx: ModelContext,
    shape: tuple[int, ...],
    init: InitMethod,
    seed_name: str,
    dtype: torch.dtype,
    blocks: tuple[int, ...] | None = None,
) -> nn.Parameter:
    """This rank's part (along dim 0, block by block) of a parameter of global ``shape`` drawn from its name's seed."""
    tp = ctx.tp
    p = nn.Parameter(torch.empty(shape[0] // tp.size, *shape[1:], dtype=dtype, device=ctx.device))
    set_tp_attributes(p, 0, shape, blocks=blocks)
    init_sharded_(p, shape, 0, tp.rank, tp.size, init, ctx.seed_for(seed_name), blocks=blocks)
    return p


class CausalConv1d(nn.Module):
    """Depthwise causal convolution (left padding ``kernel - 1``) followed by SiLU, over ``[b, s, channels]``.

    ``weight`` ``[channels, 1, kernel]`` and ``bias`` are this rank's channels of blocks ``blocks`` (global sizes),
    initialised as ``nn.Conv1d`` is (``U(±1/sqrt(kernel))``) from their names' seeds. ``impl``: ``mamba.conv_kernel``
    (torch, triton or auto; see :class:`~mcore_models.mamba_config.MambaConfig`)."""

    def __init__(
        self,
        ctx: ModelContext,
        blocks: tuple[int, ...],
        kernel: int,
        bias: bool,
        prefix: str,
        dtype: torch.dtype,
        impl: str = "torch",
    ) -> None:
        super().__init__()
        channels, bound = sum(blocks), 1.0 / math.sqrt(kernel)
        self.kernel, self.impl = kernel, impl
        self.weight = _split_param(ctx, (channels, 1, kernel), _uniform(-bound, bound), f"{prefix}.weight", dtype,
                                   blocks)  # fmt: skip
        self.bias: nn.Parameter | None
        if bias:
            self.bias = _split_param(ctx, (channels,), _uniform(-bound, bound), f"{prefix}.bias", dtype, blocks)
        else:
            self.register_parameter("bias", None)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs the Triton kernels for ``x`` (traceable: dtypes, devices and constants)."""
        return _takes_kernel(self.impl, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_kernel(x):
            from mcore_models.ssm.conv_triton import causal_conv1d_silu_triton

            return causal_conv1d_silu_triton(x, self.weight, self.bias)
        s = x.shape[1]
        h = F.conv1d(x.transpose(1, 2), self.weight, self.bias, padding=self.kernel - 1, groups=self.weight.shape[0])
        return F.silu(h[..., :s]).transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(y * silu(z)) * weight`` over groups of ``group_size`` channels (``norm_before_gate``:
    ``rmsnorm(y) * weight * silu(z)``), computed in float32 (float64 for float64 inputs). ``weight`` is this rank's
    ``[d / tp]`` (whole groups). ``impl``: ``mamba.norm_kernel`` (torch, triton or auto; see
    :class:`~mcore_models.mamba_config.MambaConfig`)."""

    def __init__(self, ctx: ModelContext, dim: int, group_size: int, eps: float, norm_before_gate: bool,
                 prefix: str, dtype: torch.dtype, impl: str = "torch") -> None:  # fmt: skip
        super().__init__()
        self.group_size, self.eps, self.norm_before_gate, self.impl = group_size, eps, norm_before_gate, impl
        self.weight = _split_param(ctx, (dim,), _constant(1.0), f"{prefix}.weight", dtype)

    def uses_kernel(self, y: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs the Triton kernels for ``y`` (traceable: dtypes, devices and constants)."""
        return y.dim() == 3 and _takes_kernel(self.impl, y)

    def forward(self, y: torch.Tensor, z: torch.Tensor, kernel: bool = True) -> torch.Tensor:
        """``y``, ``z`` ``[..., d]``; ``kernel=False`` takes the PyTorch ops whatever ``impl`` says."""
        if kernel and self.uses_kernel(y):
            from mcore_models.ssm.norm_triton import gated_rms_norm_triton

            return gated_rms_norm_triton(y, z, self.weight, self.group_size, self.eps, self.norm_before_gate)
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps, self.norm_before_gate)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                   norm_before_gate: bool) -> torch.Tensor:  # fmt: skip
    """:class:`GatedRMSNorm`'s PyTorch ops: ``rmsnorm(y * silu(z)) * weight`` over groups of ``group_size`` channels
    (``norm_before_gate``: ``rmsnorm(y) * weight * silu(z)``) in float32 (float64 for float64 inputs), rounded once
    to ``y``'s dtype."""
    cdt = _compute_dtype(y)
    h, gate = y.to(cdt), F.silu(z.to(cdt))
    if not norm_before_gate:
        h = h * gate
    h = F.rms_norm(h.unflatten(-1, (-1, group_size)), (group_size,), eps=eps).flatten(-2) * weight.to(cdt)
    if norm_before_gate:
        h = h * gate
    return h.to(y.dtype)


class Mamba2Mixer(nn.Module):
    """The Mamba-2 mixer of one layer (see the module docstring); ``forward`` maps ``[s (/ tp), b, hidden]`` to the
    same shape."""

    def __init__(self, config: TransformerConfig, ctx: ModelContext, spec: LayerSpec, prefix: str) -> None:
        super().__init__()
        m = config.mamba
        if m is None:
            raise ConfigError([f"{prefix}: a Mamba mixer needs TransformerConfig.mamba (set mamba={{}} for defaults)"])
        problems = m.problems(config.hidden_size, ctx.tp.size)
        if problems:
            raise ConfigError(problems, header=f"{prefix}: MambaConfig does not work with tensor parallelism "
                                               f"{ctx.tp.size}")  # fmt: skip
        tp, hidden = ctx.tp.size, config.hidden_size
        d, heads, gn = m.d_inner(hidden), m.nheads(hidden), m.n_groups * m.d_state
        self.config, self.mamba = config, m
        self.d_local, self.heads_local, self.groups_local = d // tp, heads // tp, m.n_groups // tp
        self.gn_local = self.groups_local * m.d_state
        common = dict(tp=ctx.tp, sequence_parallel=ctx.sequence_parallel, dtype=config.dtype, device=ctx.device)
        self.in_proj = spec.column_linear(
            hidden,
            2 * d + 2 * gn + heads,
            bias=False,
            blocks=(d, d, gn, gn, heads),
            init_method=normal_init(config.init_method_std),
            seed=ctx.seed_for(f"{prefix}.in_proj.weight"),
            **common,
        )
        dtype = config.dtype
        self.conv1d = CausalConv1d(ctx, (d, gn, gn), m.d_conv, m.conv_bias, f"{prefix}.conv1d", dtype, m.conv_kernel)
        self.dt_bias = _split_param(ctx, (heads,), dt_bias_init(m), f"{prefix}.dt_bias", dtype)
        self.A_log = _split_param(ctx, (heads,), a_log_init(m), f"{prefix}.A_log", dtype)
        self.D = _split_param(ctx, (heads,), _constant(1.0), f"{prefix}.D", dtype)
        self.norm = GatedRMSNorm(ctx, d, d // m.n_groups, config.norm_eps, m.norm_before_gate, f"{prefix}.norm",
                                 dtype, m.norm_kernel)  # fmt: skip
        std = config.init_method_std
        out_init = scaled_normal_init(std, config.num_layers) if config.scaled_output_init else normal_init(std)
        self.out_proj = spec.row_linear(
            d,
            hidden,
            bias=False,
            input_is_parallel=True,
            init_method=out_init,
            seed=ctx.seed_for(f"{prefix}.out_proj.weight"),
            **common,
        )

    def forward(self, x: torch.Tensor, inference_context: Any = None) -> torch.Tensor:
        """``x`` ``[s (/ tp), b, hidden]`` → the mixer's output, the same shape. With an engine's
        ``inference_context``: its step's flat tokens, from and to their requests' states
        (:func:`~mcore_models.ssm.inference.mixer_inference_forward`)."""
        if inference_context is not None:
            from mcore_models.ssm.inference import mixer_inference_forward

            return mixer_inference_forward(self, x, inference_context)
        zxbcdt = self.in_proj(x)  # [s, b, 2d + 2GN + H] / tp: the whole sequence under sequence parallelism
        d, gn, heads = self.d_local, self.gn_local, self.heads_local
        z, xbc, dt = zxbcdt.split([d, d + 2 * gn, heads], dim=-1)
        xbc = self.conv1d(xbc.transpose(0, 1))  # [b, s, d + 2GN]
        xs, B, C = xbc.split([d, gn, gn], dim=-1)
        y = self.scan(xs, B, C, dt.transpose(0, 1))
        return self.out_proj(self.norm(y.transpose(0, 1), z))

    def scan(self, x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """The SSD scan of this rank's heads: ``x`` ``[b, s, d]``, ``B``, ``C`` ``[b, s, GN]``, raw ``dt``
        ``[b, s, H]`` (all local sizes) → ``y`` ``[b, s, d]``."""
        b, s = x.shape[:2]
        m, groups = self.mamba, self.groups_local
        y = ssd_scan(
            x.reshape(b, s, self.heads_local, m.head_dim),
            dt,
            -torch.exp(self.A_log.to(_compute_dtype(self.A_log))),
            B.reshape(b, s, groups, m.d_state),
            C.reshape(b, s, groups, m.d_state),
            chunk_size=m.chunk_size,
            D=self.D,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            dt_limit=m.dt_limit,
            impl=m.scan,
        )
        return y.reshape(b, s, -1)
