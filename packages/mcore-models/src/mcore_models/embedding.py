"""Input embedding: vocabulary-parallel word embeddings plus optional learned absolute positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.transformer.context import ModelContext
from mcore_parallel.tensor import VocabParallelEmbedding, normal_init, scatter_to_sp_region

__all__ = ["LanguageModelEmbedding"]


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config: TransformerConfig, ctx: ModelContext, prefix: str = "embedding") -> None:
        super().__init__()
        self.ctx, self.dropout = ctx, config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            tp=ctx.tp,
            pad_to_multiple_of=config.make_vocab_size_divisible_by,
            sequence_parallel=ctx.sequence_parallel,
            init_method=normal_init(config.init_method_std),
            seed=ctx.seed_for(f"{prefix}.word_embeddings.weight"),
            dtype=config.dtype,
            device=ctx.device,
        )
        self.position_embeddings: nn.Embedding | None = None
        if config.position_embedding == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size, dtype=config.dtype, device=ctx.device
            )
            if self.position_embeddings.weight.device.type != "meta":
                gen = torch.Generator(device=self.position_embeddings.weight.device)
                gen.manual_seed(ctx.seed_for(f"{prefix}.position_embeddings.weight"))
                with torch.no_grad():
                    full = torch.empty_like(self.position_embeddings.weight, dtype=torch.float32)
                    normal_init(config.init_method_std)(full, gen)
                    self.position_embeddings.weight.copy_(full)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``, ``position_ids``: ``[s, b]`` → ``[s (/ tp under SP), b, hidden]``."""
        return self.finish(self.word_embeddings(input_ids), position_ids)

    def finish(self, h: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Word embeddings ``h`` (``[s (/ tp under SP), b, hidden]``, possibly with some rows replaced, as a VLM
        splices its image embeddings) plus the learned positions, then dropout."""
        if self.position_embeddings is not None:
            pos = self.position_embeddings(position_ids)
            if self.ctx.sequence_parallel:
                pos = scatter_to_sp_region(pos, self.ctx.tp)
            h = h + pos
        if self.dropout > 0 and self.training:
            with self.ctx.sp_region_rng():
                h = F.dropout(h, self.dropout, training=True)
        return h
