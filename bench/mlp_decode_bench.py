"""The MLP half of a batch-1 decode layer, timed as a chain of layers in one CUDA graph (not a test).

Each layer of the chain is what a decode step runs between the attention output projection and the next layer's
QKV projection: the residual add + RMSNorm kernel (``mcore_infer::add_rms_norm``, a programmatic dependent), then
the MLP, whose float32 output the next layer's add + norm reads as a partial sum. The MLP paths:

- ``cublas+swiglu_down``: cuBLAS's up projection, then SwiGLU inside the split-K down projection
  (``swiglu_down_partials``): what the ``row`` decode plan runs;
- ``fused LAUNCH``: the whole MLP as one kernel and the sum of its partials (``fused_mlp_partials``), at each launch
  of ``--launches`` (``BLOCK_F,BLOCK_K,BLOCK_H,WARPS``), after the add + norm kernel;
- ``fused+norm LAUNCH``: the same kernel doing the residual add and RMSNorm itself (``norm_mlp_partials``), no norm
  kernel: what the ``fused_mlp`` decode plan runs for an RMSNorm model.

Every layer has weights of its own (``--layers`` of ``llama-1b``'s sizes, 100 MB each: read from HBM, as in a decode
step); the graph replays the whole chain. Reports µs per layer and the weight bytes per second, one JSON object::

    python bench/mlp_decode_bench.py --json mlp.json

``--device cpu`` runs the same code without CUDA graphs in float32, under ``TRITON_INTERPRET=1`` the kernels too (a
check that the bench runs, at small ``--hidden``/``--ffn``; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from gemv_bench import time_in_graph

from mcore_infer.kernels import MlpLaunch
from mcore_infer.kernels.add_norm import add_rms_norm
from mcore_infer.kernels.fused_mlp import fused_mlp_partials, norm_mlp_partials
from mcore_infer.kernels.small_gemv import swiglu_down_partials


def time_graph(fn: Any, reps: int) -> float:
    """Seconds per replay of ``fn`` captured once in a CUDA graph (``gemv_bench.time_in_graph``); on the CPU, per
    plain call."""
    if torch.cuda.is_available():
        return time_in_graph(fn, calls=1, reps=reps) * 1e-6
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--launches", nargs="*", default=["64,128,64,8", "32,128,64,4", "64,64,64,8", "128,64,64,8",
                                                      "64,256,64,8", "32,256,64,8"])  # fmt: skip
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, h, ff = args.device, args.hidden, args.ffn
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    layers = [
        ((torch.randn(2 * ff, h, device=dev) / h**0.5).to(dt), (torch.randn(h, ff, device=dev) / ff**0.5).to(dt),
         1 + 0.1 * torch.randn(h, device=dev).to(dt))
        for _ in range(args.layers)
    ]  # fmt: skip
    x0 = torch.randn(args.rows, h, device=dev, dtype=dt)
    p0 = torch.randn(1, args.rows, h, device=dev)
    weight_bytes = sum(w1.nbytes + w2.nbytes for w1, w2, _ in layers)

    def chain(mlp: Any, norm_inside: bool = False) -> Any:
        def run() -> None:
            parts, resid = p0, x0
            for w1, w2, g in layers:
                if norm_inside:
                    parts, resid = mlp(parts, resid, g, w1, w2)
                else:
                    normed, resid = add_rms_norm(parts, resid, g, 1e-5, pdl=True)
                    parts = mlp(normed, w1, w2)

        return run

    def baseline(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return swiglu_down_partials(torch.nn.functional.linear(x, w1), w2, pdl=True)

    paths: dict[str, Any] = {"cublas+swiglu_down": (baseline, False)}
    for text in args.launches:
        launch = MlpLaunch.parse(text)
        paths[f"fused {text}"] = (lambda x, w1, w2, launch=launch: fused_mlp_partials(x, w1, w2, launch, True), False)
        paths[f"fused+norm {text}"] = (
            lambda p, r, g, w1, w2, launch=launch: norm_mlp_partials(p, r, g, 1e-5, w1, w2, launch, True),
            True,
        )
    # the paths agree (bfloat16: the fused path keeps the down projection in float32, like swiglu_down_partials)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    results: dict[str, Any] = {"device": name, "layers": args.layers, "hidden": h,
                               "ffn": ff, "rows": args.rows, "weight_mb_per_layer": weight_bytes / args.layers / 1e6,
                               "paths": {}}  # fmt: skip
    normed0, _ = add_rms_norm(p0, x0, layers[0][2], 1e-5)
    ref = baseline(normed0, *layers[0][:2]).sum(0)
    for name, (mlp, norm_inside) in paths.items():
        first = mlp(p0, x0, layers[0][2], *layers[0][:2])[0] if norm_inside else mlp(normed0, *layers[0][:2])
        err = (first.sum(0) - ref).abs().max().item()
        times = [time_graph(chain(mlp, norm_inside), args.reps) for _ in range(3)]
        sec = sorted(times)[1]
        row = {"us_per_layer": sec / args.layers * 1e6, "tb_per_s": weight_bytes / sec / 1e12, "max_abs_diff": err,
               "runs_us_per_layer": [t / args.layers * 1e6 for t in times]}  # fmt: skip
        results["paths"][name] = row
        print(f"{name:24s} {row['us_per_layer']:7.2f} us/layer  {row['tb_per_s']:.2f} TB/s  diff {err:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
