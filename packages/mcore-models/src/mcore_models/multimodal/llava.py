"""``LlavaModel``: a vision tower, a projector and a GPT language model, with image embeddings spliced into the
language model's input at the image token's positions.

::

    images [n, C, H, W] → vision (VisionEncoder) → [n, tokens, vision_hidden] → projector → [n, image_tokens, hidden]
    input_ids [b, s] → word embeddings, each position where input_ids == image_token_id replaced (in order: row 0's
                       positions first, each row left to right) by the next image token: images[0]'s, then images[1]'s
                     → + learned positions (if the LM has them), dropout → the GPT layers (decoder_input) → loss

Parallelism:

- Tensor parallelism: the vision tower is split like the LM (heads, MLP) and returns the whole output on every
  rank; the projector is replicated. The spliced input is replicated (without sequence parallelism) or this rank's
  sequence chunk (with it: the image embeddings are placed into a full-sequence tensor and scattered to the chunk,
  whose backward all-gathers the gradient), so the tower and projector get complete gradients on every rank.
- Pipeline parallelism: the tower and projector live on the first stage (``pre_process``); later stages are plain
  GPT stages whose forward gets no images.

Parameters that never get a gradient are built with ``requires_grad=False``: those of every part named in
``config.freeze`` (a frozen tower still runs forward, under ``torch.no_grad()``), and the tower's layers after
``vision_feature_layer`` and its post-LayerNorm, which the features do not pass through (kept, so the tower's state
dict is the whole HF tower's).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch import nn

from mcore_models.gpt import GPTModel
from mcore_models.multimodal.config import LlavaConfig
from mcore_models.multimodal.projector import Projector
from mcore_models.spec import LayerSpec
from mcore_models.vision import VisionEncoder
from mcore_parallel import Group, ShardedTensor, shard_info
from mcore_parallel.tensor import RNGStatesTracker, scatter_to_sp_region

__all__ = ["LlavaModel"]

logger = logging.getLogger(__name__)


class LlavaModel(nn.Module):
    """A LLaVA-style vision-language model (see the module docstring)."""

    vision: VisionEncoder
    """The vision tower (first pipeline stage only): ``vision.embeddings.*``, ``vision.decoder.layers.{i}.*``."""
    projector: Projector
    """Vision features → LM tokens (first pipeline stage only): ``projector.linear_fc1.weight``, ..."""
    language: GPTModel
    """The language model: ``language.embedding.*``, ``language.decoder.layers.{i}.*``, ``language.output_layer.*``."""

    def __init__(
        self,
        config: LlavaConfig,
        *,
        tp: Group | None = None,
        sequence_parallel: bool = False,
        pre_process: bool = True,
        post_process: bool = True,
        layers: range | None = None,
        spec: LayerSpec | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
        ep: Group | None = None,
        expert_tp: Group | None = None,
        balance: Group | None = None,
    ) -> None:
        """The arguments are :class:`~mcore_models.gpt.GPTModel`'s, for the language model; ``tp``, ``spec``,
        ``rng_tracker`` and ``device`` apply to the vision tower too."""
        super().__init__()
        tp = tp or Group.single("tp")
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        if pre_process:
            self.vision = VisionEncoder(config.vision, tp=tp, spec=spec, rng_tracker=rng_tracker, device=device)
            self.projector = Projector(config, device=device)
        self.language = GPTModel(config.language, tp=tp, sequence_parallel=sequence_parallel,
                                 pre_process=pre_process, post_process=post_process, layers=layers, spec=spec,
                                 rng_tracker=rng_tracker, device=device, ep=ep, expert_tp=expert_tp,
                                 balance=balance)  # fmt: skip
        self.ctx = self.language.ctx
        self._set_requires_grad()

    def _set_requires_grad(self) -> None:
        frozen = []
        for part in self.config.freeze:
            module = getattr(self, part, None)
            if module is not None:  # the tower and projector exist on the first stage only
                module.requires_grad_(False)
                frozen.append(part)
        if self.pre_process:
            for p in self._unused_vision_parameters():
                p.requires_grad_(False)
        if frozen:
            logger.info("LlavaModel: frozen (requires_grad=False): %s", ", ".join(frozen))

    def _unused_vision_parameters(self) -> Iterator[nn.Parameter]:
        """The tower's parameters the features do not pass through: layers after ``vision_feature_layer`` and the
        post-LayerNorm (the LLaVA features are ``hidden_states[vision_feature_layer]``, without it)."""
        used = self.vision.config.feature_layers
        for key, layer in self.vision.decoder.layers.items():
            if int(key) >= used:
                yield from layer.parameters()
        if self.vision.post_layernorm is not None:
            yield from self.vision.post_layernorm.parameters()

    # ----------------------------------------------------------------------------------------------- forward
    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states from the previous pipeline stage (``[s (/ tp), b, hidden]``; stages without
        ``pre_process``)."""
        self.language.set_input_tensor(tensor)

    def compile_layers(self, dynamic: bool = False, mode: str | None = None) -> None:
        """``torch.compile`` each layer of the language model and of the vision tower in place (see
        :meth:`GPTModel.compile_layers`)."""
        self.language.compile_layers(dynamic=dynamic, mode=mode)
        if self.pre_process:
            for layer in self.vision.decoder.layers.values():
                layer.compile(dynamic=dynamic, mode=mode)

    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """Pixels ``[n, C, H, W]`` → the LM tokens of each image ``[n, image_tokens, lm_hidden]`` (the tower's
        features of ``vision_feature_layer``, selected, pixel-shuffled when configured, projected)."""
        if not self.pre_process:
            raise RuntimeError("image_embeddings runs on the first pipeline stage (pre_process=True), which holds the "
                               "vision tower and the projector")  # fmt: skip
        v = self.config.vision
        if images.dim() != 4 or images.shape[1] != v.num_channels:
            raise ValueError(f"images must be [n, {v.num_channels}, {v.image_size}, {v.image_size}] pixels, got shape "
                             f"{tuple(images.shape)}")  # fmt: skip
        frozen = "vision" in self.config.freeze and not images.requires_grad
        with torch.no_grad() if frozen else nullcontext():  # a frozen tower keeps no activations for backward
            features = self.vision(images)
        return self.projector(features)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        images: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        gather_logits: bool = False,
        image_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage; returns what :meth:`GPTModel.forward` does (the per-token loss ``[b, s]`` with
        ``labels`` on the last stage, else logits; the hidden states for the next stage elsewhere).

        ``input_ids``, ``position_ids``, ``labels``: ``[b, s]``. ``images``: ``[n, C, H, W]``, the images of the
        whole micro-batch in the order their tokens appear (see :meth:`decoder_input`). ``image_positions``: where
        the image embeddings go, instead of the positions of ``image_token_id`` in ``input_ids``. Later pipeline
        stages take neither (their input is the previous stage's hidden states).
        """
        if not self.pre_process:
            if images is not None or image_positions is not None:
                raise ValueError("images / image_positions were given to a pipeline stage without pre_process: the "
                                 "vision tower lives on the first stage; pass them to its forward only")  # fmt: skip
            return self.language(input_ids, position_ids, labels, gather_logits=gather_logits)
        if input_ids is None:
            raise ValueError("the first pipeline stage needs input_ids")
        hidden = self.decoder_input(input_ids, images, position_ids, image_positions=image_positions)
        return self.language(input_ids, position_ids, labels, gather_logits=gather_logits, decoder_input=hidden)

    def decoder_input(
        self,
        input_ids: torch.Tensor,
        images: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        image_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The language model's first-layer input ``[s (/ tp under SP), b, hidden]``: the word embeddings of
        ``input_ids`` ``[b, s]`` with the image embeddings of ``images`` spliced in, then the learned position
        embeddings (when the LM has them) and the embedding dropout, as the LM's own embedding does.

        The image positions are, in order, those where ``input_ids == image_token_id``, taken row-major (row 0
        left to right, then row 1, ...); they receive image 0's ``image_tokens`` embeddings, then image 1's, ....
        ``image_positions`` gives them instead: a boolean mask ``[b, s]`` (the same row-major order; e.g. the data
        loader's ``image_mask``), or integer positions ``[b, k]`` within each row (row 0's ``k`` positions first,
        each row in the given order). The number of positions must be ``n * image_tokens``.
        """
        index = self._image_index(input_ids, image_positions)
        count, per_image = index.numel(), self.config.image_tokens
        if images is None or (count == 0 and images.shape[0] == 0):
            if count:
                raise ValueError(f"input_ids hold {count} image-token positions (image_token_id="
                                 f"{self.config.image_token_id}) but no images were given: pass images [n, C, H, W] "
                                 f"with n * {per_image} (image_tokens) = {count}")  # fmt: skip
            return self.splice(input_ids, None, index, position_ids)
        n = images.shape[0]
        if count != n * per_image:
            raise ValueError(f"input_ids hold {count} image-token positions but {n} image(s) x {per_image} "
                             f"image_tokens = {n * per_image} embeddings were given: each image needs exactly "
                             f"{per_image} copies of image_token_id={self.config.image_token_id} in input_ids "
                             "(config.image_tokens), or pass as many images as the tokens stand for")  # fmt: skip
        return self.splice(input_ids, self.image_embeddings(images), index, position_ids)

    def _image_index(self, input_ids: torch.Tensor, image_positions: torch.Tensor | None) -> torch.Tensor:
        """The image positions as flat indices into ``[b * s]`` (row-major), in the order they are filled."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [b, s], got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if image_positions is None:
            return (input_ids == self.config.image_token_id).reshape(-1).nonzero().squeeze(1)
        if image_positions.dtype == torch.bool:
            if tuple(image_positions.shape) != (b, s):
                raise ValueError(f"a boolean image_positions must be [b, s] = {(b, s)} like input_ids, got shape "
                                 f"{tuple(image_positions.shape)}")  # fmt: skip
            return image_positions.to(input_ids.device).reshape(-1).nonzero().squeeze(1)
        if image_positions.is_floating_point() or image_positions.dim() != 2 or image_positions.shape[0] != b:
            raise ValueError(f"image_positions must be a boolean mask [b, s] or integer positions [b, k] with b={b}, "
                             f"got {image_positions.dtype} of shape {tuple(image_positions.shape)}")  # fmt: skip
        pos = image_positions.to(device=input_ids.device, dtype=torch.long)
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= s):
            raise ValueError(f"image_positions must lie in [0, {s}) (the sequence length), got values in "
                             f"[{int(pos.min())}, {int(pos.max())}]")  # fmt: skip
        index = (torch.arange(b, device=pos.device)[:, None] * s + pos).reshape(-1)
        if index.unique().numel() != index.numel():
            raise ValueError("image_positions name a position twice within a row")
        return index

    def splice(
        self,
        input_ids: torch.Tensor,
        image_embeds: torch.Tensor | None,
        index: torch.Tensor,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Word embeddings with ``image_embeds`` at ``index`` (flat ``b * s`` positions), then positions and dropout
        (``[s (/ tp), b, h]``): the first-layer input. Public for the serving engine, which splices the embeddings
        of a prefill chunk's image positions with it (``mcore_infer.runner``)."""
        lm = self.language
        emb, ctx = lm.embedding, lm.ctx
        b, s = input_ids.shape
        h = emb.word_embeddings(input_ids.t())  # [s (/ tp under SP), b, hidden]
        if image_embeds is not None and index.numel():
            hidden = h.shape[-1]
            src = image_embeds.reshape(-1, hidden).to(h.dtype)
            full = src.new_zeros(b * s, hidden).index_copy(0, index, src).view(b, s, hidden).transpose(0, 1)
            mask = torch.zeros(b * s, dtype=torch.bool, device=h.device).index_fill_(0, index, True)
            mask = mask.view(b, s).t()  # [s, b]
            if ctx.sequence_parallel:  # this rank's chunk; the backward all-gathers the gradient of `full`
                full = scatter_to_sp_region(full.contiguous(), ctx.tp)
                chunk = s // ctx.tp.size
                mask = mask[ctx.tp.rank * chunk : (ctx.tp.rank + 1) * chunk]
            h = torch.where(mask.unsqueeze(-1), full, h)
        return emb.finish(h, lm._positions(position_ids, s, h.device))

    # ---------------------------------------------------------------------------------------- state handling
    def _tower_parts(self) -> list[tuple[str, nn.Module]]:
        return [("vision", self.vision), ("projector", self.projector)] if self.pre_process else []

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """Every parameter of this stage as its piece of the global tensor, keyed by its name in this module
        (``vision.*``, ``projector.*``, ``language.*``): the language model's entries are
        :meth:`GPTModel.sharded_state_dict`'s with ``language.`` in front (a tied output layer's replica too)."""
        out: dict[str, ShardedTensor] = {}
        for prefix, module in self._tower_parts():
            for name, param in module.named_parameters():
                key = f"{prefix}.{name}"
                out[key] = shard_info(key, param, self.ctx.tp)
        out.update(_prefixed(self.language.sharded_state_dict()))
        return out

    def runtime_state_dict(self) -> dict[str, ShardedTensor]:
        """The language model's state beyond the parameters (FP8 scaling histories), under ``language.``."""
        return _prefixed(self.language.runtime_state_dict())

    def load_global_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's pieces from global tensors keyed like :meth:`sharded_state_dict` (e.g. a converted
        Hugging Face LLaVA state dict). With ``strict``, missing or unexpected keys are a KeyError naming them."""
        mine = self.sharded_state_dict()
        wanted = {info.key for info in mine.values()}
        missing, unexpected = sorted(wanted - set(state)), sorted(set(state) - wanted)
        if strict and (missing or unexpected):
            raise KeyError(f"state dict does not match the LlavaModel: missing {missing}, unexpected {unexpected}")
        for info in mine.values():
            if info.key in state:
                info.load_from(state[info.key].to(info.local.device))

    @torch.no_grad()
    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """Gather every parameter of this stage into its global tensor (all TP ranks must call; small models).
        The tensors are copies, detached from autograd."""
        out: dict[str, torch.Tensor] = {}
        tp = self.ctx.tp
        for prefix, module in self._tower_parts():
            for name, param in module.named_parameters():
                info = shard_info(f"{prefix}.{name}", param, tp)
                full = torch.zeros(info.global_shape, dtype=param.dtype, device=param.device)
                info.scatter_into(full)
                if tp.size > 1 and getattr(param, "tensor_model_parallel", False):
                    torch.distributed.all_reduce(full, group=tp.pg)
                out[info.key] = full
        out.update({f"language.{k}": v for k, v in self.language.global_state_dict().items()})
        return out


def _prefixed(items: dict[str, ShardedTensor], prefix: str = "language.") -> dict[str, ShardedTensor]:
    return {prefix + name: dataclasses.replace(info, key=prefix + info.key) for name, info in items.items()}
