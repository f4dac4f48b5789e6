"""SwiGLU in the MLP's GEMM epilogues against cuBLAS + a separate elementwise kernel, one GPU.

Forward: ``x @ w_up.T`` (cuBLAS) then ``silu(gate) * up`` (inductor's fused kernel, as compiled layers run it),
against ``up_swiglu`` of ``bench/swiglu_gemm_kernels.py``. Backward: ``dy @ w_down`` (cuBLAS) then the Triton
SwiGLU backward (``model.swiglu_backward=triton``), against ``down_dgrad_swiglu``. Shapes default to one llama-1b
micro-batch of 8 x 4096 tokens (hidden 2048, MLP width 8192). Each tile configuration is timed on its own, then the
autotuned entry point; the largest difference from the unfused path is printed with each.

    python3 bench/swiglu_gemm_bench.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch
import torch.nn.functional as F
from swiglu_gemm_kernels import down_dgrad_swiglu, up_swiglu

from mcore_models.transformer.swiglu import swiglu_backward

log = logging.getLogger("swiglu_gemm_bench")

CONFIGS = [  # BM, BN, BK, stages, warps, persistent
    (128, 128, 64, 3, 8, True),
    (128, 128, 64, 4, 8, True),
    (128, 128, 64, 3, 8, False),
    (128, 128, 64, 4, 8, False),
    (128, 64, 64, 4, 4, True),
    (128, 64, 64, 5, 8, True),
    (64, 128, 64, 4, 4, True),
    (128, 256, 64, 3, 8, True),
    (256, 128, 64, 3, 8, True),
]


def timed(fn, iters: int) -> float:
    """Milliseconds per call: CUDA events around ``iters`` calls after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    m, k, f = a.tokens, a.hidden, a.ffn
    x = torch.randn(m, k, device=dev, dtype=dt)
    w_up = torch.randn(2 * f, k, device=dev, dtype=dt) * 0.02
    w_down = torch.randn(k, f, device=dev, dtype=dt) * 0.02
    dy = torch.randn(m, k, device=dev, dtype=dt)
    act = torch.compile(lambda gu: F.silu(gu[:, :f]) * gu[:, f:])
    flops_up, flops_down = 2 * m * k * 2 * f, 2 * m * k * f

    gu_ref = x @ w_up.t()
    h_ref = act(gu_ref)
    dgu_ref = swiglu_backward(gu_ref, dy @ w_down)
    rows: list[dict] = []

    def row(name: str, ms: float, flops: int, err: float | None = None) -> None:
        r = dict(case=name, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        if err is not None:
            r["max_abs_diff"] = err
        rows.append(r)
        log.info(json.dumps(r))

    a8 = torch.randn(8192, 8192, device=dev, dtype=dt)
    row("matmul 8192^3", timed(lambda: a8 @ a8, 20), 2 * 8192**3)
    t_mm = timed(lambda: x @ w_up.t(), a.iters)
    t_act = timed(lambda: act(gu_ref), a.iters)
    row("fwd cuBLAS up GEMM", t_mm, flops_up)
    row("fwd inductor swiglu", t_act, flops_up)
    row("fwd unfused total", t_mm + t_act, flops_up)
    t_dmm = timed(lambda: dy @ w_down, a.iters)
    dh = dy @ w_down
    t_bwd = timed(lambda: swiglu_backward(gu_ref, dh), a.iters)
    row("bwd cuBLAS down dgrad GEMM", t_dmm, flops_down)
    row("bwd triton swiglu backward", t_bwd, flops_down)
    row("bwd unfused total", t_dmm + t_bwd, flops_down)

    for cfg in CONFIGS:
        name = "x".join(map(str, cfg[:3])) + f" s{cfg[3]} w{cfg[4]} {'persistent' if cfg[5] else 'grid'}"
        for which in ("fwd", "bwd"):
            try:
                if which == "fwd":
                    gu, h = up_swiglu(x, w_up, blocks=cfg)
                    err = max((gu - gu_ref).abs().max().item(), (h - h_ref).abs().max().item())
                    ms = timed(lambda cfg=cfg: up_swiglu(x, w_up, blocks=cfg), a.iters)
                    row(f"fwd fused {name}", ms, flops_up, err)
                else:
                    dgu = down_dgrad_swiglu(dy, w_down, gu_ref, blocks=cfg)
                    err = (dgu - dgu_ref).abs().max().item()
                    ms = timed(lambda cfg=cfg: down_dgrad_swiglu(dy, w_down, gu_ref, blocks=cfg), a.iters)
                    row(f"bwd fused {name}", ms, flops_down, err)
            except Exception as e:  # a tile shape that does not fit (registers, shared memory)
                log.info("%s fused %s: %s", which, name, str(e).splitlines()[0][:200])
    t0 = time.time()
    gu, h = up_swiglu(x, w_up)
    dgu = down_dgrad_swiglu(dy, w_down, gu_ref)
    log.info("autotune %.1f s", time.time() - t0)
    err = max((gu - gu_ref).abs().max().item(), (h - h_ref).abs().max().item())
    row("fwd fused autotuned", timed(lambda: up_swiglu(x, w_up), a.iters), flops_up, err)
    row("bwd fused autotuned", timed(lambda: down_dgrad_swiglu(dy, w_down, gu_ref), a.iters), flops_down,
        (dgu - dgu_ref).abs().max().item())  # fmt: skip
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(tokens=m, hidden=k, ffn=f, device=torch.cuda.get_device_name(), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
