"""``VisionEncoder``: a ViT image tower (CLIP / SigLIP) built from the language model's own transformer layers.

Pixels ``[b, channels, H, W]`` → patch embedding (a convolution with stride = patch size) → optional class token →
learned position embeddings → optional pre-LayerNorm → the layers of the layer spec (the LM's
:class:`~mcore_models.transformer.layer.TransformerLayer`, with bidirectional attention) → the hidden states of
``vision_feature_layer``, batch-first ``[b, tokens, hidden]`` (tokens = patches, plus the class token first).

Tensor parallelism is the LM's: the spec's column-parallel QKV / fc1 and row-parallel proj / fc2 split heads and the
MLP over the ``tp`` group; the embeddings and norms are replicated, and every rank returns the whole output. Parameter
names do not depend on the TP size (``decoder.layers.3.self_attention.linear_qkv.weight``, as in the LM), and each
parameter is drawn from a seed derived from its name, so the unsharded weights are the same at every TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.backends import layer_spec
from mcore_models.gpt import TransformerBlock
from mcore_models.spec import LayerSpec, default_spec
from mcore_models.transformer.context import ModelContext
from mcore_models.vision.config import VisionConfig
from mcore_parallel import Group, shard_info
from mcore_parallel.tensor import RNGStatesTracker, normal_init

__all__ = ["VisionEncoder", "VisionEmbeddings"]


def _seeded_normal_(param: torch.Tensor, ctx: ModelContext, name: str, std: float) -> None:
    """Fill a replicated parameter from the seed of its name (float32 draws, like the LM's position table)."""
    if param.device.type == "meta":
        return
    gen = torch.Generator(device=param.device)
    gen.manual_seed(ctx.seed_for(name))
    with torch.no_grad():
        full = torch.empty_like(param, dtype=torch.float32)
        normal_init(std)(full, gen)
        param.copy_(full)


class VisionEmbeddings(nn.Module):
    """Patches (a stride-``patch`` convolution), the class token and the learned position embeddings."""

    def __init__(self, config: VisionConfig, ctx: ModelContext, prefix: str = "embeddings") -> None:
        super().__init__()
        h, p, dt, dev = config.hidden_size, config.patch_size, config.dtype, ctx.device
        self.patch_size = p
        self.patch = nn.Conv2d(config.num_channels, h, p, stride=p, bias=config.patch_bias, dtype=dt, device=dev)
        _seeded_normal_(self.patch.weight, ctx, f"{prefix}.patch.weight", config.init_method_std)
        if self.patch.bias is not None:
            nn.init.zeros_(self.patch.bias)
        self.class_token: nn.Parameter | None = None
        if config.class_token:
            self.class_token = nn.Parameter(torch.empty(h, dtype=dt, device=dev))
            _seeded_normal_(self.class_token, ctx, f"{prefix}.class_token", config.init_method_std)
        self.position_embeddings = nn.Embedding(config.seq_length, h, dtype=dt, device=dev)
        _seeded_normal_(
            self.position_embeddings.weight, ctx, f"{prefix}.position_embeddings.weight", config.init_method_std
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[b, channels, H, W]`` → ``[b, tokens, hidden]``."""
        w = self.patch.weight
        x = F.conv2d(pixel_values.to(w.dtype), w, self.patch.bias, stride=self.patch_size)
        x = x.flatten(2).transpose(1, 2)  # [b, patches, hidden], patches in row-major order
        if self.class_token is not None:
            x = torch.cat([self.class_token.expand(x.shape[0], 1, -1), x], dim=1)
        if x.shape[1] != self.position_embeddings.num_embeddings:
            raise ValueError(
                f"the image gives {x.shape[1]} tokens but the encoder has {self.position_embeddings.num_embeddings} "
                f"positions: feed images of the configured image_size ({tuple(pixel_values.shape[-2:])} given)"
            )
        return x + self.position_embeddings.weight


class VisionEncoder(nn.Module):
    """A ViT encoder (CLIP / SigLIP vision tower), tensor-parallel over heads and MLP like the LM."""

    def __init__(
        self,
        config: VisionConfig,
        *,
        tp: Group | None = None,
        spec: LayerSpec | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tp = tp or Group.single("tp")
        config.check_parallel(tp.size)
        self.config = config
        self.layer_config = layer_config = config.transformer_config()
        self.ctx = ModelContext(tp, False, rng_tracker, device, config.seed)
        spec = spec or default_spec()
        self.embeddings = VisionEmbeddings(config, self.ctx)
        tc = layer_config
        self.pre_layernorm = spec.norm(tc, config.hidden_size, device) if config.pre_layernorm else None
        layers = {}
        for i in range(config.num_layers):
            s = layer_spec(spec, tc, i)
            layers[str(i)] = s.layer(tc, self.ctx, s, i, f"decoder.layers.{i}")
        self.decoder = TransformerBlock(layers, None)
        self.post_layernorm = spec.norm(tc, config.hidden_size, device) if config.post_layernorm != "none" else None

    # ----------------------------------------------------------------------------------------------- forward
    def _run(self, pixel_values: torch.Tensor, num_layers: int, keep_all: bool) -> list[torch.Tensor]:
        """Hidden states ``[b, tokens, hidden]`` after the embeddings (and pre-norm) and each of the first
        ``num_layers`` layers (only the last one unless ``keep_all``)."""
        x = self.embeddings(pixel_values)
        if self.pre_layernorm is not None:
            x = self.pre_layernorm(x)
        out = [x]
        hidden = x.transpose(0, 1)  # the layers run sequence-first
        for i in range(num_layers):
            hidden = self.decoder.layers[str(i)](hidden, None)
            if keep_all or i == num_layers - 1:
                out.append(hidden.transpose(0, 1))
        return out if keep_all else out[-1:]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The hidden states of ``config.vision_feature_layer`` (HF's ``hidden_states[k]``: no post-LayerNorm),
        ``[b, tokens, hidden]``; the layers after it are not run."""
        return self._run(pixel_values, self.config.feature_layers, keep_all=False)[-1]

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Every hidden state: the embeddings (after the pre-LayerNorm) and each layer's output (HF's
        ``output_hidden_states``)."""
        return self._run(pixel_values, self.config.num_layers, keep_all=True)

    def last_hidden_state(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The last layer's output, with the post-LayerNorm when it is on every token (HF's ``last_hidden_state``)."""
        x = self._run(pixel_values, self.config.num_layers, keep_all=False)[-1]
        if self.config.post_layernorm == "tokens":
            assert self.post_layernorm is not None
            x = self.post_layernorm(x)
        return x

    def pooled_output(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """CLIP's pooled output: the post-LayerNorm of the last layer's class token ``[b, hidden]``."""
        if self.config.post_layernorm != "class_token" or self.post_layernorm is None:
            raise ValueError(
                "pooled_output needs post_layernorm='class_token' (CLIP); SigLIP's attention-pooling head is not built"
            )
        return self.post_layernorm(self._run(pixel_values, self.config.num_layers, keep_all=False)[-1][:, 0])

    # ------------------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_global_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded (TP = 1) tensors, e.g. from :func:`~mcore_models.hf_vision.vision_hf_to_mcore`: each rank
        copies its own shard. Missing or unexpected keys are an error naming them."""
        params = dict(self.named_parameters())
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        if missing or unexpected:
            raise KeyError(f"state dict does not match the encoder: missing {missing}, unexpected {unexpected}")
        for name, param in params.items():
            info = shard_info(name, param, self.ctx.tp)
            full = state[name]
            if tuple(full.shape) != tuple(info.global_shape):
                raise ValueError(f"{name}: shape {tuple(full.shape)} but the encoder expects {info.global_shape}")
            for local_idx, global_idx in info.pieces:
                param[local_idx].copy_(full[global_idx])
