"""The Mamba-2 SSD scan against causal attention at the same width, forward + backward, on one GPU (not a test).

For each sequence length (tokens per batch held at ``--tokens``): ``ssd_scan`` (``--impl``: triton, the GPU default,
or torch) on ``x [b, s, H, P]``, ``dt [b, s, H]``, ``B, C [b, s, G, N]`` for a ``d_model`` of 2048 (expand 2: H = 64
heads of P = 64, N = 128, one group, chunk 256), beside ``F.scaled_dot_product_attention`` (causal, cuDNN) with the
attention of the same width (32 heads of 64, GQA 8 groups) in the same process. The scan's matmul FLOPs are
counted as the SSD algorithm performs them per chunk (C·Bᵀ, its product with x, the chunk states, the state
outputs: ``2 · b · s · H · (L · (N + P) + 2 · N · P)`` forward, 2x that backward), attention's as usual with the
causal half.

    python bench/ssd_bench.py --seq 4096 16384 65536 --json /tmp/ssd.json
    python bench/ssd_bench.py --seq 4096 --dots tf32 16bit   # the Triton kernels' product operands, A/B
    python bench/ssd_bench.py --seq 4096 16384 --chunk 64 128 256   # the chunk length, A/B/C

``--chunk``: the chunk lengths to time the scan at (``MambaConfig.chunk_size``; the same function for any chunk, up
to rounding), one row per sequence and chunk; attention is timed once per sequence, in its first row.

``--backward``: how the backward takes the gradients of ``B`` and ``C`` (``mcore_models.ssm.ssd_triton.BACKWARD``:
``heads``, each head's own products, or ``groups``, through one matrix per group and chunk summed over its heads),
each timed in turn in the same process; the default's entry is ``scan_16bit``, another's gets its name appended
(``scan_16bit_heads``). With ``--tune``, the first one's kernels are tuned (``groups`` adds its own tiles)::

    python bench/ssd_bench.py --seq 4096 16384 --backward groups heads

``--dots``: ``16bit`` (bf16 operands, ``mcore_models.ssm.ssd_triton.LOW_PRECISION_DOTS``, the default) and/or
``tf32`` (float32 operands, TF32 products), each measured in turn in the same process (``scan_16bit``, ``scan``).
``--tune`` times the Triton kernels' tile constants instead (positions per block forward and backward, warps,
pipeline stages) for each ``--dots`` choice at the first ``--seq`` and ``--chunk`` and prints them fastest first::

    python bench/ssd_bench.py --seq 4096 --dots tf32 16bit --tune --json /tmp/ssd-tune.json
    python bench/ssd_bench.py --seq 4096 --chunk 128 --tune
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F
from _timing import cuda_seconds

from mcore_models.ssm import ssd_scan, ssd_triton


def scan_case(b: int, s: int, impl: str, chunk: int = 256) -> dict[str, Any]:
    h, p, n, g = 64, 64, 128, 1
    dev, dt_ = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt_).requires_grad_()

    x, dt, bb, cc = t(b, s, h, p), t(b, s, h, scale=0.5), t(b, s, g, n), t(b, s, g, n)
    a = -torch.rand(h, device=dev, generator=gen).add(0.5)
    dt_bias = torch.zeros(h, device=dev, requires_grad=True)
    dy = torch.randn(b, s, h, p, device=dev, dtype=dt_, generator=gen)

    def step() -> None:
        y = ssd_scan(x, dt, a, bb, cc, chunk_size=chunk, D=None, dt_bias=dt_bias, impl=impl)
        y.backward(dy)

    sec = cuda_seconds(step, 10)
    flops = 3 * 2 * b * s * h * (chunk * (n + p) + 2 * n * p)
    return {"ms": sec * 1e3, "tflops": flops / sec / 1e12}


def attention_case(b: int, s: int) -> dict[str, Any]:
    heads, groups, d = 32, 8, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(b, groups, s, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(b, groups, s, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    do = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step() -> None:
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(do)

    sec = cuda_seconds(step, 10)
    flops = 3 * 4 * b * heads * s * s * d / 2
    return {"ms": sec * 1e3, "tflops": flops / sec / 1e12}


TUNE = (
    {"_ROWS": (32, 64, 128), "_WARPS": (4, 8)},
    {"_STAGES": (1, 2, 3)},
    {"_BWD_ROWS": (16, 32, 64), "_BWD_WARPS": (4, 8)},
    {"_BWD_STAGES": (1, 2, 3)},
)
TUNE_GROUPS = ({"_GRP_ROWS": (32, 64, 128), "_GRP_WARPS": (4, 8)},)
"""The tiles of the group kernels, swept after :data:`TUNE` when ``ssd_triton.BACKWARD`` is ``"groups"``."""
"""The forward's tile constants, then the backward's, in groups: each group swept with the others at their best so
far (the stages: Triton's ``num_stages``, the shared memory a program takes and so the programs an SM holds)."""
STATE_BLOCKS = (256, 512, 1024, 2048)
"""``ssd_triton._STATE_BLOCK`` (state elements per program of the pass over chunks), swept last."""


def _timed(row: dict[str, Any], b: int, seq: int, chunk: int) -> dict[str, Any]:
    """``row`` (the constants in force) with the scan's time, or with the error of a combination that does not
    compile or run (a tile too large for the GPU's shared memory, for one)."""
    try:
        row.update(scan_case(b, seq, "triton", chunk))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    torch.cuda.empty_cache()
    return row


def tune(seq: int, tokens: int, dots: list[str], chunk: int = 256) -> list[dict[str, Any]]:
    """For each product choice, every combination of each group of :data:`TUNE` in turn (the constants of
    ``ssd_triton.TILES[dots]`` outside the group at their fastest found so far, at first their defaults), then each
    of :data:`STATE_BLOCKS`: the scan's forward + backward ms; all rows, fastest first (a combination that does not
    compile or run is reported with its error)."""
    import itertools

    b = max(1, tokens // seq)
    low, block, rows = ssd_triton.LOW_PRECISION_DOTS, ssd_triton._STATE_BLOCK, []
    for d in dots:
        ssd_triton.LOW_PRECISION_DOTS = d == "16bit"
        tiles = ssd_triton.TILES[d]
        default = dict(tiles)
        for group in TUNE + (TUNE_GROUPS if ssd_triton.BACKWARD == "groups" else ()):
            timed = []
            for values in itertools.product(*group.values()):
                tiles.update(zip(group, values, strict=True))
                timed.append(_timed({"dots": d, "chunk": chunk, "backward": ssd_triton.BACKWARD, **tiles}, b, seq,
                                    chunk))  # fmt: skip
            best = min(timed, key=lambda r: r.get("ms", float("inf")))
            tiles.update({k: best[k] for k in group})
            rows.extend(timed)
        for bs in STATE_BLOCKS:  # the pass over chunks, with the chunk kernels at their fastest found
            ssd_triton._STATE_BLOCK = bs
            rows.append(_timed({"dots": d, "chunk": chunk, **tiles, "_STATE_BLOCK": bs}, b, seq, chunk))
        ssd_triton._STATE_BLOCK = block
        tiles.update(default)
    ssd_triton.LOW_PRECISION_DOTS = low
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--tokens", type=int, default=8 * 4096, help="batch x sequence, held constant")
    ap.add_argument("--impl", default="triton", choices=["triton", "torch"])
    ap.add_argument("--dots", nargs="+", default=["16bit"], choices=["tf32", "16bit"],
                    help="the Triton kernels' product operands: one row entry each (scan, scan_16bit)")  # fmt: skip
    ap.add_argument("--chunk", type=int, nargs="+", default=[256],
                    help="chunk lengths (MambaConfig.chunk_size): a row per sequence and chunk; --tune: the first")  # fmt: skip
    ap.add_argument("--backward", nargs="+", default=[ssd_triton.BACKWARD], choices=["heads", "groups"],
                    help="ssd_triton.BACKWARD: each timed in turn (--tune: the first)")  # fmt: skip
    ap.add_argument("--json", default=None)
    ap.add_argument("--tune", action="store_true", help="time the kernels' tile constants (see above)")
    args = ap.parse_args()
    default_backward = ssd_triton.BACKWARD
    if args.tune:
        ssd_triton.BACKWARD = args.backward[0]
        tuned = tune(args.seq[0], args.tokens, args.dots, args.chunk[0])
        for r in tuned:
            print(json.dumps(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                d = args.dots[0]  # the defaults of the first choice (their row is in the sweep)
                defaults = {"dots": d, "backward": ssd_triton.BACKWARD, **ssd_triton.TILES[d],
                            "_STATE_BLOCK": ssd_triton._STATE_BLOCK}  # fmt: skip
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "chunk": args.chunk[0],
                           "defaults": defaults, "tune": tuned}, f, indent=1)  # fmt: skip
        return
    rows = []
    names = [(("scan" if d == "tf32" else "scan_16bit") + ("" if bw == default_backward else f"_{bw}"), d, bw)
             for bw in args.backward for d in args.dots]  # fmt: skip
    for s in args.seq:
        b = max(1, args.tokens // s)
        for i, chunk in enumerate(args.chunk):
            row: dict[str, Any] = {"batch": b, "seq": s, "chunk": chunk}
            for name, dots, backward in names + [("attention", "", "")] * (i == 0):
                ssd_triton.LOW_PRECISION_DOTS, ssd_triton.BACKWARD = dots == "16bit", backward or default_backward
                try:
                    row[name] = attention_case(b, s) if name == "attention" else scan_case(b, s, args.impl, chunk)
                except torch.OutOfMemoryError:
                    row[name] = {"error": "out of memory"}
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "impl": args.impl, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
