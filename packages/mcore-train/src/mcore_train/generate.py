"""Greedy text generation through the trained model (full recompute each token; for the demo and smoke tests).

Serving with a KV cache, batching and sampling is mcore-infer's job; this is the simplest correct loop and works on
any tensor-parallel size (every TP rank runs it) without pipeline parallelism.
"""

from __future__ import annotations

import torch

from mcore_models import GPTModel

__all__ = ["greedy_generate"]


@torch.no_grad()
def greedy_generate(
    model: GPTModel, prompt_ids: list[int], max_new_tokens: int, stop_id: int | None = None
) -> list[int]:
    """The prompt's continuation (new token ids only)."""
    if not (model.pre_process and model.post_process):
        raise ValueError("greedy_generate needs the whole model on this rank (pipeline parallelism is not supported)")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    limit = model.config.max_position_embeddings
    out: list[int] = []
    tp = model.ctx.tp.size if model.ctx.sequence_parallel else 1
    for _ in range(max_new_tokens):
        window = ids[:, -limit:]
        pad = (-window.shape[1]) % tp  # sequence parallelism needs a length divisible by tp: pad on the right
        if pad:
            window = torch.cat([window, window.new_zeros((1, pad))], dim=1)
        logits = model(window, gather_logits=True)
        next_id = int(logits[0, window.shape[1] - pad - 1].argmax())
        out.append(next_id)
        if stop_id is not None and next_id == stop_id:
            break
        ids = torch.cat([ids, ids.new_tensor([[next_id]])], dim=1)
    model.train(was_training)
    return out
