"""A tiny Llama-style model (byte vocabulary) and the plain full-recompute greedy loop the engine must match."""

from __future__ import annotations

from typing import Any

import torch

from mcore_models import GPTModel, TransformerConfig
from mcore_parallel import Group
from tests._model_configs import llama


def tiny_config(**kw: Any) -> TransformerConfig:
    """The shared tiny Llama, wider, on the byte vocabulary, with a larger init so greedy outputs vary."""
    base: dict[str, Any] = dict(hidden_size=64, ffn_hidden_size=96, vocab_size=259, max_position_embeddings=256,
                                init_method_std=0.2, norm_eps=1e-5, rotary_base=10000.0, seed=1234)  # fmt: skip
    return llama(**{**base, **kw})


def tiny_model(tp: Group | None = None, **kw: Any) -> GPTModel:
    return GPTModel(tiny_config(**kw), tp=tp).eval()


def tiny_llm(model: GPTModel, **kw: Any) -> Any:
    """An ``LLM`` over ``model`` with a small cache and step budget (``kw``: more ``EngineConfig`` fields)."""
    from mcore_infer import LLM, EngineConfig

    cfg: dict[str, Any] = dict(block_size=16, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
    cfg.update(kw)
    return LLM(model=model, config=EngineConfig(**cfg))


@torch.no_grad()
def reference_greedy(model: GPTModel, prompt: list[int], n: int) -> list[int]:
    """Recompute the whole sequence for every new token (no cache), argmax of the last position."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        logits = model(torch.tensor([ids], device=next(model.parameters()).device), gather_logits=True)[0, -1]
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
    return out


def prompts_of_lengths(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
