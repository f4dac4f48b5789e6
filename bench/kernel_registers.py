"""Registers, spills and occupancy of mcore's Triton kernels compiled for Hopper, on any machine: no GPU needed (not a
test).

Triton compiles each kernel for ``sm_90a`` (the H100/H200) and the ``ptxas`` that comes with Triton reports what each
thread of a program uses: registers (255 at most) and bytes spilled to local memory, whose loads and stores are slow
global-memory traffic inside the loops; with the shared memory a program takes, they give how many programs an SM
holds at once (228 KB of shared memory and 64 K registers an SM). The kernels:

- the SSD scan's chunk kernels (``mcore_models.ssm._ssd_kernels``, ``_ssd_group_kernels``) at ``mamba2-1.3b``'s
  head shapes (P 64, N 128, chunk 256), over positions per block x warps, with the products on float32 operands
  (TF32) and on bf16 ones (``ssd_triton.LOW_PRECISION_DOTS``), the bf16 ones also over pipeline stages
  (``num_stages``: how deep the loops' loads are buffered in shared memory);
- the Mamba mixer's causal conv (``mcore_models.ssm.conv_triton``: the forward, the backward's ``dpre`` and its
  anticausal ``dx``), positions x channels per program;
- the FP8 cast with its transpose (``mcore_parallel.fp8.cast_triton``, its rounding in float32 arithmetic or by the
  conversion instruction, ``NATIVE_ROUNDING``) with its SASS instructions per element, and the FP8 MLP's SwiGLU
  kernels that cast their own outputs (``mcore_models.transformer.fp8_swiglu``);
- the decode MLP kernel (``mcore_infer.kernels.fused_mlp``, tile = intermediate features x inputs per step), the
  QKV GEMV with the norm inside (``mcore_infer.kernels.norm_gemv``, tile = output features x inputs per step) and a
  Mamba layer's out-projection GEMV with the gated norm inside (``mcore_infer.kernels.gated_norm_gemv``, at
  ``mamba2-1.3b``'s shape) at one and four rows;
- the paged-attention kernel of a decode step (``mcore_infer._triton_attention``) at ``llama-1b``'s heads (4 query
  heads a KV group, head dim 64, cache blocks of 32) under launches of ``mcore_infer.AttentionLaunch`` (tile = cache
  blocks a loop step x split cap; RoPE, the KV write, the folded combine, the first tile before the wait; one launch
  also with the two rows of programs that prefetch weights into L2, ``mcore_infer.kernels.l2_prefetch``).

A static view to choose what ``bench/ssd_bench.py --tune`` and ``fp8_linear_bench.py --tune-casts`` (``--tune-swiglu``)
then time::

    python bench/kernel_registers.py            # every kernel, every tile
    python bench/kernel_registers.py --json /tmp/regs.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import tempfile
import warnings
from typing import Any

SSD = {"chunk_state": ("chunk_state", "BK", (32, 64, 128), {"FROM_END": True}),
       "chunk_out": ("chunk_out", "BM", (32, 64, 128), {"HAS_D": True}),
       "bwd_cols": ("bwd_cols", "BM", (16, 32, 64), {"HAS_D": True, "PER_HEAD_DB": True}),
       "bwd_rows": ("bwd_rows", "BM", (16, 32, 64), {}),
       "bwd_cols (groups)": ("bwd_cols", "BM", (16, 32, 64), {"HAS_D": True, "PER_HEAD_DB": False}),
       "bwd_dcb": ("bwd_dcb", "BM", (32, 64, 128), {}),
       "bwd_dbdc dC": ("bwd_dbdc", "BM", (32, 64, 128), {"FOR_B": False}),
       "bwd_dbdc dB": ("bwd_dbdc", "BM", (32, 64, 128), {"FOR_B": True})}  # fmt: skip
"""The SSD scan's kernels by label: the kernel, its block constant, the block sizes and its other constants (the
``bwd_dcb`` and ``bwd_dbdc`` of ``ssd_triton.BACKWARD = "groups"`` with ``bwd_cols`` as that backward runs it)."""
STAGES = (1, 2, 3)  # num_stages of the chunk kernels' software pipeline (Triton's default on Hopper: 3)
SHAPE = {"H": 64, "G": 1, "P": 64, "N": 128, "L": 256, "BP": 64, "BN": 128, "PREC": "tf32"}
POINTERS_16 = {"X", "Bm", "Cm", "DY", "Y", "DX", "W", "BIAS", "OUT"}  # bf16 tensors; the others float32
SCALARS = {"C"}  # capitalised integer arguments (every other capitalised argument is a pointer)
FLOATS = {"fmax", "lo", "hi"}  # float arguments (every other lower-case one is an integer)


def _signature(fn: Any, consts: dict[str, Any], types: dict[str, str] | None = None) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif types and name in types:
            sig[name] = types[name]
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name[0].isupper() and name not in SCALARS:
            sig[name] = "*bf16" if name in POINTERS_16 else "*fp32"
        else:
            sig[name] = "i32"
    return sig


SM_SHARED, SM_REGISTERS, SM_THREADS, SM_PROGRAMS = 228 * 1024, 64 * 1024, 2048, 32  # an SM of Hopper holds at most


def usage(
    fn: Any, consts: dict[str, Any], warps: int, types: dict[str, str] | None = None, stages: int = 3
) -> dict[str, Any]:
    """Registers and spilled bytes per thread, shared memory, SASS instructions and the programs an SM holds at once
    (the least its shared memory, registers, threads and program slots allow) of ``fn`` compiled for sm_90a with
    ``consts``, ``warps`` and ``stages`` (``num_stages``; ``types``: argument types other than the defaults), or an
    error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = _signature(fn, consts, types)
    # as a launch specialises them: pointers 16-byte aligned, integers (sizes, strides) multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t != "constexpr" and t != "fp32"}
    try:
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                             target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    except Exception as e:  # a tile this kernel cannot take
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(p for p in (os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas")) if os.path.exists(p))
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(out.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)  # fmt: skip
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stdout  # fmt: skip
    text = r.stdout + r.stderr
    regs, spill = re.search(r"Used (\d+) registers", text), re.search(r"(\d+) bytes spill stores", text)
    if r.returncode or regs is None:
        return {"error": text[-300:]}
    registers, shared = int(regs.group(1)), out.metadata.shared
    resident = min(SM_SHARED // max(shared, 1), SM_REGISTERS // (registers * warps * 32), SM_THREADS // (warps * 32),
                   SM_PROGRAMS)  # fmt: skip
    return {"registers": registers, "spill_bytes": int(spill.group(1)) if spill else 0, "shared_bytes": shared,
            "programs_per_sm": resident, "instructions": len(re.findall(r"/\*[0-9a-f]{4}\*/\s", sass))}  # fmt: skip


def _ssm_rows() -> list[dict[str, Any]]:
    """The SSD scan's chunk kernels over positions x warps and product precisions; the causal conv."""
    import triton.language as tl

    from mcore_models.ssm import _ssd_group_kernels, _ssd_kernels
    from mcore_models.ssm.conv_triton import _kernels as conv_kernels

    ssd = {**_ssd_kernels.kernels(), **_ssd_group_kernels.kernels()}
    rows = []
    for (label, (name, key, sizes, extra)), dot in itertools.product(SSD.items(), ("tf32", "bf16")):
        dt = tl.float32 if dot == "tf32" else tl.bfloat16
        for size, warps, stages in itertools.product(sizes, (4, 8), STAGES if dot == "bf16" else (3,)):
            consts = {**SHAPE, key: size, "NB": -(-SHAPE["L"] // size), **extra, "DOT": dt, "DOT2": dt}
            types = {p: "*bf16" for p in ("R", "Q", "E", "OUT")} if name == "bwd_dbdc" else None
            rows.append({"kernel": label, "products": dot, "positions": size, "warps": warps, "stages": stages,
                         **usage(ssd[name], consts, warps, types, stages=stages)})  # fmt: skip
    conv = conv_kernels()
    for name, (bs, bc), warps in itertools.product(
        ("conv", "conv_dx", "dpre"), ((8, 64), (16, 128), (16, 256), (32, 128), (64, 128), (32, 64)), (4, 8)
    ):
        consts = {"K": 4, "HAS_BIAS": name != "conv_dx", "ANTICAUSAL": name == "conv_dx", "BS": bs, "BC": bc}
        if name == "dpre":  # position blocks per program: no effect on registers
            consts = {"K": 4, "HAS_BIAS": True, "BS": bs, "BC": bc, "BLOCKS": 8}
        rows.append({"kernel": f"causal_{name}", "products": "-", "positions": bs, "channels": bc, "warps": warps,
                     **usage(conv["dpre" if name == "dpre" else "conv"], consts, warps)})  # fmt: skip
    return rows


def _fp8_rows() -> list[dict[str, Any]]:
    """The FP8 cast with its transpose, and the FP8 MLP's SwiGLU kernels that cast their own outputs."""
    from mcore_models.transformer import fp8_swiglu
    from mcore_models.transformer.fp8_swiglu import _kernels as swiglu_kernels
    from mcore_parallel.fp8.cast_triton import _kernels as fp8_kernels

    rows = []
    cast = fp8_kernels()["cast"]
    for native, (bm, bn), warps in itertools.product((False, True), ((64, 128), (128, 128)), (4, 8)):
        consts = {"AMAX_OUT": False, "EMIN": 127 - 14, "MBITS": 2, "ROWWISE": False, "TRANSPOSE": True, "BM": bm,
                  "BN": bn, "NATIVE": native}  # fmt: skip
        r = usage(cast, consts, warps, {"T": "*bf16", "Q": "*fp8e5", "QT": "*fp8e5"})
        per = bm * bn / (warps * 32)  # elements per thread
        rows.append({"kernel": "fp8_cast" + ("_native" if native else ""), "products": "-", "positions": bm,
                     "channels": bn, "warps": warps, **r, "per_element": round(r.get("instructions", 0) / per, 1)})  # fmt: skip
    fused = swiglu_kernels()
    for name, native, (bm, bn, warps) in itertools.product(
        ("swiglu_cast", "swiglu_bwd_cast"), (False, True), fp8_swiglu.TILES
    ):  # (the tiles `fp8_linear_bench.py --tune-swiglu` times)
        consts = {"EMIN": 127 - 6, "MBITS": 3, "NATIVE": native, "BM": bm, "BN": bn}
        fp8 = "*fp8e4nv"
        if name == "swiglu_cast":
            consts["TRANSPOSE"] = True
        else:
            consts.update(EMIN=127 - 14, MBITS=2)
            fp8 = "*fp8e5"
        r = usage(fused[name], consts, warps, {"H": "*bf16", "G": "*bf16", "Q": fp8, "QT": fp8})
        per = bm * bn / (warps * 32)  # SwiGLU outputs (forward) or gate/up pairs (backward) per thread
        rows.append({"kernel": "fp8_" + name + ("_native" if native else ""), "products": "-", "positions": bm,
                     "channels": bn, "warps": warps, **r, "per_element": round(r.get("instructions", 0) / per, 1)})  # fmt: skip
    return rows


def _decode_rows() -> list[dict[str, Any]]:
    """The decode MLP kernel, the QKV GEMV with the norm inside and the Mamba out-projection's GEMV with the gated
    norm inside, at one and four rows."""
    from mcore_infer.kernels.fused_mlp import MlpLaunch, heuristic_mlp_launch
    from mcore_infer.kernels.fused_mlp import _kernels as mlp_kernels
    from mcore_infer.kernels.gated_norm_gemv import _kernel as gated_norm_gemv_kernel
    from mcore_infer.kernels.norm_gemv import _kernel as norm_gemv_kernel

    rows = []
    mlp, _ = mlp_kernels()
    ints = {"M": "i32", "H": "i32", "FF": "i32"}
    launches = (heuristic_mlp_launch(1), MlpLaunch(32, 128, 64, 4), MlpLaunch(64, 64, 64, 8), MlpLaunch(128, 64, 64, 8))
    for launch, rows_, norm in itertools.product(launches, (1, 4), (False, True)):
        bk = heuristic_mlp_launch(rows_).block_k if launch == heuristic_mlp_launch(1) else launch.block_k
        # llama-1b: hidden 2048; with the norm, X is the output projection's float32 partial sum (one split)
        consts = {"M_PAD": rows_, "BLOCK_F": launch.block_f, "BLOCK_K": bk, "BLOCK_H": launch.block_h, "GDC": True,
                  "NORM": norm, "PARTS": norm, "SPLITS": 1, "H_PAD": 2048 if norm else 16}  # fmt: skip
        types = {"X": "*fp32" if norm else "*bf16", "R": "*bf16", "NW": "*bf16", "HOUT": "*bf16", "W1": "*bf16",
                 "W2": "*bf16", "Y": "*fp32", "eps": "fp32", **ints}  # fmt: skip
        r = usage(mlp, consts, launch.warps, types)
        rows.append({"kernel": f"fused_mlp{' + norm' if norm else ''} ({rows_} rows)", "products": "-",
                     "positions": launch.block_f, "channels": bk, "warps": launch.warps, **r})  # fmt: skip
    for rows_, (block_n, block_k, warps), whole in itertools.product(
        (1, 4), ((8, 1024, 4), (8, 256, 4), (16, 512, 4), (8, 512, 2)), (True, False)
    ):
        # whole: the row normalised once when it is one or two K steps (the kernel's WHOLE), else the K loop
        tiles = 2048 // block_k if whole and block_k * 2 >= 2048 else 0
        if whole and not tiles:
            continue
        consts = {"SPLITS": 1, "PARTS": True, "M_PAD": rows_, "K_PAD": 2048, "BLOCK_N": block_n, "BLOCK_K": block_k,
                  "GDC": True, "WHOLE": tiles}  # fmt: skip
        types = {"X": "*fp32", "R": "*bf16", "NW": "*bf16", "HOUT": "*bf16", "W": "*bf16", "Y": "*bf16",
                 "eps": "fp32", "M": "i32", "N": "i32", "K": "i32"}  # fmt: skip
        r = usage(norm_gemv_kernel(), consts, warps, types)
        name = f"norm_row_linear ({rows_} rows{', whole row' if tiles else ''})"
        rows.append({"kernel": name, "products": "-", "positions": block_n, "channels": block_k, "warps": warps,
                     **r})  # fmt: skip
    for rows_, (block_n, block_k, warps) in itertools.product(
        (1, 4), ((8, 1024, 4), (8, 256, 4), (8, 512, 4), (16, 512, 4))
    ):
        # mamba2-1.3b's out-projection: d_inner 4096 in one group, hidden 2048; z a view of the in-projection's output
        consts = {"G_PAD": 1, "M_PAD": rows_, "BLOCK_N": block_n, "BLOCK_K": block_k, "BEFORE": False, "GDC": True}
        types = {"Y": "*bf16", "Z": "*bf16", "NW": "*bf16", "W": "*bf16", "P": "*fp32", "eps": "fp32",
                 **dict.fromkeys(("M", "N", "K", "GS", "K_PER"), "i32")}  # fmt: skip
        r = usage(gated_norm_gemv_kernel(), consts, warps, types)
        rows.append({"kernel": f"gated_norm_partials ({rows_} rows)", "products": "-", "positions": block_n,
                     "channels": block_k, "warps": warps, **r})  # fmt: skip
    return rows


ATTENTION_LAUNCHES = ((1, 16, 0, 4, 1), (1, 16, 1, 4, 1), (2, 16, 1, 4, 1), (4, 16, 1, 4, 1), (4, 64, 1, 4, 1),
                      (8, 64, 1, 4, 1), (8, 64, 1, 8, 1), (8, 1, 0, 4, 1), (8, 1, 0, 8, 1), (4, 16, 1, 4, 4),
                      (8, 16, 1, 8, 8))  # fmt: skip
"""(blocks a loop step, split cap, skip empty splits, warps, fewest blocks a split): the launches the
``serve-attention`` suite times."""


def _attention_rows() -> list[dict[str, Any]]:
    """The paged-attention kernel of a decode step under each launch of :data:`ATTENTION_LAUNCHES`."""
    from mcore_infer._triton_attention import _kernel

    attend = _kernel()[0]
    types = {**dict.fromkeys(("Q", "K", "V", "Out", "COS", "SIN", "KIN", "VIN"), "*bf16"),
             **dict.fromkeys(("PM", "PL", "PACC"), "*fp32"), **dict.fromkeys(("BT", "TSEQ", "TCTX", "SLOTS"), "*i64"),
             **{n: "i32" for n in attend.arg_names if n.startswith("stride")}, "CNT": "*i32", "scale": "fp32",
             "PF": "*bf16", "pf_bytes": "i32", "PF2": "*bf16", "pf2_bytes": "i32"}  # fmt: skip
    rows = []
    for (step, splits, skip, warps, min_blocks), pf in [*((a, 0) for a in ATTENTION_LAUNCHES),
                                                        ((8, 16, 1, 8, 8), 2)]:  # fmt: skip
        consts = {"HEADS": 32, "HPG": 4, "HPG_PAD": 16, "D": 64, "BLOCK": 32, "SPLITS": splits, "IEEE": False,
                  "ROT": 64, "NEW_KV": True, "GDC": True, "FOLD": splits > 1, "PRE": True, "STEP": step,
                  "SKIP": bool(skip) and splits > 1, "MIN_PER": min_blocks, "PF_ROWS": pf, "PF_ASM": pf > 0}  # fmt: skip
        name = (
            f"paged attention, decode{', skip empty' if skip else ''}{f', min {min_blocks}' if min_blocks > 1 else ''}"
            f"{', two L2 prefetch rows' if pf else ''}"
        )
        rows.append({"kernel": name, "products": "-",
                     "positions": step, "channels": splits, "warps": warps, **usage(attend, consts, warps, types)})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rows = [*_ssm_rows(), *_fp8_rows(), *_decode_rows(), *_attention_rows()]
    print("| kernel | products | tile | warps | stages | registers | spill bytes | shared bytes | programs per SM | "
          "instructions per element |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        where = f"{r['positions']}" + (f" x {r['channels']}" if "channels" in r else "")
        cells = [
            r.get("registers", r.get("error", "")),
            r.get("spill_bytes", ""),
            r.get("shared_bytes", ""),
            r.get("programs_per_sm", ""),
            r.get("per_element", ""),
        ]
        print(f"| {r['kernel']} | {r['products']} | {where} | {r['warps']} | {r.get('stages', 3)} | "
              + " | ".join(map(str, cells)) + " |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": "sm_90a", "shape": SHAPE, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
