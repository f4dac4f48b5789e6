"""The decode plan: which serving-only fusions an engine's steps use (:mod:`mcore_infer.decode` runs a model with them).

``GPTModel`` is the training model, a plain loop of layers. Small decode steps (a few tokens) are bound by the
number of kernels per layer, and serving removes some with fusions the training model never sees:

- ``rope_in_attention``: the Triton KV-write and paged-attention kernels read q, k and v in place from the QKV
  projection's output and apply RoPE as they load them (the attention context's ``fuses_rotary``);
- ``kv_write_in_attention``: in decode steps the paged-attention kernel writes each token's own key and value;
- ``defer_residual``: each layer's last residual add is done by the next layer, where its first norm reads it (with
  compiled layers the add and the norm are one kernel);
- ``norm_linear``: steps of at most 16 tokens run each RMSNorm inside the projection after it (with the residual add
  before it and SwiGLU after the up projection), and the final norm inside the output layer;
- ``swiglu_down``, ``proj_partials``, ``row_gemv``: steps of at most 4 tokens run SwiGLU inside the down projection,
  the output projection as split-K partial sums, and the QKV projection through the one-row Triton GEMV
  (:mod:`mcore_infer.kernels`);
- ``norm_gemv``: with ``row_gemv``, in steps of at most 4 tokens the residual add and RMSNorm before each attention
  run inside the QKV row GEMV (with ``row_fc1``, those before each MLP inside the up projection's), and the last
  residual add and the final norm inside the output layer's
  (:mod:`mcore_infer.kernels.norm_gemv`: no norm kernels);
- ``fused_mlp``: steps of at most 4 tokens run each gated MLP (up projection, SwiGLU, down projection), with the
  residual add and RMSNorm before it, as one weight-streaming kernel and a small one that adds its partial sums
  (:mod:`mcore_infer.kernels.fused_mlp`), instead of the norm, cuBLAS's up projection and ``swiglu_down``;
- ``combine_in_attention``: where the paged-attention kernel splits a token's blocks among programs (small decode
  batches), the last of them to finish combines their partial softmax states, instead of a second kernel;
- ``row_fc1``: steps of at most 4 tokens run the MLP's up projection through the one-row Triton GEMV (a
  programmatic dependent with ``pdl``) instead of cuBLAS;
- ``gated_norm_gemv``: steps of at most 4 tokens run a Mamba layer's gated RMSNorm inside its out-projection's row
  GEMV (:mod:`mcore_infer.kernels.gated_norm_gemv`), whose partial sums the next residual add sums;
- ``embed_rope``: in steps of at most 4 tokens the embedding rows and the rotary rows are one gather kernel
  (:mod:`mcore_infer.kernels.embed_rope`) instead of three;
- ``argmax_in_graph``: the decode CUDA graphs over two input sets also draw the greedy tokens into the next step's
  ids (the engine then launches no argmax of its own for a batch of plain greedy rows);
- ``pdl``: in steps of at most 4 tokens on Hopper, the residual add and each RMSNorm (the final one before the
  output layer too) are one Triton kernel, and it,
  the row kernels (the fused MLP's too) and the attention kernels are launched as programmatic dependents (each
  starts while the kernel before it finishes; what it reads of that kernel's output it reads after ``gdc_wait``).

A :class:`DecodePlan` says which apply, validated in one place (``norm_linear`` replaces the projections the row
kernels replace, so it excludes them, and ``fused_mlp`` excludes ``swiglu_down``); :data:`DECODE_PRESETS` names the usual ones, and ``"auto"`` resolves per
device (:func:`requested_plan`). :func:`prepare_for_decode` builds a new module over the caller's model: it shares
the parameters, wraps each layer (:mod:`mcore_infer.decode_layers`) and sets nothing on the caller's modules. It
decides per layer: the layer fusions reach into the standard modules (``TransformerLayer`` or a hybrid model's
attention and MLP layers, ``SelfAttention``, ``MLP``; a ``MambaLayer``'s projections), and a layer part of another type (an MoE layer's ``mlp``, a new layer type) runs by its own forward with
none of the fusions that would reach into it, under any plan; the fusions of its other parts still apply.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Literal, get_args

from mcore_infer._attention_host import AttentionLaunch
from mcore_infer.decode_layers import LAYER_FUSIONS
from mcore_infer.kernels.fused_mlp import MlpLaunch
from mcore_infer.kernels.norm_linear import Launch as NormLinearLaunch
from mcore_infer.kernels.small_gemv import Launch as GemvLaunch

__all__ = [
    "DECODE_PRESETS",
    "ROW_KERNELS",
    "DecodeKernels",
    "DecodeLaunches",
    "DecodePlan",
    "check_decode_kernels",
    "parse_decode_kernels",
    "requested_plan",
]

log = logging.getLogger("mcore_infer.decode")

DecodeKernels = Literal["auto", "none", "attention", "row", "norm_linear"]
"""A preset name: ``auto`` (:func:`requested_plan`) or a key of :data:`DECODE_PRESETS`."""

ROW_KERNELS = ("swiglu_down", "proj_partials", "row_gemv", "row_fc1", "fused_mlp", "gated_norm_gemv")

_EXCLUDED_BY_NORM_LINEAR = {
    "swiglu_down": "norm_linear layers bypass the MLP's down-projection kernel",
    "proj_partials": "the fused norm after attention reads the output projection's summed output",
    "row_gemv": "both replace the QKV projection",
    "fused_mlp": "both replace the MLP's up projection",
    "row_fc1": "both replace the MLP's up projection",
}


@dataclass(frozen=True)
class DecodeLaunches:
    """Per-kernel launches of the decode kernels; None: the kernel's heuristic for each shape."""

    norm_linear: NormLinearLaunch | None = None
    """Every ``norm_linear`` call (both norms of each layer and the output layer)."""
    swiglu_down: GemvLaunch | None = None
    """SwiGLU inside the down projection."""
    proj_partials: GemvLaunch | None = None
    """The attention output projection's partial sums."""
    row_gemv: GemvLaunch | None = None
    """The QKV projection."""
    row_fc1: GemvLaunch | None = None
    """The MLP's up projection (``row_fc1``)."""
    fused_mlp: MlpLaunch | None = None
    """The fused MLP kernel."""
    attention: AttentionLaunch | None = None
    """The paged-attention kernel (every step's: blocks per loop step, the split cap, skipping empty splits)."""
    gated_norm_gemv: GemvLaunch | None = None
    """A Mamba layer's out-projection with its gated norm inside (``gated_norm_gemv``)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            launch = getattr(self, f.name)
            if launch is not None:
                launch.checked(f"DecodeLaunches.{f.name}={launch!r}")


@dataclass(frozen=True)
class DecodePlan:
    """Which serving-only fusions an engine's steps use (see the module docstring); every one off by default."""

    rope_in_attention: bool = False
    """RoPE inside the Triton KV-write and paged-attention kernels (Triton attention backend only)."""
    kv_write_in_attention: bool = False
    """Decode steps: the paged-attention kernel writes the new keys and values (Triton attention backend only)."""
    defer_residual: bool = False
    """Each layer's last residual add done by the next layer, with its first norm."""
    norm_linear: bool = False
    """Steps of at most 16 tokens: each RMSNorm inside the projection after it (RMSNorm, bias-free QKV and up
    projections, no sequence parallelism)."""
    swiglu_down: bool = False
    """Steps of at most 4 tokens: SwiGLU inside the down projection (SwiGLU, bias-free, tp=1)."""
    proj_partials: bool = False
    """Steps of at most 4 tokens: the attention output projection as split-K partial sums (bias-free, tp=1)."""
    row_gemv: bool = False
    """Steps of at most 4 tokens: the QKV projection with the one-row Triton GEMV (bias-free, tp=1)."""
    norm_gemv: bool = False
    """With ``row_gemv``, steps of at most 4 tokens: the residual add and RMSNorm before each attention inside the
    QKV row GEMV, and the final ones inside the output layer's (RMSNorm; a bias-free output layer); with ``row_fc1``
    too, those before each MLP inside the up projection's."""
    fused_mlp: bool = False
    """Steps of at most 4 tokens: the whole MLP (up projection, SwiGLU, down projection; with an RMSNorm before it,
    the residual add and the norm too) as one Triton kernel plus the sum of its partials (SwiGLU, bias-free, tp=1);
    excludes ``swiglu_down``, which replaces only the down projection."""
    combine_in_attention: bool = False
    """The paged-attention kernel's split-K partial states combined by the last split to finish (Triton attention
    backend), instead of a second kernel."""
    row_fc1: bool = False
    """Steps of at most 4 tokens: the MLP's up projection with the one-row Triton GEMV (bias-free, tp=1) instead of
    cuBLAS, launched as a programmatic dependent with ``pdl``."""
    gated_norm_gemv: bool = False
    """Steps of at most 4 tokens: a Mamba layer's gated RMSNorm inside its out-projection's row GEMV, as split-K
    partial sums the next residual add sums (a ``Mamba2Mixer``, bias-free, tp=1), instead of the norm kernel and
    ``proj_partials`` (or the out-projection)."""
    pdl: bool = False
    """Steps of at most 4 tokens on Hopper and later: the row GEMVs, the attention kernels and the residual add +
    RMSNorm (one Triton kernel, :mod:`mcore_infer.kernels.add_norm`; the last add and the final norm too) launched
    as programmatic dependents, so each starts, and loads its first weight tile, while the kernel before it
    finishes."""
    embed_rope: bool = False
    """Steps of at most 4 tokens: the tokens' embedding rows and their positions' rotary rows gathered by one Triton
    kernel (:mod:`mcore_infer.kernels.embed_rope`), which with ``pdl`` lets the first QKV GEMV launch at its start,
    instead of three gathers (tp=1, RoPE from the engine's table, no learned position embeddings)."""
    argmax_in_graph: bool = False
    """With CUDA graphs over two decode input sets (``EngineConfig.side_stream_copies``): each decode graph also
    draws the greedy tokens, the argmax of every row written into the ids the next decode step reads (a programmatic
    dependent with ``pdl``); a batch of only plain greedy rows takes them without a kernel of its own."""
    launches: DecodeLaunches = field(default_factory=DecodeLaunches)
    """Launch overrides of the kernels."""

    def __post_init__(self) -> None:
        if not isinstance(self.launches, DecodeLaunches):
            raise ValueError(f"DecodePlan.launches must be a DecodeLaunches, got {type(self.launches).__name__}")
        clashes = [
            f"{k} ({why})" for k, why in _EXCLUDED_BY_NORM_LINEAR.items() if self.norm_linear and getattr(self, k)
        ]
        if clashes:
            raise ValueError(f"DecodePlan: norm_linear is exclusive with {', '.join(clashes)}; turn one of them off")
        if self.norm_gemv and not self.row_gemv:
            raise ValueError("DecodePlan: norm_gemv runs inside the QKV row GEMV: turn row_gemv on or norm_gemv off")
        for kernel in ("row_gemv", "row_fc1"):
            launch = getattr(self.launches, kernel)
            if self.norm_gemv and launch is not None and launch.splits != 1:
                raise ValueError(f"DecodePlan: norm_gemv writes the {kernel} projection summed: launches.{kernel}="
                                 f"{launch} needs SPLITS=1")  # fmt: skip
        parts = [f"{k} only its {what} projection" for k, what in (("swiglu_down", "down"), ("row_fc1", "up"))
                 if self.fused_mlp and getattr(self, k)]  # fmt: skip
        if parts:
            raise ValueError(f"DecodePlan: fused_mlp runs the whole MLP, {' and '.join(parts)}; turn fused_mlp or "
                             f"{'them' if len(parts) > 1 else 'it'} off")  # fmt: skip
        if self.pdl and not any(getattr(self, k) for k in ROW_KERNELS):
            raise ValueError(f"DecodePlan: pdl needs a row kernel ({', '.join(ROW_KERNELS)}): turn one on or pdl off")

    @property
    def layer_fusions(self) -> dict[str, bool]:
        """The fusions that change a layer's forward, by name."""
        return {name: getattr(self, name) for name in LAYER_FUSIONS}

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (launches as lists of integers), as :meth:`from_dict` reads it."""
        out = asdict(self)
        out["launches"] = {k: list(v) for k, v in out["launches"].items() if v is not None}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecodePlan:
        """A plan from JSON-like data: an optional ``"preset"`` (a :data:`DECODE_PRESETS` name: the fields not
        given), any boolean field, and ``"launches"`` mapping a kernel to its launch (a list of integers or the
        comma-separated form of ``Launch.parse``)."""
        data = dict(data)
        base = DECODE_PRESETS[_preset(data.pop("preset", "none"))]
        launches = data.pop("launches", {}) or {}
        names = {f.name for f in fields(cls)} - {"launches"}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"DecodePlan.from_dict: unknown fields {unknown}; use {sorted(names)}")
        types: dict[str, Any] = {
            "norm_linear": NormLinearLaunch,
            **dict.fromkeys(ROW_KERNELS, GemvLaunch),
            "fused_mlp": MlpLaunch,
            "attention": AttentionLaunch,
        }
        bad = sorted(set(launches) - set(types))
        if bad:
            raise ValueError(f"DecodePlan.from_dict: launches for unknown kernels {bad}; use {sorted(types)}")
        parsed = {k: types[k].parse(v) if isinstance(v, str) else types[k](*v) for k, v in launches.items()}
        flags: dict[str, Any] = {k: bool(v) for k, v in data.items()}
        return replace(base, **flags, launches=DecodeLaunches(**parsed))


_ATTENTION = DecodePlan(rope_in_attention=True, kv_write_in_attention=True, defer_residual=True)
DECODE_PRESETS: Mapping[str, DecodePlan] = MappingProxyType(
    {
        "none": DecodePlan(),  # every layer by its own forward, attention by separate kernels
        "attention": _ATTENTION,  # the attention-side fusions and the deferred residual add
        "row": replace(
            _ATTENTION,
            swiglu_down=True,
            proj_partials=True,
            row_gemv=True,
            pdl=True,
            norm_gemv=True,
            combine_in_attention=True,
            row_fc1=True,
            gated_norm_gemv=True,
            embed_rope=True,
            argmax_in_graph=True,
        ),
        "norm_linear": replace(_ATTENTION, norm_linear=True),
    }
)
"""The named plans (``auto`` resolves to ``row`` or ``attention``, see :func:`requested_plan`)."""


def _preset(name: object) -> str:
    if name == "auto" or name not in DECODE_PRESETS:
        raise ValueError(f"decode preset {name!r}: use one of {', '.join(map(repr, DECODE_PRESETS))}")
    return str(name)


def check_decode_kernels(value: object) -> None:
    """Raise a ValueError unless ``value`` is a preset name (:data:`DecodeKernels`) or a :class:`DecodePlan`."""
    if isinstance(value, DecodePlan):
        return
    if not isinstance(value, str) or value not in get_args(DecodeKernels):
        names = ", ".join(map(repr, get_args(DecodeKernels)))
        raise ValueError(f"decode_kernels={value!r}: use a preset name ({names}) or a DecodePlan")


def parse_decode_kernels(text: str) -> DecodeKernels | DecodePlan:
    """A ``--decode-kernels`` value: a preset name (:data:`DecodeKernels`), a decode plan as JSON (``'{"preset":
    "row", "fused_mlp": true, "swiglu_down": false, "row_fc1": false}'``, :meth:`DecodePlan.from_dict`), or the path of a JSON file of
    one. A ValueError names what is wrong (the value, the file, the field)."""
    names = get_args(DecodeKernels)
    if text in names:
        return text  # type: ignore[return-value]
    source, body = f"--decode-kernels {text!r}", text
    if not text.lstrip().startswith("{"):
        if not os.path.isfile(text):
            raise ValueError(f"{source}: not a preset ({', '.join(names)}), a JSON plan or a JSON file")
        source = f"decode plan file {text}"
        with open(text) as f:
            body = f.read()
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a decode plan is a JSON object, got {type(data).__name__}")
    try:
        return DecodePlan.from_dict(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def requested_plan(
    kernels: DecodeKernels | DecodePlan, *, device_type: str, backend: str, compiled: bool
) -> tuple[DecodePlan, bool]:
    """The plan ``kernels`` asks for on this device and attention backend, and whether it is strict.

    ``auto``: the ``row`` preset on CUDA with the Triton backend and compiled layers (their partial sums are summed
    inside the compiled residual add), else ``attention``; not strict, so each layer keeps the fusions it can take.
    A preset or a plan is strict: a standard layer part that cannot take one of its fusions is an error (a fusion that
    does not concern a layer, one whose part is of another type, is off for it under any plan). On the plain attention
    backend (no kernels to fuse into) RoPE and the KV write stay separate whatever was asked."""
    check_decode_kernels(kernels)
    if isinstance(kernels, DecodePlan):
        plan, strict = kernels, True
    elif kernels == "auto":
        fast = device_type == "cuda" and backend == "triton" and compiled
        plan, strict = DECODE_PRESETS["row" if fast else "attention"], False
    else:
        plan, strict = DECODE_PRESETS[kernels], True
    if backend != "triton" and (plan.rope_in_attention or plan.kv_write_in_attention or plan.combine_in_attention):
        log.info("attention backend %r: RoPE and the KV write run as kernels of their own", backend)
        plan = replace(plan, rope_in_attention=False, kv_write_in_attention=False, combine_in_attention=False)
    return plan, strict
