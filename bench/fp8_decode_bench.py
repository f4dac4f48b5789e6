"""Does FP8 pay for serving? The linears of one decode step of llama-1b (16 layers: QKV 2048 -> 3072, output
projection 2048 -> 2048, FC1 2048 -> 16384, FC2 8192 -> 2048) at a few batch sizes, bf16 against FP8 with rowwise
scales (E4M3 weights scaled per output channel once, each input quantised per token in the step), one GPU (not a
test).

Every path runs as one CUDA graph of the 64 linears, as the engine replays its decode steps, so host launches are
not counted; each layer has its own weights (2 GB in bf16), so they are read from HBM as in a real step, not from
the L2. FP8 rows: ``eager`` quantises with ``mcore_parallel.fp8`` (the amax and the cast kernels) and multiplies
with ``torch._scaled_mm``; ``compiled`` is the same math under ``torch.compile``, whose generated kernel fuses the
amax and the cast. The ratio is the bf16 graph's time over the FP8 one's: above 1, FP8 serving would pay at that
batch size for the linears (attention, norms and the LM head are not in either).

    python3 bench/fp8_decode_bench.py --tokens 1,16,64,256 --json fp8_decode.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _timing import cuda_seconds

from mcore_parallel.fp8 import E4M3
from mcore_parallel.fp8.gemm import scaled_mm
from mcore_parallel.fp8.scaling import Fp8Tensor, current_scale, quantize

SHAPES = {"qkv": (2048, 3072), "proj": (2048, 2048), "fc1": (2048, 16384), "fc2": (8192, 2048)}
LAYERS = 16


def _weights() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [{name: (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
             for name, (k, n) in SHAPES.items()} for _ in range(LAYERS)]  # fmt: skip


def _rowwise(w: torch.Tensor) -> Fp8Tensor:
    return quantize(w, E4M3, current_scale(w, E4M3, True, 0, None))


def _fp8_linear_torch(x: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Rowwise E4M3 quantisation of ``x`` in plain ops (for ``torch.compile`` to fuse) and the scaled GEMM."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, E4M3.max / amax, torch.ones_like(amax))
    q = (x.float() * scale).clamp(-E4M3.max, E4M3.max).to(E4M3.dtype)
    return torch._scaled_mm(q, data.t(), scale.reciprocal(), scale_inv.reshape(1, -1), out_dtype=torch.bfloat16)


def _paths(
    weights: list[dict[str, torch.Tensor]], fp8: list[dict[str, Fp8Tensor]]
) -> dict[str, Callable[[dict[int, torch.Tensor]], None]]:
    compiled = torch.compile(_fp8_linear_torch, dynamic=False)

    def bf16(xs: dict[int, torch.Tensor]) -> None:
        for layer in weights:
            for name, (k, _) in SHAPES.items():
                F.linear(xs[k], layer[name])

    def eager(xs: dict[int, torch.Tensor]) -> None:
        for layer in fp8:
            for name, (k, _) in SHAPES.items():
                x = xs[k]
                scaled_mm(quantize(x, E4M3, current_scale(x, E4M3, True, 0, None)), layer[name], torch.bfloat16)

    def comp(xs: dict[int, torch.Tensor]) -> None:
        for layer in fp8:
            for name, (k, _) in SHAPES.items():
                compiled(xs[k], layer[name].data, layer[name].scale_inv)

    return {"bf16": bf16, "fp8 eager": eager, "fp8 compiled": comp}


def _graph_seconds(fn: Callable[[dict[int, torch.Tensor]], None], xs: dict[int, torch.Tensor], iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(xs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(xs)
    return cuda_seconds(graph.replay, iters)


def measure(tokens: list[int], iters: int) -> list[dict[str, Any]]:
    weights = _weights()
    fp8 = [{name: _rowwise(w) for name, w in layer.items()} for layer in weights]  # cast once, as a server would
    rows = []
    for m in tokens:
        torch._dynamo.reset()  # each batch size its own compiled casts (one function, many shapes: the 8-graph limit)
        paths = _paths(weights, fp8)
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in {k for k, _ in SHAPES.values()}}
        base = None
        for name, fn in paths.items():
            row: dict[str, Any] = {"tokens": m, "path": name}
            try:
                row["ms"] = _graph_seconds(fn, xs, iters) * 1e3
            except Exception as e:  # e.g. a GEMM shape this GPU's FP8 kernels do not take
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            base = row.get("ms") if name == "bf16" else base
            if base and row.get("ms"):
                row["vs_bf16"] = base / row["ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,16,64,256", help="batch sizes (tokens a decode step), comma-separated")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = measure([int(t) for t in args.tokens.split(",")], args.iters)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": LAYERS, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
