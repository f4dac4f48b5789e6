"""One FP8 linear against the bf16 one at llama-1b's shapes, forward + backward, one GPU (not a test).

For each of llama-1b's four linears (QKV 2048 -> 3072, output projection 2048 -> 2048, FC1 2048 -> 16384 with
SwiGLU's two halves, FC2 8192 -> 2048) and one micro-batch of ``--tokens`` tokens: milliseconds and TFLOP/s
(6 * tokens * in * out per forward + backward) of mcore's bf16 ``ColumnParallelLinear`` and of
``Fp8ColumnParallelLinear`` with each recipe, the FP8 weight cast kept for the step (``fp8_step`` around
``--micro`` micro-batches, as training runs it), and what the casts alone cost (the input's and the output
gradient's quantisation, by the Triton casts and by the ``torch.compile``-generated ones). Where the FP8 linear is slower than its GEMMs, the casts are why.

    python3 bench/fp8_linear_bench.py --out fp8_linear.json
    python3 bench/fp8_linear_bench.py --tune-casts   # the Triton cast's tile shapes, fastest first
    python3 bench/fp8_linear_bench.py --tune-swiglu  # the fused SwiGLU casts' tiles (forward and backward), fastest first
    python3 bench/fp8_linear_bench.py --mlp          # the whole MLP: bf16, FP8 (delayed), FP8 + fused SwiGLU casts
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from _timing import cuda_seconds

from mcore_parallel import Group
from mcore_parallel.fp8 import E4M3, E5M2, Fp8ColumnParallelLinear, Fp8Recipe, fp8_step, scaling
from mcore_parallel.fp8.scaling import current_scale, quantize_with_transpose
from mcore_parallel.tensor import ColumnParallelLinear

SHAPES = {"qkv": (2048, 3072), "proj": (2048, 2048), "fc1": (2048, 16384), "fc2": (8192, 2048)}
RECIPES = {"hybrid": Fp8Recipe("hybrid"), "hybrid-delayed": Fp8Recipe("hybrid", "delayed"),
           "e4m3-rowwise": Fp8Recipe("e4m3", "rowwise")}  # fmt: skip


def _step(layer: Any, x: torch.Tensor, g: torch.Tensor, micro: int) -> None:
    with fp8_step([layer]):
        for _ in range(micro):
            layer(x).backward(g)


def _cast_seconds(x: torch.Tensor, g: torch.Tensor, iters: int) -> float:
    """The input's (E4M3) and the output gradient's (E5M2) cast, each with its transpose, as the hybrid recipe does."""

    def casts() -> None:
        quantize_with_transpose(x, E4M3, current_scale(x, E4M3, False, 0, None))
        quantize_with_transpose(g, E5M2, current_scale(g, E5M2, False, 0, None))

    return cuda_seconds(casts, iters)


def measure(name: str, tokens: int, micro: int, iters: int) -> dict[str, Any]:
    k, n = SHAPES[name]
    kw: dict[str, Any] = dict(tp=Group.single(), bias=False, dtype=torch.bfloat16, device="cuda", seed=1)
    x = torch.randn(tokens, 1, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, 1, n, device="cuda", dtype=torch.bfloat16)
    flops = 6 * tokens * k * n
    bf16 = ColumnParallelLinear(k, n, **kw)
    row: dict[str, Any] = {"linear": name, "in": k, "out": n, "tokens": tokens}
    s = cuda_seconds(lambda: _step(bf16, x, g, micro), iters) / micro
    row["bf16_ms"], row["bf16_tflops"] = s * 1e3, flops / s / 1e12
    for label, recipe in RECIPES.items():
        layer = Fp8ColumnParallelLinear(k, n, recipe=recipe, **kw)
        s = cuda_seconds(lambda layer=layer: _step(layer, x, g, micro), iters) / micro
        row[f"{label}_ms"], row[f"{label}_tflops"] = s * 1e3, flops / s / 1e12
        row[f"{label}_vs_bf16"] = row["bf16_ms"] / row[f"{label}_ms"]
    row["casts_ms"] = _cast_seconds(x.detach().view(tokens, k), g.view(tokens, n), iters) * 1e3
    scaling.CAST_KERNELS = "torch"  # the same casts as torch.compile-generated kernels (without Triton)
    try:
        row["casts_torch_ms"] = _cast_seconds(x.detach().view(tokens, k), g.view(tokens, n), iters) * 1e3
    finally:
        scaling.CAST_KERNELS = "auto"
    return row


MLP_CASES = {"bf16": {}, "hybrid-delayed": {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_fused_swiglu": False},
             "hybrid-delayed-fused": {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_fused_swiglu": True}}  # fmt: skip
"""``--mlp``: llama-1b's MLP in bf16, with FP8 linears (delayed scaling), and with the SwiGLU casts fused."""


