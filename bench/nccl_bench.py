"""Collective bandwidth between the GPUs of one host (not a test): all-gather, reduce-scatter and all-reduce of bf16
tensors through torch.distributed with NCCL, alone and while a large GEMM runs on the same GPUs on another stream.

Run under torchrun, one process per GPU:

    torchrun --standalone --nproc-per-node=2 bench/nccl_bench.py --sizes-mb 8 32 64 128

Reports per collective and size: time, algorithm bandwidth (bytes of one rank's output / time) and bus bandwidth
(NCCL's convention: times (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce), then the same
collective while ``--gemm`` (an 8192-square bf16 matmul loop) keeps the SMs busy.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from _timing import cuda_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    for mb in args.sizes_mb:
        elems = int(mb * 2**20 / 2)  # bf16 elements in one rank's output chunk
        x = torch.randn(elems, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(elems * n, device="cuda", dtype=torch.bfloat16)
        big = torch.randn(elems * n, device="cuda", dtype=torch.bfloat16)
        ops = {
            "all_gather": (lambda g=gathered, x=x: dist.all_gather_into_tensor(g, x), (n - 1) / n, elems * n * 2),
            "reduce_scatter": (lambda x=x, big=big: dist.reduce_scatter_tensor(x, big), (n - 1) / n, elems * n * 2),
            "all_reduce": (lambda x=x: dist.all_reduce(x), 2 * (n - 1) / n, elems * 2),
        }
        for name, (fn, factor, nbytes) in ops.items():
            alone = cuda_seconds(fn, args.iters, before=dist.barrier)

            def with_gemm(fn=fn) -> None:  # type: ignore[no-untyped-def]
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(4):
                        a @ a
                fn()
                torch.cuda.current_stream().wait_stream(side)

            busy = cuda_seconds(with_gemm, max(3, args.iters // 4), before=dist.barrier)
            gemm_only = cuda_seconds(lambda: [a @ a for _ in range(4)], max(3, args.iters // 4), before=dist.barrier)
            row = {
                "op": name,
                "mb_per_rank": mb,
                "ms": alone * 1e3,
                "algbw_gb_s": nbytes / alone / 1e9,
                "busbw_gb_s": nbytes / alone / 1e9 * factor,
                "with_gemm_ms": busy * 1e3,
                "gemm_alone_ms": gemm_only * 1e3,
            }
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        print("| op | MB per rank | ms | algbw GB/s | busbw GB/s | 4 GEMMs alone ms | both, overlapped ms |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['op']} | {r['mb_per_rank']:g} | {r['ms']:.3f} | {r['algbw_gb_s']:.0f} | {r['busbw_gb_s']:.0f} | "
                  f"{r['gemm_alone_ms']:.2f} | {r['with_gemm_ms']:.2f} |")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": n, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
