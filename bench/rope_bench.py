"""The QKV split + RoPE of a training step on one GPU: mcore's Triton kernel against PyTorch's ops (not a test).

Times, at one llama-1b micro-batch (default 8 x 4096 tokens, 32 query heads in 8 groups, head dim 64, bf16), the
forward and the forward + backward of

- ``triton``: :func:`mcore_models.transformer.qkv_rope.qkv_rope` (``model.rope_kernel=triton``, the default), which
  reads the QKV projection's output once and writes contiguous q, k and v;
- ``torch``: the same function through PyTorch's ops under ``torch.compile`` (what ``model.rope_kernel=torch`` runs
  inside compiled layers: the rotation of queries and keys together, then the split),

and reports ms per call and the bytes a call must move at the least (read the projection, write q/k/v; backward the
reverse) per second. Both paths' outputs are checked against each other first.

    python bench/rope_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from _timing import cuda_seconds

from mcore_models.transformer.qkv_rope import qkv_rope
from mcore_models.transformer.rope import apply_rotary


def torch_path(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int, head_dim: int) -> Any:
    s, b = qkv.shape[:2]
    x = qkv.view(s, b, groups, -1, head_dim)
    per_group = x.shape[3] - 2
    qk = apply_rotary(x[:, :, :, : per_group + 1], cos[:, :, :, None], sin[:, :, :, None])
    return qk[:, :, :, :per_group].reshape(s, b, groups * per_group, head_dim), qk[:, :, :, per_group], x[:, :, :, -1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    s, b, n, g, d = args.seq, args.batch, args.heads, args.groups, args.head_dim
    width = (n + 2 * g) * d
    qkv = torch.randn(s, b, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    angles = torch.arange(s, device="cuda", dtype=torch.float32)[:, None] * torch.rand(d // 2, device="cuda")
    emb = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    grads = [torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16) for h in (n, g, g)]
    paths = {"triton": qkv_rope, "torch": torch.compile(torch_path, dynamic=False)}
    outs = {name: fn(qkv, cos, sin, g, d) for name, fn in paths.items()}
    diff = max((a.float() - c.float()).abs().max().item() for a, c in zip(outs["triton"], outs["torch"]))
    nbytes = 2 * qkv.numel() * qkv.element_size()  # read the projection, write q/k/v (and the reverse backward)
    rows = []
    for name, fn in paths.items():

        def fwd(fn: Any = fn) -> None:
            with torch.no_grad():
                fn(qkv, cos, sin, g, d)

        def fwd_bwd(fn: Any = fn) -> None:
            torch.autograd.grad(fn(qkv, cos, sin, g, d), qkv, grads)  # no accumulation into qkv.grad

        f, fb = cuda_seconds(fwd, args.iters), cuda_seconds(fwd_bwd, args.iters)
        rows.append({"impl": name, "fwd_ms": f * 1e3, "fwd_bwd_ms": fb * 1e3, "bwd_ms": (fb - f) * 1e3,
                     "fwd_gb_s": nbytes / f / 1e9, "fwd_bwd_gb_s": 2 * nbytes / fb / 1e9})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"| impl | fwd ms | bwd ms | fwd + bwd ms | fwd GB/s |  (s={s}, b={b}, heads={n}/{g}, d={d}; "
          f"outputs agree within {diff:.3g})")  # fmt: skip
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['impl']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_gb_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "max_abs_diff": diff,
                       "shape": {"seq": s, "batch": b, "heads": n, "groups": g, "head_dim": d}, "rows": rows},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
