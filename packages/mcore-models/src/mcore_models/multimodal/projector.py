"""The projector of a LLaVA model: vision features ``[n, tokens, vision_hidden]`` → LM tokens ``[n, image_tokens,
lm_hidden]``, and the 2x2 pixel shuffle.

:class:`Projector` applies, in order, the feature selection (``patches`` drops the class token), the optional pixel
shuffle, and the MLP (``linear_fc1`` → exact GELU → ``linear_fc2``, LLaVA-1.5's ``mlp2x_gelu``) or the single
``linear_fc1``. Its parameters are replicated over tensor parallelism (every rank holds and computes all of it; the
gradients reaching it are complete on every rank, see :class:`~mcore_models.multimodal.LlavaModel`) and each is
drawn from a seed derived from its name, so TP 1 and TP 2 builds hold the same weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.multimodal.config import LlavaConfig
from mcore_parallel.tensor import derive_seed, normal_init

__all__ = ["Projector", "pixel_shuffle"]


def pixel_shuffle(x: torch.Tensor) -> torch.Tensor:
    """``[n, g*g, C]`` (a row-major ``g x g`` grid of tokens) → ``[n, (g/2)*(g/2), 4C]``.

    Output token ``(i, j)`` (row-major over the ``g/2 x g/2`` grid) is the concatenation, along the channels, of
    the input tokens ``(2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1)``: its 2x2 neighbourhood, itself row-major.
    This is the order of InternVL's ``pixel_shuffle(scale_factor=0.5)`` with ``ps_version="v2"`` (the one NVLM and
    Megatron-Core's LLaVA use), so their projector weights apply unchanged.
    """
    if x.dim() != 3:
        raise ValueError(f"pixel_shuffle takes [n, tokens, channels], got shape {tuple(x.shape)}")
    n, tokens, c = x.shape
    g = math.isqrt(tokens)
    if g * g != tokens:
        raise ValueError(f"pixel_shuffle needs a square grid of tokens, got {tokens} (drop the class token first)")
    if g % 2:
        raise ValueError(f"pixel_shuffle needs an even grid, got {g} x {g} tokens: change the image or patch size")
    h = g // 2
    return x.reshape(n, h, 2, h, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(n, h * h, 4 * c)


def _linear(
    fan_in: int, fan_out: int, bias: bool, name: str, config: LlavaConfig, device: torch.device | str | None
) -> nn.Linear:
    """An ``nn.Linear`` with its weight drawn from the seed of ``name`` (float32 draws, N(0, std²) with the
    language model's ``init_method_std``) and a zero bias."""
    lin = nn.Linear(fan_in, fan_out, bias=bias, dtype=config.language.dtype, device=device)
    if lin.weight.device.type != "meta":
        gen = torch.Generator(device=lin.weight.device)
        gen.manual_seed(derive_seed(config.language.seed, f"{name}.weight"))
        with torch.no_grad():
            full = torch.empty_like(lin.weight, dtype=torch.float32)
            normal_init(config.language.init_method_std)(full, gen)
            lin.weight.copy_(full)
            if lin.bias is not None:
                lin.bias.zero_()
    return lin


class Projector(nn.Module):
    """Feature selection, optional pixel shuffle, and the MLP (or linear) projector into the LM's width.

    Parameters: ``linear_fc1.weight`` ``[lm_hidden, vision_hidden (x 4 with the pixel shuffle)]`` (and ``.bias``),
    and for ``mlp`` ``linear_fc2.weight`` ``[lm_hidden, lm_hidden]`` (and ``.bias``).
    """

    def __init__(
        self, config: LlavaConfig, *, device: torch.device | str | None = None, prefix: str = "projector"
    ) -> None:
        """``prefix``: the module's name in the model, part of each parameter's seed."""
        super().__init__()
        self.config = config
        hidden, bias = config.language.hidden_size, config.projector_bias
        self.drop_class_token = config.vision_feature_select == "patches" and config.vision.class_token
        self.linear_fc1 = _linear(config.projector_input_size, hidden, bias, f"{prefix}.linear_fc1", config, device)
        self.linear_fc2: nn.Linear | None = None
        if config.projector == "mlp":
            self.linear_fc2 = _linear(hidden, hidden, bias, f"{prefix}.linear_fc2", config, device)

    def select(self, features: torch.Tensor) -> torch.Tensor:
        """The selected tokens (``patches``: without the class token) after the pixel shuffle, when configured."""
        if features.dim() != 3 or features.shape[-1] != self.config.vision.hidden_size:
            raise ValueError(f"the projector takes vision features [n, tokens, {self.config.vision.hidden_size}], "
                             f"got shape {tuple(features.shape)}")  # fmt: skip
        if features.shape[1] != self.config.vision.seq_length:
            raise ValueError(f"the projector takes the {self.config.vision.seq_length} tokens per image of the "
                             f"vision tower, got {features.shape[1]}")  # fmt: skip
        x = features[:, 1:] if self.drop_class_token else features
        return pixel_shuffle(x) if self.config.pixel_shuffle else x

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, tokens, vision_hidden]`` (the tower's output) → ``[n, image_tokens, lm_hidden]``."""
        x = self.select(features).to(self.linear_fc1.weight.dtype)
        x = self.linear_fc1(x)
        if self.linear_fc2 is not None:
            x = self.linear_fc2(F.gelu(x))
        return x
