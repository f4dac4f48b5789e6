"""Text generation through the trained model (full recompute each token; for the demo and smoke tests): greedy, or
sampled at a temperature with a repetition penalty from a seeded generator.

Serving with a KV cache, batching and sampling is mcore-infer's job; this is the simplest correct loop and works on
any tensor-parallel size (every TP rank runs it, draws the same tokens from the same seed) without pipeline
parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_models import GPTModel

__all__ = ["Sampling", "END_OF_RUN_SAMPLING", "generate", "greedy_generate"]


@dataclass(frozen=True)
class Sampling:
    """How :func:`generate` picks each token."""

    temperature: float = 0.0
    """0: greedy (the most likely token); otherwise softmax(logits / temperature)."""
    repetition_penalty: float = 1.0
    """> 1 makes every token already in the prompt or the output less likely (CTRL's rule, as in Hugging Face and
    mcore-infer: a positive logit is divided by it, a negative one multiplied)."""
    seed: int = 0
    """The seed of the sampling generator (the same seed, prompt and model: the same text)."""

    def describe(self) -> str:
        if self.temperature <= 0:
            kind = "greedy"
        else:
            kind = f"temperature {self.temperature:g}, seed {self.seed}"
        return kind if self.repetition_penalty == 1.0 else f"{kind}, repetition penalty {self.repetition_penalty:g}"


END_OF_RUN_SAMPLING = Sampling(temperature=0.5, repetition_penalty=1.2)
"""What ``training.generate_at_end`` samples with (seeded with ``training.seed``): greedy decoding of a small model
falls into loops (``def test_context_context_...``); a moderate temperature with a repetition penalty shows what the
model has learned of the data's shape."""


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_id: int | None = None,
    vocab_size: int | None = None,
) -> list[int]:
    """The prompt's continuation (new token ids only, ending with ``stop_id`` when it was drawn); ``vocab_size``: the
    tokenizer's, so the padding rows of the output layer are never drawn."""
    if not (model.pre_process and model.post_process):
        raise ValueError("generation needs the whole model on this rank (pipeline parallelism is not supported)")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    limit = model.config.max_position_embeddings
    rng = torch.Generator().manual_seed(sampling.seed)
    seen = set(prompt_ids)
    out: list[int] = []
    tp = model.ctx.tp.size if model.ctx.sequence_parallel else 1
    for _ in range(max_new_tokens):
        window = ids[:, -limit:]
        pad = (-window.shape[1]) % tp  # sequence parallelism needs a length divisible by tp: pad on the right
        if pad:
            window = torch.cat([window, window.new_zeros((1, pad))], dim=1)
        logits = model(window, gather_logits=True)[0, window.shape[1] - pad - 1].float().cpu()
        if vocab_size is not None:
            logits = logits[:vocab_size]
        if sampling.repetition_penalty != 1.0 and seen:
            idx = torch.tensor(sorted(i for i in seen if i < logits.numel()), dtype=torch.long)
            picked = logits[idx]
            logits[idx] = torch.where(
                picked > 0, picked / sampling.repetition_penalty, picked * sampling.repetition_penalty
            )
        if sampling.temperature <= 0:
            next_id = int(logits.argmax())
        else:
            probs = torch.softmax(logits / sampling.temperature, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=rng))
        out.append(next_id)
        seen.add(next_id)
        if stop_id is not None and next_id == stop_id:
            break
        ids = torch.cat([ids, ids.new_tensor([[next_id]])], dim=1)
    model.train(was_training)
    return out


def greedy_generate(
    model: GPTModel, prompt_ids: list[int], max_new_tokens: int, stop_id: int | None = None
) -> list[int]:
    """The prompt's greedy continuation (new token ids only)."""
    return generate(model, prompt_ids, max_new_tokens, Sampling(), stop_id=stop_id)
