"""The Mamba-2 mixer's gated RMSNorm, forward + backward, on one GPU (not a test): the PyTorch path compiled by
inductor (``mamba.norm_kernel=torch`` under ``training.compile``) against the Triton kernels
(``mcore_models.ssm.norm_triton``; ``triton``), in the same process, on ``mamba2-1.3b``'s layout in bf16: ``y`` the
scan's ``[b, s, 4096]`` output transposed, ``z`` a view of the ``[s, b, 8512]`` in-projection output, whose gradient
is assembled from ``dz`` and the rest of the in-projection's gradient (the compiled PyTorch path writes ``dz`` into
it directly; the kernel's ``dz`` is copied in). Reports ms and the effective memory bandwidth (``y``, ``z`` and the
output forward; ``dout``, ``y``, ``z``, ``dy`` and ``dz`` backward).

    python bench/mamba_norm_bench.py --seq 4096 --batch 4 --json /tmp/norm.json
    python bench/mamba_norm_bench.py --tune        # the kernels' constants (norm_triton.TILES)
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch
from _timing import cuda_seconds, sweep_tiles

from mcore_models import ModelContext
from mcore_models.ssm import norm_triton
from mcore_models.ssm.mixer import GatedRMSNorm
from mcore_parallel import Group

TUNE = {"fwd": [(w,) for w in (4, 8, 16)], "bwd": list(itertools.product((4, 8, 16, 32, 64), (4, 8, 16)))}
"""The values swept for each kernel's entry of ``norm_triton.TILES``."""


def case(impl: str, batch: int, seq: int, d: int, width: int, groups: int, compiled: bool = True) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    norm = GatedRMSNorm(ModelContext(Group.single("tp"), device="cuda"), d, d // groups, 1e-5, False, "norm",
                        torch.bfloat16, impl)  # fmt: skip
    proj = torch.randn(seq, batch, width, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    yt = torch.randn(batch, seq, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dout = torch.randn(seq, batch, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    drest = torch.randn(seq, batch, width - d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def fwd(proj: torch.Tensor, yt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return norm(yt.transpose(0, 1), proj[..., :d]), proj[..., d:] * 1

    if compiled:
        fwd = torch.compile(fwd, fullgraph=True)

    def step() -> None:
        torch.autograd.backward(fwd(proj, yt), (dout, drest))

    sec = cuda_seconds(step, 20)
    moved = 8 * batch * seq * d * 2
    return {"impl": impl, "ms": sec * 1e3, "gb_s": moved / sec / 1e9}


def tune(batch: int, seq: int, d: int, width: int, groups: int) -> list[dict[str, Any]]:
    """Each kernel's entry in turn over :data:`TUNE`, the other at the fastest so far: every row, fastest first (the
    kernels run eagerly, without compiling the surrounding ops: the same kernels, no recompiles per constant)."""
    return sweep_tiles(norm_triton.TILES, TUNE, lambda: case("triton", batch, seq, d, width, groups, compiled=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d", type=int, default=4096, help="the mixer's inner width (d_inner / tp)")
    ap.add_argument("--width", type=int, default=8512, help="the in-projection's output width")
    ap.add_argument("--groups", type=int, default=1, help="the norm's groups (mamba.n_groups / tp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tune", action="store_true", help="time the Triton kernels' constants (see above)")
    args = ap.parse_args()
    shape = (args.batch, args.seq, args.d, args.width, args.groups)
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    if args.tune:
        out["defaults"] = {"tiles": {n: list(t) for n, t in norm_triton.TILES.items()}}
        out["tune"] = tune(*shape)
        rows = out["tune"]
    else:
        rows = out["rows"] = [case(impl, *shape) for impl in ("torch", "triton")]
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
