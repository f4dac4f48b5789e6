"""``TransformerConfig``: the validated description of a GPT-style decoder.

Every field has a default and a one-line doc. :meth:`TransformerConfig.validate` (called on construction) checks
every field and every cross-field rule and raises one :class:`~mcore_models.errors.ConfigError` listing all the
problems. Checks that depend on the tensor-parallel size live in :meth:`check_parallel`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_models.errors import ConfigError
from mcore_models.mamba_config import MambaConfig
from mcore_models.moe_config import MoEConfig

__all__ = ["TransformerConfig", "RopeScaling", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "squared_relu", "quick_gelu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned_absolute", "rope", "none")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "mlp")
"""What ``recompute='selective'`` may recompute (``recompute_modules``), Megatron-LM's names."""
ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
HYBRID_LAYERS = {"M": "Mamba", "*": "attention", "-": "MLP", "E": "MoE"}
"""The layer characters of ``hybrid_pattern`` (Megatron's symbols); ``|`` separates pipeline stages."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type: llama3`` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TransformerConfig:
    """A GPT-style decoder-only transformer."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model (residual stream) width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads (GQA); ``None`` = one per query head (MHA); 1 = MQA."""
    kv_channels: int | None = None
    """Per-head dimension; ``None`` = hidden_size / num_attention_heads."""
    ffn_hidden_size: int | None = None
    """MLP inner width; ``None`` = 4 * hidden_size."""
    activation: str = "gelu"
    """MLP activation: gelu (exact), gelu_tanh (GPT-2's), swiglu (gated SiLU, Llama), squared_relu, quick_gelu
    (``x * sigmoid(1.702 x)``, CLIP's)."""
    normalization: str = "layernorm"
    """layernorm or rmsnorm."""
    norm_eps: float = 1e-5
    """Epsilon of every normalisation."""
    add_bias_linear: bool = True
    """Biases on every linear layer (GPT-2: yes, Llama: no)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection even when add_bias_linear is off (Qwen-2 style)."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head before attention."""
    attention_causal: bool = True
    """Causal self-attention (a decoder); False: every token attends to every token (a vision encoder,
    :mod:`mcore_models.vision`)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before each residual add, and on the embeddings."""
    position_embedding: str = "learned_absolute"
    """learned_absolute (GPT-2), rope (Llama) or none."""
    max_position_embeddings: int = 2048
    """Longest sequence (size of the learned position table; RoPE tables are built on demand)."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that are rotated."""
    rope_scaling: RopeScaling | None = None
    """Llama-3 style frequency scaling, or None."""
    vocab_size: int = 256
    """True vocabulary size (the embedding is padded beyond it for TP)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the TP size."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the input embedding."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation."""
    scaled_output_init: bool = True
    """Initialise output projections (attention proj, MLP fc2) with std / sqrt(2 * num_layers)."""
    params_dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    recompute: str = "none"
    """Activation recompute: none, selective (the parts named by ``recompute_modules``) or full (whole layers)."""
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """With selective recompute, what is recomputed in backward instead of kept: ``core_attn`` (the attention
    kernel: keeps no scores, costs one more attention forward) and ``mlp`` (each dense layer's pre-MLP norm and MLP:
    keeps only the residual stream in place of the norm's output, fc1's gate/up output and the activation: about 70%
    of what a llama layer keeps per token; costs one more norm, fc1 GEMM and activation: fc1's forward is 16% of a
    llama-1b layer's training FLOPs at seq 4096, 6% at 64k). MoE layers' routed MLPs are not recomputed by
    ``mlp``."""
    recompute_num_layers: int | None = None
    """How many layers of each stage (the first ones) are recomputed: whole with full recompute, their MLPs with
    ``mlp`` in ``recompute_modules`` (None = all)."""
    attention_backend: str = "auto"
    """Kernel of ``F.scaled_dot_product_attention``: auto (PyTorch's choice), flash, cudnn, efficient or math. The
    same math; the choice only changes speed (measure it: head dim and GPU decide which kernel is fastest)."""
    attention_contiguous: bool = False
    """Hand SDPA contiguous ``[batch, heads, sequence, head_dim]`` queries, keys and values instead of views of the
    sequence-first activations (with compiled layers the copy is part of the RoPE kernel). The same math; only the
    attention kernels' speed may differ (``bench/attention_bench.py`` measures the layouts)."""
    swiglu_backward: str = "triton"
    """Backward of the SwiGLU activation: triton (the default: one pass over the elements on CUDA,
    ``mcore_models.transformer.swiglu``; PyTorch ops on the CPU) or torch (PyTorch's autograd, fused by
    torch.compile). The same math; only speed differs (llama-1b on an H200: +1.6% tokens/s with triton)."""
    rope_kernel: str = "triton"
    """Training's split of the QKV projection into queries, keys and values with RoPE on the queries and keys:
    triton (the default: one kernel each way on CUDA, ``mcore_models.transformer.qkv_rope``; PyTorch ops on the CPU)
    or torch (PyTorch ops, fused by torch.compile into three kernels forward and two backward). The same math; only
    speed differs. Used where RoPE rotates whole heads without q/k layernorm."""
    defer_residual_add: bool = True
    """Training and scoring (no inference context): each transformer layer's last residual add is done by the next
    one, with its input norm (one graph, so one kernel each way under ``training.compile=layers``, where a layer whose
    linears break the graph, the FP8 backend's, otherwise runs that add and the sum of the residual's gradient as
    kernels of their own). The same adds of the same tensors: bit for bit the same results as off. On by default:
    ``llama-1b/best`` on an H200, FP8 +0.5% tokens/s, bf16 unchanged (``docs/performance.md``)."""
    cross_entropy_fusion: bool = False
    """Training loss: run the output projection and the cross-entropy chunk by chunk over the tokens, recomputing the
    logits in backward, so float32 logits never exist for the whole micro-batch (saves ~6 bytes x tokens x vocab / tp
    of activation memory for one extra output-layer matmul). Same loss and gradients up to float rounding."""
    backend: str = "auto"
    """Layer backend (:mod:`mcore_models.backends`): torch (PyTorch's bf16 linears), fp8 (the linears of the attention
    and MLP in FP8 through torch._scaled_mm), or auto (fp8 when ``fp8`` is set, else torch). Parameter names are the
    same for every backend, so checkpoints are interchangeable."""
    fp8: str | None = None
    """FP8 training: e4m3 (every operand E4M3) or hybrid (E4M3 forward, E5M2 gradients); None = bf16."""
    fp8_recipe: str = "tensorwise"
    """How FP8 operands are scaled: tensorwise (each tensor by its own maximum), rowwise (per token / per output
    feature; needs fp8=e4m3) or delayed (from the maxima of the last fp8_amax_history_len steps)."""
    fp8_amax_history_len: int = 1024
    """Delayed scaling: optimizer steps of absolute maxima kept per tensor."""
    fp8_amax_compute_algo: str = "max"
    """Delayed scaling: scale from the history's max or its most_recent entry."""
    fp8_margin: int = 0
    """FP8 scales are lowered by 2**fp8_margin."""
    fp8_modules: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
    """Which linears of an FP8 layer run in FP8: qkv (attention's input projection), proj (its output projection),
    fc1, fc2 (the MLP's), experts (an MoE layer's routed experts: E4M3 grouped GEMMs with rowwise scales, on GPUs of
    compute capability 9.0+), and output (the output layer, whatever fp8_last_layers_bf16 says; untied embeddings,
    no cross_entropy_fusion); the others stay bf16."""
    fp8_first_layers_bf16: int = 1
    """The first this many layers stay bf16 (published FP8 recipes keep the first and last layers in bf16)."""
    fp8_last_layers_bf16: int = 1
    """The last this many layers stay bf16."""
    fp8_allgather: bool = False
    """Under sequence parallelism: cast a column-parallel linear's input to FP8 before the all-gather (FP8 bytes on
    the wire) instead of after a bf16 all-gather."""
    fp8_wgrad: bool = True
    """Weight gradients as FP8 GEMMs (tensorwise and delayed scaling; rowwise keeps them bf16); false: bf16."""
    fp8_fused_swiglu: bool | None = None
    """The FP8 MLP's SwiGLU writes fc2's FP8 input, and its backward fc1's FP8 output gradient, directly: two bf16
    tensors and their cast passes fewer per layer (:mod:`mcore_models.transformer.fp8_swiglu`). It needs
    fp8_recipe=delayed, activation=swiglu, fc1 and fc2 in fp8_modules, add_bias_linear=false, fp8_wgrad=true,
    fp8_allgather=false. None (the default): on wherever those hold (:attr:`fp8_swiglu_fused`); true: required (a
    configuration where it cannot run is refused); false: off."""
    moe: MoEConfig | None = None
    """Mixture of experts (:class:`~mcore_models.moe.MoEConfig`): which layers get routed experts, and how; None =
    every layer has a dense MLP."""
    mamba: MambaConfig | None = None
    """Mamba-2 mixers (:class:`~mcore_models.mamba_config.MambaConfig`): sizes and scan of the ``M`` layers of
    ``hybrid_pattern``; None = no Mamba layers."""
    hybrid_pattern: str | None = None
    """Megatron's hybrid layer pattern, one character per layer: ``M`` Mamba, ``*`` attention, ``-`` MLP, ``E``
    MoE, plus ``|`` between pipeline stages (not a layer); e.g. ``"M-M*-"``. None = the standard layer everywhere."""
    seed: int = 1234
    """Base seed of the initialisation (each parameter draws from a seed derived from it and its name)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form metadata carried along (e.g. the architecture name); not used by the model."""

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # accept the plain mapping a YAML file or HF config gives
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.moe, dict):
            unknown = sorted(set(self.moe) - {f.name for f in dataclasses.fields(MoEConfig)})
            if unknown:
                raise ConfigError([f"unknown moe field(s) {unknown}"])
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if isinstance(self.mamba, dict):
            unknown = sorted(set(self.mamba) - {f.name for f in dataclasses.fields(MambaConfig)})
            if unknown:
                raise ConfigError([f"unknown mamba field(s) {unknown}"])
            object.__setattr__(self, "mamba", MambaConfig(**self.mamba))
        for name in ("fp8_modules", "recompute_modules"):
            if isinstance(getattr(self, name), list):  # a YAML list or a checkpoint's JSON
                object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    def _recompute_module_problems(self) -> list[str]:
        mods = self.recompute_modules
        if not isinstance(mods, tuple) or not all(isinstance(m, str) for m in mods):
            return [f"recompute_modules={mods!r} must be a list of names among {', '.join(RECOMPUTE_MODULES)}"]
        unknown = sorted(set(mods) - set(RECOMPUTE_MODULES))
        if unknown:
            return [f"recompute_modules={list(mods)} has unknown entries {unknown}; use some of "
                    f"{', '.join(RECOMPUTE_MODULES)}"]  # fmt: skip
        if self.recompute == "selective" and not mods:
            return ["recompute_modules is empty with recompute='selective': name core_attn and/or mlp, or set "
                    "recompute='none'"]  # fmt: skip
        if self.recompute != "selective" and set(mods) != {"core_attn"}:
            return [f"recompute_modules={list(mods)} needs recompute='selective' (recompute={self.recompute!r})"]
        if "mlp" in mods and not self._has_dense_mlp():
            return ["recompute_modules has mlp, but every MLP of this model is a mixture of experts (or it has none), "
                    "which selective recompute leaves alone: mlp would recompute nothing; remove it, or use "
                    "recompute='full'"]  # fmt: skip
        return []

    def _has_dense_mlp(self) -> bool:
        """Whether some layer has a dense MLP (what ``recompute_modules=[mlp]`` recomputes)."""
        if self.hybrid_pattern is not None:
            return "-" in self.hybrid_pattern
        if self.moe is None:
            return True
        try:
            return not all(self.moe.is_moe_layer(i) for i in range(self.num_layers))
        except (IndexError, TypeError):  # a layer_freq list of the wrong length: moe.problems() says so
            return True

    @property
    def recompute_attention(self) -> bool:
        """Selective recompute of the core attention (``recompute_modules`` has ``core_attn``)."""
        return (
            self.recompute == "selective"
            and isinstance(self.recompute_modules, tuple)
            and ("core_attn" in self.recompute_modules)
        )

    @property
    def recompute_mlp(self) -> bool:
        """Selective recompute of dense layers' pre-MLP norm and MLP (``recompute_modules`` has ``mlp``)."""
        return (
            self.recompute == "selective"
            and isinstance(self.recompute_modules, tuple)
            and ("mlp" in self.recompute_modules)
        )

    # ------------------------------------------------------------------------------------------------ derived
    @property
    def query_groups(self) -> int:
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.kv_channels is None else self.kv_channels

    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.params_dtype]

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def layer_backend(self) -> str:
        """``backend`` with ``auto`` resolved: fp8 when ``fp8`` is set, else torch."""
        if self.backend == "auto":
            return "torch" if self.fp8 is None else "fp8"
        return self.backend

    @property
    def fp8_swiglu_fused(self) -> bool:
        """``fp8_fused_swiglu`` resolved: None is on wherever the fused FP8 SwiGLU can run (an FP8 model with the
        delayed recipe, SwiGLU, fc1 and fc2 in FP8, ...), off elsewhere."""
        if self.fp8_fused_swiglu is not None:
            return self.fp8_fused_swiglu
        from mcore_models.backends import fused_swiglu_problems

        return not fused_swiglu_problems(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields (the form stored in checkpoint metadata under ``"model"``)."""
        out = dataclasses.asdict(self)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError([f"unknown TransformerConfig field(s) {unknown}"])
        return cls(**data)

    def replace(self, **changes: Any) -> TransformerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------------ checks
    def problems(self, tp_size: int = 1) -> list[str]:
        """Every problem with this config (empty when valid) for a tensor-parallel size."""
        p: list[str] = []

        def positive(name: str) -> bool:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                p.append(f"{name}={v!r} must be a positive integer")
                return False
            return True

        ok = all([positive(n) for n in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")])
        for n in ("num_query_groups", "kv_channels", "ffn_hidden_size", "recompute_num_layers"):
            ok = positive(n) and ok
        positive("make_vocab_size_divisible_by")
        positive("max_position_embeddings")
        for name, allowed in (
            ("activation", ACTIVATIONS),
            ("normalization", NORMS),
            ("position_embedding", POSITIONS),
            ("recompute", RECOMPUTE),
            ("params_dtype", tuple(DTYPES)),
            ("attention_backend", ATTENTION_BACKENDS),
            ("swiglu_backward", ("torch", "triton")),
            ("rope_kernel", ("torch", "triton")),
        ):
            if getattr(self, name) not in allowed:
                p.append(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"{name}={getattr(self, name)} must be in [0, 1)")
        if not 0.0 < self.rotary_percent <= 1.0:
            p.append(f"rotary_percent={self.rotary_percent} must be in (0, 1]")
        if not isinstance(self.attention_causal, bool):
            p.append(f"attention_causal={self.attention_causal!r} must be true or false")
        if self.norm_eps <= 0:
            p.append(f"norm_eps={self.norm_eps} must be positive")
        if self.init_method_std <= 0:
            p.append(f"init_method_std={self.init_method_std} must be positive")
        if self.rope_scaling is not None and self.position_embedding != "rope":
            p.append("rope_scaling is set but position_embedding is not 'rope'")
        p.extend(self._fp8_problems())
        if not ok:
            return p
        p.extend(self._hybrid_problems(tp_size))
        if self.moe is not None:
            p.extend(self.moe.problems(self.num_layers))
            if self.add_bias_linear:
                p.append(
                    "moe is set but add_bias_linear=true: routed experts have no biases; set add_bias_linear=false"
                )
        heads, groups = self.num_attention_heads, self.query_groups
        if self.kv_channels is None and self.hidden_size % heads:
            p.append(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={heads}; "
                "change one of them or set kv_channels explicitly"
            )
        if heads % groups:
            p.append(f"num_attention_heads={heads} is not divisible by num_query_groups={groups}")
        if self.position_embedding == "rope":
            rot = int(self.head_dim * self.rotary_percent)
            if rot % 2:
                p.append(f"rotary dimension head_dim*rotary_percent = {rot} must be even")
        if self.recompute_num_layers is not None and self.recompute != "full" and not self.recompute_mlp:
            p.append(f"recompute_num_layers={self.recompute_num_layers} needs recompute='full' (or 'selective' with "
                     "mlp in recompute_modules)")  # fmt: skip
        p.extend(self._recompute_module_problems())
        p.extend(self._tp_problems(tp_size))
        return p

    def _tp_problems(self, tp_size: int) -> list[str]:
        p: list[str] = []
        if tp_size <= 1:
            return p
        heads, groups = self.num_attention_heads, self.query_groups
        if heads % tp_size:
            p.append(f"num_attention_heads={heads} is not divisible by the tensor-parallel size {tp_size}")
        if groups % tp_size:
            p.append(
                f"num_query_groups={groups} is not divisible by the tensor-parallel size {tp_size}; "
                f"use tp <= {groups} that divides it"
            )
        if self.ffn_size % tp_size:
            p.append(f"ffn_hidden_size={self.ffn_size} is not divisible by the tensor-parallel size {tp_size}")
        shared = None if self.moe is None else self.moe.shared_expert_ffn_hidden_size
        if shared is not None and shared % tp_size:
            p.append(f"moe.shared_expert_ffn_hidden_size={shared} is not divisible by the tensor-parallel size "
                     f"{tp_size}")  # fmt: skip
        return p

    def _fp8_problems(self) -> list[str]:
        from mcore_models.backends import backend_problems

        return backend_problems(self)

    @property
    def hybrid_layers(self) -> str | None:
        """``hybrid_pattern`` without the pipeline-stage separators: one character per layer (None without one)."""
        return None if self.hybrid_pattern is None else self.hybrid_pattern.replace("|", "")

    def _hybrid_problems(self, tp_size: int) -> list[str]:
        p: list[str] = []
        if self.mamba is not None:
            p.extend(self.mamba.problems(self.hidden_size, tp_size))
        pattern = self.hybrid_pattern
        if pattern is None:
            return p
        if not isinstance(pattern, str):
            return [*p, f"hybrid_pattern={pattern!r} must be a string (e.g. 'M-M*-')"]
        bad = sorted(set(pattern) - set(HYBRID_LAYERS) - {"|"})
        if bad:
            allowed = ", ".join(f"{c} {what}" for c, what in HYBRID_LAYERS.items())
            p.append(f"hybrid_pattern={pattern!r} has unknown character(s) {bad}: use {allowed}, | between stages")
        layers = pattern.replace("|", "")
        if len(layers) != self.num_layers:
            p.append(f"hybrid_pattern={pattern!r} has {len(layers)} layers (characters other than |) but "
                     f"num_layers={self.num_layers}; make them equal")  # fmt: skip
        if "|" in pattern and any(not stage for stage in pattern.split("|")):
            p.append(f"hybrid_pattern={pattern!r} has an empty pipeline stage (| at an end or ||)")
        if "M" in layers and self.mamba is None:
            p.append("hybrid_pattern has Mamba layers (M) but mamba is not set; set mamba (e.g. mamba={} for the "
                     "defaults of MambaConfig)")  # fmt: skip
        if "E" in layers and self.moe is None:
            p.append("hybrid_pattern has MoE layers (E) but moe is not set; set moe (e.g. moe={'num_experts': 8})")
        return p

    def check_parallel(self, tp_size: int) -> None:
        """Raise one ConfigError listing every problem of this config under ``tp_size``."""
        problems = self.problems(tp_size)
        if problems:
            raise ConfigError(problems, header=f"TransformerConfig does not work with tensor parallelism {tp_size}")
