"""The bf16 matmul rate of one GPU, burst and sustained: 8192^3 products back to back for ``--seconds``, the rate of
each second reported. A short burst runs at the boost clock; under a sustained load an H200 sits at its power cap
(700 W) and lower SM clocks, which is what a training step's GEMMs see."""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.n
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * n**3
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    rates = []
    t_end = time.perf_counter() + args.seconds
    while time.perf_counter() < t_end:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        k = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            for _ in range(20):
                a @ b
            k += 20
            stop.record()
            stop.synchronize()
        rates.append(flops * k / (start.elapsed_time(stop) / 1e3) / 1e12)
    out = {"n": n, "tflops_per_second_window": [round(r, 1) for r in rates], "first": rates[0],
           "last_half_mean": sum(rates[len(rates) // 2 :]) / len(rates[len(rates) // 2 :])}  # fmt: skip
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
