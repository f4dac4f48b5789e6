"""The Mamba-2 mixer's causal depthwise convolution + SiLU, forward + backward, on one GPU (not a test): the PyTorch
path (``F.conv1d`` on the transposed view, ``F.silu``; ``mamba.conv_kernel=torch``) against the Triton kernels
(``mcore_models.ssm.conv_triton``; ``triton``), in the same process, on the in-projection's layout of
``mamba2-1.3b`` (channels ``d_inner + 2 * n_groups * d_state`` = 4352, a view of the ``[s, b, 8512]`` in-projection
output) in bf16. Reports ms and the effective memory bandwidth (the bytes of ``x`` and ``y`` forward, ``x``, ``dy``
and ``dx`` backward).

    python bench/mamba_conv_bench.py --seq 4096 --batch 8 --json /tmp/conv.json
    python bench/mamba_conv_bench.py --batch 2 --tune        # the kernels' tiles (conv_triton.TILES)

``--tune`` times the Triton path's forward + backward over each kernel's tile in turn (the forward's and ``dx``'s
positions, channels and warps over ``TUNE``; the backward's ``dpre`` also over its blocks of positions per program,
``TUNE_DPRE``), the others at the fastest found so far, and prints every row fastest first; a tile that does not
compile or run is reported with its error.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch
import torch.nn.functional as F
from _timing import cuda_seconds, sweep_tiles

from mcore_models.ssm import conv_triton
from mcore_models.ssm.conv_triton import causal_conv1d_silu_triton

TUNE = {"positions": (16, 32, 64), "channels": (64, 128, 256), "warps": (4, 8)}
"""The values swept for the forward's and ``dx``'s entries of ``conv_triton.TILES``."""
TUNE_DPRE = {"positions": (8, 16, 32), "channels": (64, 128), "warps": (4, 8), "blocks": (1, 4, 8, 16)}
"""The values swept for ``dpre``'s entry (48 tiles): positions per step, channels, warps, steps per program."""


def _torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    s = x.shape[1]
    h = F.conv1d(x.transpose(1, 2), w, b, padding=w.shape[-1] - 1, groups=w.shape[0])
    return F.silu(h[..., :s]).transpose(1, 2)


def case(impl: str, batch: int, seq: int, channels: int, width: int, k: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.randn(seq, batch, width, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(channels, 1, k, device="cuda", generator=gen) / k).to(torch.bfloat16).requires_grad_()
    b = torch.randn(channels, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(batch, seq, channels, device="cuda", dtype=torch.bfloat16, generator=gen)
    fn = causal_conv1d_silu_triton if impl == "triton" else _torch

    def step() -> None:
        x = proj[:, :, 4096 : 4096 + channels].transpose(0, 1)  # the mixer's xBC: a view of the in-projection
        fn(x, w, b).backward(dy)

    sec = cuda_seconds(step, 20)
    moved = 5 * batch * seq * channels * 2
    return {"impl": impl, "ms": sec * 1e3, "gb_s": moved / sec / 1e9}


def tune(batch: int, seq: int, channels: int, width: int, k: int, only: list[str] | None = None
         ) -> list[dict[str, Any]]:  # fmt: skip
    """Each kernel's tile in turn over :data:`TUNE` (``dpre``'s over :data:`TUNE_DPRE`), the others at the fastest so
    far: every row, fastest first (the tiles are left at the defaults); ``only``: those kernels' entries alone."""
    candidates = {kernel: list(itertools.product(*(TUNE_DPRE if kernel == "dpre" else TUNE).values()))
                  for kernel in only or conv_triton.TILES}  # fmt: skip
    return sweep_tiles(conv_triton.TILES, candidates, lambda: case("triton", batch, seq, channels, width, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--channels", type=int, default=4352)
    ap.add_argument("--width", type=int, default=8512, help="the in-projection's output width")
    ap.add_argument("--kernel", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tune", action="store_true", help="time the Triton kernels' tiles (see above)")
    ap.add_argument("--tune-only", nargs="+", choices=list(conv_triton.TILES), default=None,
                    help="with --tune: sweep these kernels' entries only")  # fmt: skip
    args = ap.parse_args()
    if args.tune:
        tuned = tune(args.batch, args.seq, args.channels, args.width, args.kernel, args.tune_only)
        for r in tuned:
            print(json.dumps(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                           "defaults": {"tiles": {n: list(t) for n, t in conv_triton.TILES.items()}},
                           "tune": tuned}, f, indent=1)  # fmt: skip
        return
    rows = [case(impl, args.batch, args.seq, args.channels, args.width, args.kernel) for impl in ("torch", "triton")]
    for r in rows:
        print(json.dumps(r), flush=True)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
