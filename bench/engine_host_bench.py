"""Host (CPU) time of one serving-engine step, the part a GPU step cannot hide (not a test).

The model runner is replaced by a stand-in that returns logits of the right shape at once, so what is timed is the
Python of a step: scheduling (continuous batching, block tables), packing, sampling, detokenization and bookkeeping
of every running request. Runs anywhere; the GPU's decode step time adds to it, since steps are not overlapped.

    python bench/engine_host_bench.py --requests 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_models import GPTModel, TransformerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=32,
                               activation="swiglu", normalization="rmsnorm", position_embedding="rope",
                               add_bias_linear=False, vocab_size=259, max_position_embeddings=1024)  # fmt: skip
    llm = LLM(model=GPTModel(config).eval(), config=EngineConfig(block_size=16, max_model_len=1024,
              max_num_seqs=args.requests, max_num_batched_tokens=8192))  # fmt: skip
    fake = torch.zeros(args.requests, config.vocab_size)
    llm.runner.execute = lambda batch, device_ids=None: fake[: len(batch.logits_index)]  # type: ignore[method-assign]
    prompts = torch.randint(0, 256, (args.requests, args.prompt), generator=torch.Generator().manual_seed(0)).tolist()
    results = {}
    for name, params in {
        "greedy": SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True),
        "temperature_top_p": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.tokens, ignore_eos=True),
    }.items():
        best = float("inf")
        for _ in range(args.repeats):
            before = llm.engine.num_steps
            t = time.perf_counter()
            llm.generate(prompts, params)
            best = min(best, (time.perf_counter() - t) / (llm.engine.num_steps - before))
        results[f"{name}_us_per_step"] = best * 1e6
        print(f"{name}: {best * 1e6:.0f} us of host time per step with {args.requests} running requests")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"requests": args.requests, **results}, f, indent=1)


if __name__ == "__main__":
    main()