def measure_mlp(tokens: int, micro: int, iters: int) -> list[dict[str, Any]]:
    """llama-1b's whole MLP (fc1, SwiGLU, fc2) forward + backward under each of :data:`MLP_CASES`: ms per
    micro-batch, TFLOP/s (the two linears' 6 x tokens x in x out) and the ratio to bf16."""
    from mcore_models.backends import layer_spec
    from mcore_models.presets import preset
    from mcore_models.spec import default_spec
    from mcore_models.transformer.context import ModelContext

    base = preset("llama-1b", params_dtype="bfloat16", fp8_first_layers_bf16=0, fp8_last_layers_bf16=0)
    h, ffn = base.hidden_size, base.ffn_size
    flops = 6 * tokens * h * ffn * 3  # fc1 (gate and up) and fc2
    x = torch.randn(tokens, 1, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, 1, h, device="cuda", dtype=torch.bfloat16)
    rows = []
    for label, kw in MLP_CASES.items():
        config = base.replace(**kw)
        spec = layer_spec(default_spec(), config, 0)
        mlp = spec.mlp(config, ModelContext(Group.single("tp"), device="cuda"), spec, "mlp")
        s = cuda_seconds(lambda mlp=mlp: _step(mlp, x, g, micro), iters) / micro
        rows.append({"mlp": label, "tokens": tokens, "ms": s * 1e3, "tflops": flops / s / 1e12,
                     "fused_calls": mlp.fp8_fused_calls})  # fmt: skip
    for r in rows:
        r["vs_bf16"] = rows[0]["ms"] / r["ms"]
    return rows


CAST_TILES = [(64, 128, 8), (128, 128, 8), (128, 64, 4), (64, 64, 4), (128, 256, 8), (256, 128, 8), (64, 256, 8)]
"""(rows, columns, warps) per program of the Triton cast that ``--tune-casts`` times, each with the rounding in
float32 arithmetic and by the conversion instruction (``cast_triton.NATIVE_ROUNDING``)."""


def tune_casts(tokens: int, iters: int) -> list[dict[str, Any]]:
    """The Triton cast with its transpose (the E5M2 output gradient of FC1, ``[tokens, 16384]``, and the E4M3 input,
    ``[tokens, 2048]``) for each tile of :data:`CAST_TILES`: ms and GB/s (bf16 read, two FP8 writes), fastest
    first."""
    from mcore_parallel.fp8 import cast_triton

    default = (cast_triton._BM, cast_triton._BN, cast_triton._WARPS, cast_triton.NATIVE_ROUNDING)
    rows = []
    for name, cols, fmt in (("fc1 output gradient", 16384, E5M2), ("fc1 input", 2048, E4M3)):
        t = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16)
        scale = current_scale(t, fmt, False, 0, None)
        for (bm, bn, warps), native in itertools.product(CAST_TILES, (False, True)):
            cast_triton._BM, cast_triton._BN, cast_triton._WARPS, cast_triton.NATIVE_ROUNDING = bm, bn, warps, native
            s = cuda_seconds(lambda t=t, scale=scale, fmt=fmt: quantize_with_transpose(t, fmt, scale), iters)
            rows.append({"tensor": name, "rows": bm, "cols": bn, "warps": warps, "native_rounding": native,
                         "ms": s * 1e3, "gb_s": t.numel() * 4 / s / 1e9})  # fmt: skip
    cast_triton._BM, cast_triton._BN, cast_triton._WARPS, cast_triton.NATIVE_ROUNDING = default
    return sorted(rows, key=lambda r: (r["tensor"], r["ms"]))


