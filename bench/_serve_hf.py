"""The Hugging Face baseline of ``serve_bench.py``: ``generate()`` on llama-1b's shape with a static cache (which
compiles the decoding forward with CUDA graphs), run in a process of its own (``serve_bench.py --hf-only``)."""

from __future__ import annotations

import time
from typing import Any

import torch
from _serve_http import GEN, PROMPT


def hf_baseline(batch_sizes: list[int], deadline_s: float) -> list[dict[str, Any]]:
    """Output tokens/s and ms per token at each batch size (prompt 128, 128 new tokens, greedy) until the deadline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32768,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    # a static cache makes generate() compile the decoding forward itself (CUDA graphs, "reduce-overhead")
    model.generation_config.cache_implementation = "static"
    start = time.perf_counter()
    out = []
    for bs in batch_sizes:
        if time.perf_counter() - start > deadline_s:
            out.append({"batch": bs, "skipped": "time budget"})
            continue
        ids = torch.randint(0, 32768, (bs, PROMPT), device="cuda")
        kw = dict(max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False, pad_token_id=0)
        t_c = time.perf_counter()
        for _ in range(2):  # compile + capture, then a warm run
            model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        compile_s = time.perf_counter() - t_c
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        n = (g.shape[1] - PROMPT) * bs
        out.append(
            {
                "batch": bs,
                "output_tok_s": n / wall,
                "ms_per_token": wall * 1e3 / (g.shape[1] - PROMPT),
                "warmup_s": compile_s,
            }
        )
        print("hf", out[-1], flush=True)
    return out
