"""Layer specs: which classes build a transformer layer.

A spec is the seam for backends. The default (:func:`default_spec`) is pure PyTorch: mcore-parallel's TP linears,
``F.scaled_dot_product_attention``, ``F.rms_norm`` / ``F.layer_norm``. Another backend (Transformer Engine, custom
Triton kernels) supplies its own classes with the same constructor signatures and is passed as ``spec=`` to
:class:`~mcore_models.gpt.GPTModel`; the model code does not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from mcore_models.moe.layer import MoELayer
from mcore_models.ssm.mixer import Mamba2Mixer
from mcore_models.transformer.attention import SDPACoreAttention, SelfAttention
from mcore_models.transformer.layer import TransformerLayer
from mcore_models.transformer.mlp import MLP
from mcore_models.transformer.norm import build_norm
from mcore_parallel.tensor import ColumnParallelLinear, RowParallelLinear

__all__ = ["LayerSpec", "default_spec"]


@dataclass(frozen=True)
class LayerSpec:
    """Constructors of each part of a layer (see the default classes for the signatures)."""

    layer: Callable[..., nn.Module] = TransformerLayer
    attention: Callable[..., nn.Module] = SelfAttention
    core_attention: Callable[..., nn.Module] = SDPACoreAttention
    mlp: Callable[..., nn.Module] = MLP
    moe: Callable[..., nn.Module] = MoELayer
    """The MLP of the layers that ``TransformerConfig.moe`` makes mixture-of-experts (same signature as ``mlp``)."""
    mamba_mixer: Callable[..., nn.Module] = Mamba2Mixer
    """The mixer of a :class:`~mcore_models.ssm.MambaLayer` (``(config, ctx, spec, prefix)``, like ``mlp``)."""
    norm: Callable[..., nn.Module] = build_norm
    column_linear: Callable[..., Any] = ColumnParallelLinear
    row_linear: Callable[..., Any] = RowParallelLinear
    experts_fp8: Any = None
    """The FP8 recipe (``mcore_parallel.fp8.Fp8Recipe``) of the routed experts' grouped GEMMs; None: bf16. Set per
    layer by the fp8 backend (``experts`` in ``fp8_modules``)."""


def default_spec() -> LayerSpec:
    """The pure-PyTorch spec."""
    return LayerSpec()
