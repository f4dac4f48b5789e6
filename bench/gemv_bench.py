"""Small-batch GEMMs of decoding (``y = x Wᵀ`` with few rows in ``x``): what each implementation reaches (not a test).

A batch-1 decode step of ``llama-1b`` spends most of its time in five weight-bound GEMMs per layer. cuBLAS runs the
QKV and output projections at ~5.9 µs on an H200 where reading their weights takes ~1-1.5 µs (2026-11-30 profile),
so this bench times, per shape and row count, inside a CUDA graph of back-to-back calls (as in a decode graph):

- ``cublas``: ``F.linear``;
- ``inductor``: ``torch.compile(F.linear, mode="max-autotune-no-cudagraphs")`` (autotuned Triton templates);
- ``triton``: the weight-streaming kernel below (one program per block of output features, all rows at once).

and reports µs per call and the weight bytes per second. ``--check`` compares the Triton kernel with ``F.linear``
(also on the CPU under ``TRITON_INTERPRET=1``).

    python bench/gemv_bench.py --rows 1 8 32 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {  # llama-1b: (out_features, in_features)
    "qkv": (3072, 2048),
    "proj": (2048, 2048),
    "fc1": (16384, 2048),
    "fc2": (2048, 8192),
    "lm_head": (32768, 2048),
}

_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit  # type: ignore[misc]
        def gemv(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
            pid = tl.program_id(0)
            rows = tl.arange(0, M_PAD)
            cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                            other=0.0)  # fmt: skip
                w = tl.load(W + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                            other=0.0)  # fmt: skip
                acc += tl.dot(x, tl.trans(w), input_precision="ieee" if X.dtype.element_ty == tl.float32 else None)
            tl.store(Y + rows[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                     mask=(rows[:, None] < M) & (cols[None, :] < N))  # fmt: skip

        _KERNEL = gemv
    return _KERNEL


def triton_linear(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, block_k: int = 256) -> torch.Tensor:
    """``F.linear(x, w)`` for ``x`` ``[M, K]`` with small ``M`` (at most 64), ``w`` ``[N, K]`` contiguous."""
    m, k = x.shape
    n = w.shape[0]
    if m > 64:
        raise ValueError(f"triton_linear is for small row counts (got {m})")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    m_pad = max(16, 1 << (m - 1).bit_length())
    _kernel()[(triton_cdiv(n, block_n),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), M_PAD=m_pad,
                                          BLOCK_N=block_n, BLOCK_K=block_k)  # fmt: skip
    return y


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def time_in_graph(fn: Any, calls: int = 50, reps: int = 20) -> float:
    """µs per call of ``fn`` replayed ``calls`` times back to back inside one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (reps * calls) * 1e6


def check(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for m in (1, 3, 8, 17):
        for n, k in ((96, 128), (130, 300)):
            x = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype)
            ref = F.linear(x.double(), w.double())
            out = triton_linear(x, w, block_n=32, block_k=64).double()
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            err = ((out - ref).abs() / (ref.abs() + 1)).max().item()
            assert err < tol, (m, n, k, err)
    print(f"triton_linear matches F.linear on {device} ({dtype})")


def norm_linear_rows(rows: list[int]) -> list[dict[str, Any]]:
    """µs per call (CUDA graph) of residual add + RMSNorm + linear (+ SwiGLU) at decode shapes: the unfused ops
    (each compiled by inductor, as in a compiled layer) against the one ``norm_linear`` kernel."""
    from mcore_models.transformer import norm_linear as nl
    from mcore_models.transformer.norm_linear import norm_linear

    def unfused(x: torch.Tensor, r: torch.Tensor, g: torch.Tensor, w: torch.Tensor, swiglu: bool) -> torch.Tensor:
        h = x + r
        y = F.linear(F.rms_norm(h, g.shape, g, 1e-5), w)
        if swiglu:
            a, b = y.chunk(2, dim=-1)
            y = F.silu(a) * b
        return y + h[..., :1]  # h is used, like the residual stream

    compiled = torch.compile(unfused, dynamic=False)
    out = []
    for name, swiglu in (("qkv", False), ("fc1", True), ("lm_head", False)):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        g = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for m in rows:
            x, r = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            y_ref = unfused(x, r, g, w, swiglu)
            y, h = norm_linear(x, r, g, 1e-5, w, swiglu)
            err = ((y + h[..., :1]).float() - y_ref.float()).abs().max().item()
            row = {
                "shape": name + (" + swiglu" if swiglu else ""),
                "rows": m,
                "unfused_us": time_in_graph(lambda x=x, r=r, g=g, w=w, s=swiglu: compiled(x, r, g, w, s)),
                "fused_us": time_in_graph(lambda x=x, r=r, g=g, w=w, s=swiglu: norm_linear(x, r, g, 1e-5, w, s)),
                "max_abs_diff": err,
            }
            for block_n, warps in ((16, 4), (32, 4), (64, 4), (16, 8), (32, 8), (64, 8)):  # the launch choices
                nl._LAUNCH_OVERRIDE = (block_n, warps)
                try:
                    row[f"fused_us_n{block_n}_w{warps}"] = time_in_graph(
                        lambda x=x, r=r, g=g, w=w, s=swiglu: norm_linear(x, r, g, 1e-5, w, s)
                    )
                finally:
                    nl._LAUNCH_OVERRIDE = None
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--check", action="store_true", help="only compare the Triton kernel with F.linear")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--norm-linear", action="store_true", help="only time the fused norm + linear kernel")
    args = ap.parse_args()
    if args.norm_linear:
        rows = norm_linear_rows([m for m in args.rows if m <= 16])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
        return
    if args.check or not torch.cuda.is_available():
        check("cuda" if torch.cuda.is_available() else "cpu", torch.float32)
        if torch.cuda.is_available():
            check("cuda", torch.bfloat16)
        return
    check("cuda", torch.bfloat16)
    dtype = torch.bfloat16
    compiled = None if args.no_inductor else torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    rows: list[dict[str, Any]] = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            row: dict[str, Any] = {"shape": name, "rows": m, "out": n, "in": k}
            impls: dict[str, Any] = {
                "cublas": lambda x=x, w=w: F.linear(x, w),
                "triton": lambda x=x, w=w: triton_linear(x, w),
            }
            if compiled is not None:
                impls["inductor"] = lambda x=x, w=w: compiled(x, w)
            for impl, fn in impls.items():
                try:
                    us = time_in_graph(fn)
                    row[f"{impl}_us"] = us
                    row[f"{impl}_weight_gb_s"] = n * k * 2 / us / 1e3
                except Exception as e:  # keep the other columns
                    row[f"{impl}_error"] = repr(e)[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"| shape | rows | {' | '.join(f'{i} µs (GB/s)' for i in ('cublas', 'triton', 'inductor'))} |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[f'{i}_us']:.2f} ({r[f'{i}_weight_gb_s']:.0f})" if f"{i}_us" in r else "-"
                 for i in ("cublas", "triton", "inductor")]  # fmt: skip
        print(f"| {r['shape']} {r['out']}x{r['in']} | {r['rows']} | {' | '.join(cells)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