def tune_swiglu(tokens: int, iters: int) -> list[dict[str, Any]]:
    """The fused SwiGLU casts of llama-1b's MLP (``h`` ``[tokens, 2 x 8192]`` bf16): the forward's activation with
    its transpose (E4M3) and the backward's input gradient with its transpose (E5M2), at each tile of
    ``fp8_swiglu.TILES``: ms and GB/s (bytes read and written), fastest first."""
    from mcore_models.transformer import fp8_swiglu

    default = (fp8_swiglu.FWD_TILE, fp8_swiglu.BWD_TILE)
    ffn = 8192
    h = torch.randn(tokens, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16) * 1e-2
    amax = torch.zeros(1, device="cuda")
    scale = torch.tensor(30.0, device="cuda")
    casts = {  # name -> (call, bytes moved: bf16 reads, two FP8 writes)
        "forward (activation)": (lambda: fp8_swiglu.swiglu_quantize(h, scale, E4M3, amax), tokens * ffn * (4 + 2)),
        "backward (input gradient)": (lambda: fp8_swiglu.swiglu_backward_quantize(h, g, scale, E5M2, amax),
                                      tokens * ffn * (4 + 2 + 4)),
    }  # fmt: skip
    rows = []
    for (name, (call, moved)), tile in itertools.product(casts.items(), fp8_swiglu.TILES):
        fp8_swiglu.FWD_TILE = fp8_swiglu.BWD_TILE = tile
        s = cuda_seconds(call, iters)
        rows.append({"cast": name, "rows": tile[0], "cols": tile[1], "warps": tile[2], "ms": s * 1e3,
                     "gb_s": moved / s / 1e9, "default": tile == (default[0] if "forward" in name else default[1])})  # fmt: skip
    fp8_swiglu.FWD_TILE, fp8_swiglu.BWD_TILE = default
    return sorted(rows, key=lambda r: (r["cast"], r["ms"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8 * 4096, help="tokens per micro-batch (llama-1b/best: 8 x 4096)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step (one weight cast per step)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tune-casts", action="store_true", help="time the Triton cast's tiles instead (CAST_TILES)")
    ap.add_argument("--tune-swiglu", action="store_true", help="time the fused SwiGLU casts' tiles instead")
    ap.add_argument("--mlp", action="store_true", help="time llama-1b's whole MLP instead (MLP_CASES)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (compute capability 8.9 or newer)")
    if args.mlp:
        mlp_rows = measure_mlp(args.tokens, args.micro, args.iters)
        for r in mlp_rows:
            print(json.dumps(r), flush=True)
        if args.out:
            Path(args.out).write_text(
                json.dumps({"tokens": args.tokens, "micro": args.micro, "mlp": mlp_rows}, indent=1)
            )
        return
    if args.tune_casts or args.tune_swiglu:
        key = "tune_casts" if args.tune_casts else "tune_swiglu"
        tuned = (tune_casts if args.tune_casts else tune_swiglu)(args.tokens, max(args.iters, 10))
        for r in tuned:
            print(json.dumps(r), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"tokens": args.tokens, key: tuned}, indent=1))
        return
    rows = [measure(name, args.tokens, args.micro, args.iters) for name in SHAPES]
    heads = ["bf16", *RECIPES]
    print(
        "| linear | in -> out | " + " | ".join(f"{h} ms (TFLOP/s)" for h in heads) + " | casts ms | compiled casts ms |"
    )
    print("|---|---|" + "---|" * (len(heads) + 2))
    for r in rows:
        cells = [f"{r[f'{h}_ms']:.2f} ({r[f'{h}_tflops']:.0f})" for h in heads]
        print(
            f"| {r['linear']} | {r['in']} -> {r['out']} | "
            + " | ".join(cells)
            + f" | {r['casts_ms']:.2f} | {r['casts_torch_ms']:.2f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"tokens": args.tokens, "micro": args.micro, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
