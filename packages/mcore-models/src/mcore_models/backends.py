"""Layer backends: the one place that maps a backend name to the classes a layer is built from.

``TransformerConfig.backend`` (``torch``, ``fp8``, or ``auto``: fp8 when ``TransformerConfig.fp8`` is set) picks a
row of :func:`backend_classes`: the column- and row-parallel linears, the norm (the norm-linear pair: a backend
whose norm is fused into the following linear supplies both under the same parameter names) and the core attention.
:func:`layer_spec` applies it to one layer's :class:`~mcore_models.spec.LayerSpec`, which is how
:class:`~mcore_models.gpt.GPTModel` builds every layer:

- ``torch``: mcore-parallel's linears, ``F.rms_norm`` / ``F.layer_norm``, SDPA; the spec is unchanged.
- ``fp8``: the same modules with FP8 GEMMs (:mod:`mcore_parallel.fp8`) for the attention's ``linear_qkv`` and
  ``linear_proj`` and the MLP's ``linear_fc1`` and ``linear_fc2`` (``fp8_modules`` chooses), in every layer but the
  first ``fp8_first_layers_bf16`` and last ``fp8_last_layers_bf16``, and the output layer when ``fp8_modules``
  names ``output`` (:func:`output_linear`); the norms and the core attention are torch's, and so is everything else
  (embedding, MoE experts unless named, Mamba mixers: bf16).

A slot the caller's spec already changed (ring attention under context parallelism, a custom linear) is kept: the
backend replaces only the torch defaults. Every backend's modules have the torch modules' parameters (names,
shapes, initialisation, TP attributes), so a checkpoint of one backend loads into another; state a backend adds
(FP8 scaling histories) is listed by :meth:`GPTModel.runtime_state_dict` and is optional in a checkpoint.
``docs/design/006-backends.md`` records how a Transformer Engine backend would take a row here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from mcore_models.errors import ConfigError
from mcore_models.transformer.attention import SDPACoreAttention
from mcore_models.transformer.norm import build_norm
from mcore_parallel.errors import ParallelConfigError
from mcore_parallel.fp8 import (
    Fp8ColumnParallelLinear,
    Fp8Recipe,
    Fp8RowParallelLinear,
    fp8_device_problem,
    grouped_fp8_device_problem,
)
from mcore_parallel.tensor import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from mcore_models.config import TransformerConfig
    from mcore_models.spec import LayerSpec

__all__ = ["BACKENDS", "FP8_MODULES", "Backend", "backend_classes", "layer_spec", "fp8_recipe", "fp8_layers",
           "output_linear", "backend_problems", "check_backend_device", "describe_backend"]  # fmt: skip

BACKENDS = ("auto", "torch", "fp8")
FP8_MODULES = ("qkv", "proj", "fc1", "fc2", "experts", "output")
"""The linears an FP8 backend may run in FP8 (``fp8_modules``): a layer's (``experts``: the routed experts' grouped
GEMMs, :mod:`mcore_parallel.fp8.grouped`), and ``output``: the output layer (the logits), which published FP8 recipes
keep in bf16 and the default does too."""
GEMM_MULTIPLE = 16


@dataclass(frozen=True)
class Backend:
    """The classes of one backend (their constructors take the torch classes' arguments)."""

    name: str
    column_linear: Callable[..., Any]
    row_linear: Callable[..., Any]
    norm: Callable[..., nn.Module]
    core_attention: Callable[..., nn.Module]


TORCH = Backend("torch", ColumnParallelLinear, RowParallelLinear, build_norm, SDPACoreAttention)


def fp8_recipe(config: TransformerConfig) -> Fp8Recipe:
    """The FP8 recipe of ``config``'s ``fp8*`` fields (``fp8`` must be set)."""
    assert config.fp8 is not None
    return Fp8Recipe(config.fp8, config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo,
                     config.fp8_margin, config.fp8_allgather, config.fp8_wgrad)  # fmt: skip


def backend_classes(config: TransformerConfig) -> Backend:
    """The one mapping from a backend to its classes."""
    name = config.layer_backend
    if name == "torch":
        return TORCH
    if name == "fp8":
        recipe = fp8_recipe(config)
        return Backend("fp8", functools.partial(Fp8ColumnParallelLinear, recipe=recipe),
                       functools.partial(Fp8RowParallelLinear, recipe=recipe), build_norm, SDPACoreAttention)  # fmt: skip
    raise ConfigError([f"backend={config.backend!r} is not one of {', '.join(BACKENDS)}"])


def fp8_layers(config: TransformerConfig) -> range:
    """The layer numbers whose linears run in FP8 (empty without FP8)."""
    if config.layer_backend != "fp8":
        return range(0)
    return range(config.fp8_first_layers_bf16, config.num_layers - config.fp8_last_layers_bf16)


def output_linear(config: TransformerConfig) -> Callable[..., Any]:
    """The class of the output layer: the FP8 column-parallel linear when the backend is fp8 and ``fp8_modules``
    names ``output``, else the torch one."""
    if config.layer_backend == "fp8" and "output" in config.fp8_modules:
        return functools.partial(Fp8ColumnParallelLinear, recipe=fp8_recipe(config))
    return ColumnParallelLinear


def _with_linears(build: Callable[..., nn.Module], column: Any, row: Any) -> Callable[..., nn.Module]:
    """``build`` (an attention or MLP constructor) given a spec whose column/row linears are ``column``/``row``."""

    def make(config: TransformerConfig, ctx: Any, spec: LayerSpec, prefix: str, **kwargs: Any) -> nn.Module:
        return build(config, ctx, dataclasses.replace(spec, column_linear=column, row_linear=row), prefix, **kwargs)

    make.__qualname__ = make.__name__ = getattr(build, "__name__", "build")
    return make


def _pick(spec_value: Any, default: Any, replacement: Any) -> Any:
    """The backend's class where the spec holds the torch default; the caller's own choice otherwise."""
    return replacement if spec_value is default else spec_value


def layer_spec(spec: LayerSpec, config: TransformerConfig, layer_number: int) -> LayerSpec:
    """``spec`` with ``config``'s backend applied for layer ``layer_number`` (see the module docstring)."""
    b = backend_classes(config)
    if b is TORCH:
        return spec
    spec = dataclasses.replace(spec, norm=_pick(spec.norm, TORCH.norm, b.norm),
                               core_attention=_pick(spec.core_attention, TORCH.core_attention, b.core_attention))  # fmt: skip
    if layer_number not in fp8_layers(config):
        return spec
    col = _pick(spec.column_linear, TORCH.column_linear, b.column_linear)
    row = _pick(spec.row_linear, TORCH.row_linear, b.row_linear)
    mods = set(config.fp8_modules)

    def choose(name: str, fast: Any, plain: Any) -> Any:
        return fast if name in mods else plain

    return dataclasses.replace(
        spec,
        attention=_with_linears(spec.attention, choose("qkv", col, spec.column_linear),
                                choose("proj", row, spec.row_linear)),
        mlp=_with_linears(spec.mlp, choose("fc1", col, spec.column_linear), choose("fc2", row, spec.row_linear)),
        experts_fp8=fp8_recipe(config) if "experts" in mods else None,
    )  # fmt: skip


def backend_problems(config: TransformerConfig) -> list[str]:
    """Every problem of ``config``'s backend and FP8 fields (for :meth:`TransformerConfig.problems`)."""
    p: list[str] = []
    if config.backend not in BACKENDS:
        p.append(f"backend={config.backend!r} is not one of {', '.join(BACKENDS)}")
    if config.fp8 is not None and config.backend == "torch":
        p.append(f"fp8={config.fp8!r} needs backend=fp8 (or auto); set fp8=null to train in bf16")
    if config.fp8 is None and config.backend == "fp8":
        p.append("backend=fp8 needs fp8=e4m3 or fp8=hybrid (E4M3 forward, E5M2 gradients)")
    try:
        Fp8Recipe(config.fp8 or "e4m3", config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo,
                  config.fp8_margin, config.fp8_allgather, config.fp8_wgrad)  # fmt: skip
    except ParallelConfigError as e:
        p.extend(e.problems)
    unknown = sorted(set(config.fp8_modules) - set(FP8_MODULES))
    if unknown:
        p.append(f"fp8_modules={list(config.fp8_modules)} has unknown entries {unknown}; use some of "
                 f"{', '.join(FP8_MODULES)}")  # fmt: skip
    for key in ("fp8_first_layers_bf16", "fp8_last_layers_bf16"):
        value = getattr(config, key)
        if not isinstance(value, int) or value < 0:
            p.append(f"{key}={value!r} must be a non-negative integer")
    if config.fp8_fused_swiglu:
        p.extend(f"fp8_fused_swiglu=true needs {what}; set it or set fp8_fused_swiglu=false (or leave it unset: on "
                 "wherever it can run)" for what in fused_swiglu_problems(config))  # fmt: skip
    if p or config.fp8 is None:
        return p
    if config.hidden_size % GEMM_MULTIPLE:
        p.append(f"hidden_size={config.hidden_size} is not a multiple of {GEMM_MULTIPLE}: every FP8 linear reads or "
                 "writes it and torch._scaled_mm needs multiples of 16; change hidden_size or set fp8=null")  # fmt: skip
    if not config.fp8_modules:
        p.append("fp8_modules is empty: no linear would run in FP8; name some of qkv, proj, fc1, fc2 or set fp8=null")
    if "output" in config.fp8_modules:
        if config.share_embeddings_and_output_weights:
            p.append("fp8_modules names output but share_embeddings_and_output_weights=true: the output layer has no "
                     "weight of its own to cast; drop output from fp8_modules or untie the embeddings")  # fmt: skip
        if config.cross_entropy_fusion:
            p.append("fp8_modules names output but cross_entropy_fusion=true computes the output layer inside the "
                     "fused loss, in bf16; drop output from fp8_modules or set cross_entropy_fusion=false")  # fmt: skip
    if "experts" in config.fp8_modules and config.moe is None:
        p.append(f"fp8_modules={list(config.fp8_modules)} names experts but the model has no MoE layers (moe is not "
                 "set); drop experts from fp8_modules")  # fmt: skip
    if isinstance(config.num_layers, int) and len(fp8_layers(config)) == 0:
        p.append(f"fp8={config.fp8!r} but fp8_first_layers_bf16 + fp8_last_layers_bf16 = "
                 f"{config.fp8_first_layers_bf16 + config.fp8_last_layers_bf16} leaves none of the "
                 f"{config.num_layers} layers in FP8; lower them (e.g. 0) or set fp8=null")  # fmt: skip
    return p


def fused_swiglu_problems(config: TransformerConfig) -> list[str]:
    """What keeps the fused FP8 SwiGLU (``fp8_fused_swiglu``) from running with ``config``; empty: it can."""
    needs = [
        (config.fp8 is not None, "fp8=e4m3 or hybrid"),
        (config.fp8_recipe == "delayed", f"fp8_recipe=delayed (not {config.fp8_recipe!r}: the SwiGLU kernels cast "
                                         "with a scale known before they run)"),
        (config.activation == "swiglu", f"activation=swiglu (not {config.activation!r})"),
        ({"fc1", "fc2"} <= set(config.fp8_modules), f"fc1 and fc2 in fp8_modules (got {list(config.fp8_modules)})"),
        (not config.add_bias_linear, "add_bias_linear=false"),
        (config.fp8_wgrad, "fp8_wgrad=true"),
        (not config.fp8_allgather, "fp8_allgather=false"),
    ]  # fmt: skip
    return [what for ok, what in needs if not ok]


def check_backend_device(config: TransformerConfig, device: Any) -> None:
    """Raise a ConfigError naming the fix when ``config``'s backend cannot run on ``device``."""
    if config.layer_backend != "fp8":
        return
    problem = fp8_device_problem(device)
    if problem is not None:
        raise ConfigError([f"fp8={config.fp8!r}: {problem}; set model.fp8=null (and model.backend=auto or torch) "
                           "to train in bf16"])  # fmt: skip
    if "experts" in config.fp8_modules and config.moe is not None:
        problem = grouped_fp8_device_problem(device)
        if problem is not None:
            raise ConfigError([f"fp8_modules has experts: {problem}; leave experts out of model.fp8_modules (the "
                               "routed experts then run in bf16)"])  # fmt: skip


def describe_backend(config: TransformerConfig) -> str:
    """One line: the backend, its recipe and which layers and linears it covers."""
    if config.layer_backend != "fp8":
        return "backend torch (bf16 linears)"
    layers = fp8_layers(config)
    experts = config.moe is not None and "experts" in config.fp8_modules
    routed = "; routed experts: E4M3 rowwise grouped GEMMs, weight gradient bf16" if experts else ""
    moe = config.moe
    if config.fp8_swiglu_fused and (moe is None or any(not moe.is_moe_layer(i) for i in layers)):  # a dense MLP
        routed += "; the MLP's SwiGLU kernels write FP8 (fp8_fused_swiglu)"
    bf16_experts = "shared experts" if experts else "MoE experts"
    output = "output" in config.fp8_modules
    if output:
        routed += "; the output layer in FP8"
    layer_mods = ", ".join(m for m in config.fp8_modules if m != "output")
    return (f"backend fp8: {fp8_recipe(config).describe()}; layers {layers.start}-{layers.stop - 1} of "
            f"{config.num_layers} ({layer_mods}) in FP8{routed}; bf16: the other layers and linears, norms, core "
            f"attention, embedding, {'' if output else 'output layer, '}{bf16_experts}, Mamba mixers")  # fmt: skip
