"""Causal attention forward + backward on one GPU (not a test): which SDPA backend and which memory layout of q/k/v
reach the most TFLOP/s at a training shape.

mcore keeps activations sequence-first (``[s, b, heads, d]``) and hands SDPA permuted views; published attention
figures are usually for contiguous ``[b, heads, s, d]`` tensors. This bench times, for each backend and layout,
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` forward and backward (``llama-1b``: 32 query heads,
8 key/value heads, head dim 64, sequence 4096), with grouped keys/values passed natively (``enable_gqa``) or
repeated, and reports model TFLOP/s with causal attention counted half (the convention of docs/performance.md).
Layout conversions a layer would need are not timed here: compare them against the difference.

    python bench/attention_bench.py --batch 4 --seq 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F
from _timing import cuda_seconds
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def make(layout: str, b: int, s: int, n: int, d: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """A ``[b, n, s, d]`` view whose memory is laid out as ``layout`` (the letters name the memory order)."""
    shape = {"b": b, "s": s, "h": n, "d": d}
    t = torch.randn([shape[c] for c in layout], device=device, dtype=dtype, requires_grad=True)
    return t.permute(*[layout.index(c) for c in "bhsd"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    b, s, n, g, d = args.batch, args.seq, args.heads, args.groups, args.head_dim
    # forward: 2 GEMMs of 2*s*s*d per head; backward: 2.5x that (Megatron counts fwd + bwd = 3x fwd); causal half
    flops = 3 * 4 * b * n * s * s * d / 2
    rows = []
    for backend, kind in BACKENDS.items():
        for layout in ("sbhd", "bshd", "bhsd"):
            for gqa in ("native", "repeat"):
                q = make(layout, b, s, n, d, "cuda", torch.bfloat16)
                k = make(layout, b, s, g, d, "cuda", torch.bfloat16)
                v = make(layout, b, s, g, d, "cuda", torch.bfloat16)
                grad = torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16)

                def step(q=q, k=k, v=v, grad=grad, gqa=gqa, kind=kind) -> None:  # type: ignore[no-untyped-def]
                    kk, vv = k, v
                    kw: dict[str, Any] = {}
                    if gqa == "native":
                        kw["enable_gqa"] = True
                    else:
                        kk = k.repeat_interleave(n // g, dim=1)
                        vv = v.repeat_interleave(n // g, dim=1)
                    with sdpa_kernel([kind]):
                        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw)
                    out.backward(grad)

                try:
                    sec = cuda_seconds(step, args.iters)
                    row = {
                        "backend": backend,
                        "layout": layout,
                        "gqa": gqa,
                        "ms": sec * 1e3,
                        "tflops": flops / sec / 1e12,
                    }
                except RuntimeError as e:  # a backend that refuses this layout or GQA mode
                    row = {"backend": backend, "layout": layout, "gqa": gqa, "error": str(e).splitlines()[0][:160]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del q, k, v, grad
                torch.cuda.empty_cache()
    print(f"| backend | memory layout | GQA | fwd+bwd ms | model TFLOP/s |  (b={b}, s={s}, heads={n}/{g}, d={d})")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['backend']} | {r['layout']} | {r['gqa']} | {r['error']} | |")
        else:
            print(f"| {r['backend']} | {r['layout']} | {r['gqa']} | {r['ms']:.2f} | {r['tflops']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
