"""``VisionConfig``: the validated description of a ViT vision encoder (CLIP / SigLIP towers).

Every field has a default and a one-line doc; construction runs :meth:`VisionConfig.problems` and raises one
:class:`~mcore_models.errors.ConfigError` listing every problem (each naming its field). The transformer layers are
the language model's own: :meth:`VisionConfig.transformer_config` gives the
:class:`~mcore_models.config.TransformerConfig` they are built from (LayerNorm, biases, non-causal attention, no
position embedding inside the layers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_models.config import DTYPES, TransformerConfig
from mcore_models.errors import ConfigError

__all__ = ["VisionConfig", "VISION_PRESETS", "vision_preset"]

VISION_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_tanh")
POST_LAYERNORMS = ("none", "tokens", "class_token")
VISION_POSITIONS = ("learned",)


@dataclass(frozen=True)
class VisionConfig:
    """A ViT image encoder: patch embedding, optional class token, learned positions, pre-norm transformer layers."""

    image_size: int = 224
    """Side of the (square) input image in pixels."""
    patch_size: int = 14
    """Side of each square patch; the grid is ``image_size // patch_size`` patches a side (a remainder is cut off,
    as the strided convolution does: SigLIP-so400m's 384 px / 14 gives 27)."""
    num_channels: int = 3
    """Input channels (3 for RGB)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Transformer layers."""
    num_attention_heads: int = 4
    """Attention heads (multi-head; every head has its own key and value)."""
    ffn_hidden_size: int | None = None
    """MLP inner width; ``None`` = 4 * hidden_size."""
    activation: str = "quick_gelu"
    """MLP activation: quick_gelu (CLIP's ``x * sigmoid(1.702 x)``), gelu (exact) or gelu_tanh (SigLIP's)."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm (CLIP 1e-5, SigLIP 1e-6)."""
    class_token: bool = True
    """Prepend a learned class token to the patches (CLIP: yes, SigLIP: no)."""
    patch_bias: bool = False
    """Bias on the patch-embedding convolution (CLIP: no, SigLIP: yes)."""
    position_embedding: str = "learned"
    """learned (one learned vector per token position, class token included); 2-D RoPE is not built yet."""
    pre_layernorm: bool = True
    """LayerNorm on the embeddings before the first layer (CLIP's ``pre_layrnorm``; SigLIP has none)."""
    post_layernorm: str = "none"
    """Final LayerNorm: none; tokens (on every token of the last layer, SigLIP's ``post_layernorm``, part of HF's
    ``last_hidden_state``); class_token (only on the pooled class token, CLIP's ``post_layernorm``)."""
    vision_feature_layer: int = -1
    """Which hidden state :meth:`VisionEncoder.forward` returns, indexing ``[embeddings, layer 1, ..., layer N]`` as
    HF's ``hidden_states`` do: -1 the last layer, -2 the one before (LLaVA's choice), 0 the embeddings. Layers
    after it are not run."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before each residual add."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation."""
    params_dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    seed: int = 1234
    """Base seed of the initialisation (each parameter draws from a seed derived from it and its name)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form metadata (e.g. the HF architecture it came from); not used by the model."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(problems, header="invalid VisionConfig")

    # ------------------------------------------------------------------------------------------------ derived
    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @property
    def grid_size(self) -> int:
        """Patches along each side of the image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_size**2

    @property
    def seq_length(self) -> int:
        """Tokens per image: the patches, plus the class token when there is one."""
        return self.num_patches + int(self.class_token)

    @property
    def feature_layers(self) -> int:
        """How many layers run to reach ``vision_feature_layer`` (0: the embeddings)."""
        k = self.vision_feature_layer
        return k if k >= 0 else self.num_layers + 1 + k

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.params_dtype]

    def transformer_config(self) -> TransformerConfig:
        """The layers' config: pre-norm LayerNorm blocks with biases and bidirectional attention."""
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_size,
            activation=self.activation,
            normalization="layernorm",
            norm_eps=self.norm_eps,
            add_bias_linear=True,
            attention_causal=False,
            attention_dropout=self.attention_dropout,
            hidden_dropout=self.hidden_dropout,
            position_embedding="none",
            max_position_embeddings=self.seq_length,
            vocab_size=1,
            init_method_std=self.init_method_std,
            params_dtype=self.params_dtype,
            seed=self.seed,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError([f"unknown VisionConfig field(s) {unknown}"], header="invalid VisionConfig")
        return cls(**data)

    def replace(self, **changes: Any) -> VisionConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------------ checks
    def problems(self, tp_size: int = 1) -> list[str]:
        """Every problem with this config (empty when valid) for a tensor-parallel size."""
        p: list[str] = []
        ints = ("image_size", "patch_size", "num_channels", "hidden_size", "num_layers", "num_attention_heads")
        for name in (*ints, "ffn_hidden_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                p.append(f"{name}={v!r} must be a positive integer")
        for name, allowed in (
            ("activation", VISION_ACTIVATIONS),
            ("post_layernorm", POST_LAYERNORMS),
            ("position_embedding", VISION_POSITIONS),
            ("params_dtype", tuple(DTYPES)),
        ):
            if getattr(self, name) not in allowed:
                p.append(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("class_token", "patch_bias", "pre_layernorm"):
            if not isinstance(getattr(self, name), bool):
                p.append(f"{name}={getattr(self, name)!r} must be true or false")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"{name}={getattr(self, name)} must be in [0, 1)")
        for name in ("norm_eps", "init_method_std"):
            if not getattr(self, name) > 0:
                p.append(f"{name}={getattr(self, name)} must be positive")
        if p:
            return p
        return p + self._shape_problems(tp_size)

    def _shape_problems(self, tp_size: int) -> list[str]:
        p: list[str] = []
        if self.patch_size > self.image_size:
            p.append(f"patch_size={self.patch_size} is larger than image_size={self.image_size}")
        heads = self.num_attention_heads
        if self.hidden_size % heads:
            p.append(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={heads}")
        n, k = self.num_layers, self.vision_feature_layer
        if not isinstance(k, int) or isinstance(k, bool) or not -(n + 1) <= k <= n:
            p.append(f"vision_feature_layer={k!r} must be an integer in [{-(n + 1)}, {n}] (num_layers={n}: "
                     "-1 the last layer, 0 the embeddings)")  # fmt: skip
        if self.post_layernorm == "class_token" and not self.class_token:
            p.append("post_layernorm='class_token' needs class_token=true (there is no class token to normalise)")
        if tp_size > 1:
            if heads % tp_size:
                p.append(f"num_attention_heads={heads} is not divisible by the tensor-parallel size {tp_size}")
            if self.ffn_size % tp_size:
                p.append(f"ffn_hidden_size={self.ffn_size} is not divisible by the tensor-parallel size {tp_size}")
        return p

    def check_parallel(self, tp_size: int) -> None:
        """Raise one ConfigError listing every problem of this config under ``tp_size``."""
        problems = self.problems(tp_size)
        if problems:
            raise ConfigError(problems, header=f"VisionConfig does not work with tensor parallelism {tp_size}")


_CLIP = dict(activation="quick_gelu", norm_eps=1e-5, class_token=True, patch_bias=False, pre_layernorm=True,
             post_layernorm="class_token")  # fmt: skip
_SIGLIP = dict(activation="gelu_tanh", norm_eps=1e-6, class_token=False, patch_bias=True, pre_layernorm=False,
               post_layernorm="tokens")  # fmt: skip


def _tower(base: dict[str, Any], image: int, patch: int, hidden: int, layers: int, heads: int, ffn: int,
           feature_layer: int) -> dict[str, Any]:  # fmt: skip
    return dict(base, image_size=image, patch_size=patch, hidden_size=hidden, num_layers=layers,
                num_attention_heads=heads, ffn_hidden_size=ffn, vision_feature_layer=feature_layer)  # fmt: skip


VISION_PRESETS: dict[str, dict[str, Any]] = {
    # openai/clip-vit-large-patch14-336, as LLaVA-1.5 uses it (features of the second-to-last layer)
    "clip-vit-l14-336": _tower(_CLIP, 336, 14, 1024, 24, 16, 4096, -2),
    # google/siglip-so400m-patch14-384 (27 x 27 patches: the strided convolution drops the 6-pixel remainder)
    "siglip-so400m-14-384": _tower(_SIGLIP, 384, 14, 1152, 27, 16, 4304, -1),
    # tiny test towers (CPU, milliseconds)
    "tiny-clip": _tower(_CLIP, 16, 4, 32, 3, 4, 64, -2),
    "tiny-siglip": _tower(_SIGLIP, 16, 4, 32, 2, 4, 48, -1),
}


def vision_preset(name: str, **overrides: Any) -> VisionConfig:
    """A :class:`VisionConfig` from :data:`VISION_PRESETS` (``_`` and ``-`` are interchangeable in the name)."""
    key = name.replace("_", "-")
    if key not in VISION_PRESETS:
        raise KeyError(f"unknown vision preset {name!r}; known: {', '.join(sorted(VISION_PRESETS))}")
    return VisionConfig(**{**VISION_PRESETS[key], "extra": {"preset": key}, **overrides})
