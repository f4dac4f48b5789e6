"""The kernels of ``bench/swiglu_gemm_bench.py``: SwiGLU in the epilogues of the MLP's GEMMs, as Triton kernels.

Unfused, a SwiGLU MLP makes two elementwise passes around its GEMMs: forward, ``h = silu(gate) * up`` reads
``[gate; up]`` back after cuBLAS wrote it; backward, the down projection's input gradient ``dh`` is written, then read
again with ``[gate; up]`` to form ``[d_gate; d_up]`` (131 ms of a 3.4 s llama-1b step on an H200,
``docs/performance.md``). Here each pass is the epilogue of a persistent Triton GEMM over TMA descriptors:

* :func:`up_swiglu` computes ``x @ w_up.T`` as two accumulators per tile (the ``gate`` columns ``n`` and the ``up``
  columns ``ffn + n``) and stores ``[gate; up]`` (kept for backward) and ``h`` from registers;
* :func:`down_dgrad_swiglu` computes ``dh = dy @ w_down`` and, in the same tile, reads ``gate`` and ``up`` and stores
  ``[d_gate; d_up]``.

Both round the GEMM result to the activation dtype before the elementwise math, where the unfused path rounds, and
agreed with it on an H200 (largest difference 0.0). Measured there (``docs/performance.md``, kernels) the fused
forward is 16% slower than cuBLAS plus the separate kernel and the fused backward 2% faster: Triton's Hopper mainloop (no warp
specialization before Blackwell in Triton 3.6) runs at ~520 TFLOP/s where cuBLAS runs at ~680, which costs more than
the elementwise pass saves. So the training MLP does not use them; they stay here to reproduce that measurement.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["down_dgrad_swiglu", "up_swiglu", "up_swiglu_reference", "down_dgrad_swiglu_reference"]

# (BM, BN, BK, stages, warps) tried by the autotuner on CUDA; BN counts the columns of one half (gate or up), so a
# tile of the up projection covers 2 * BN output columns
_CONFIGS = (
    (128, 128, 64, 3, 8),
    (128, 128, 64, 4, 8),
    (128, 64, 64, 4, 4),
    (128, 64, 64, 5, 8),
    (64, 128, 64, 4, 4),
    (128, 256, 64, 3, 8),
)
_DTYPES = (torch.bfloat16, torch.float16)


def up_swiglu_reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([gate; up], silu(gate) * up)`` for ``[gate; up] = x @ w.T``, PyTorch ops (float32 activation math)."""
    gu = x @ w.t()
    gate, up = gu.float().chunk(2, dim=-1)
    return gu, (torch.nn.functional.silu(gate) * up).to(x.dtype)


def down_dgrad_swiglu_reference(dy: torch.Tensor, w_down: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """``[d_gate; d_up]`` of ``silu(gate) * up`` where ``dh = dy @ w_down`` (PyTorch ops)."""
    from mcore_models.transformer.swiglu import swiglu_backward_reference

    return swiglu_backward_reference(gu, dy @ w_down)


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    """(up, down) as plain JIT functions, then autotuned over :data:`_CONFIGS`."""
    import triton
    import triton.language as tl

    @triton.jit
    def up_swiglu_kernel(
        x_d,
        w_d,
        gu_d,
        h_d,
        M,
        FFN,
        K,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        GROUP_M: tl.constexpr,
        PROGRAMS: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        num_m = tl.cdiv(M, BM)
        num_n = FFN // BN
        for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True):
            # grouped order: GROUP_M row blocks walk the column blocks together, so their A tiles stay in L2
            first_m = (tile // (GROUP_M * num_n)) * GROUP_M
            rows = min(num_m - first_m, GROUP_M)
            pm = first_m + (tile % (GROUP_M * num_n)) % rows
            pn = (tile % (GROUP_M * num_n)) // rows
            om = pm * BM
            on = pn * BN
            acc_g = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
            for k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
                a = x_d.load([om, k * BK])
                acc_g = tl.dot(a, w_d.load([on, k * BK]).T, acc_g)
                acc_u = tl.dot(a, w_d.load([FFN + on, k * BK]).T, acc_u)
            gate = acc_g.to(gu_d.dtype)
            up = acc_u.to(gu_d.dtype)
            gu_d.store([om, on], gate)
            gu_d.store([om, FFN + on], up)
            g = gate.to(tl.float32)
            h_d.store([om, on], (g * tl.sigmoid(g) * up.to(tl.float32)).to(h_d.dtype))

    @triton.jit
    def down_dgrad_swiglu_kernel(
        dy_d,
        w_d,
        gu_d,
        dgu_d,
        M,
        FFN,
        K,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        GROUP_M: tl.constexpr,
        PROGRAMS: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        num_m = tl.cdiv(M, BM)
        num_n = FFN // BN
        for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True):
            # grouped order: GROUP_M row blocks walk the column blocks together, so their A tiles stay in L2
            first_m = (tile // (GROUP_M * num_n)) * GROUP_M
            rows = min(num_m - first_m, GROUP_M)
            pm = first_m + (tile % (GROUP_M * num_n)) % rows
            pn = (tile % (GROUP_M * num_n)) // rows
            om = pm * BM
            on = pn * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
                acc = tl.dot(dy_d.load([om, k * BK]), w_d.load([k * BK, on]), acc)
            dh = acc.to(dgu_d.dtype).to(tl.float32)  # rounded where cuBLAS's dh would be
            gate = gu_d.load([om, on]).to(tl.float32)
            up = gu_d.load([om, FFN + on]).to(tl.float32)
            sig = tl.sigmoid(gate)
            dgu_d.store([om, on], (dh * up * sig * (1.0 + gate * (1.0 - sig))).to(dgu_d.dtype))
            dgu_d.store([om, FFN + on], (dh * gate * sig).to(dgu_d.dtype))

    def _set_blocks(up: bool) -> Any:
        names = ("x_d", "w_d", "gu_d", "h_d") if up else ("dy_d", "w_d", "gu_d", "dgu_d")

        def hook(nargs: dict[str, Any]) -> None:
            for name, shape in zip(names, _block_shapes(0 if up else 1, nargs["BM"], nargs["BN"], nargs["BK"])):
                nargs[name].block_shape = shape

        return hook

    def configs(up: bool) -> list[Any]:
        return [
            triton.Config(dict(BM=bm, BN=bn, BK=bk, STAGES=s), num_warps=w, pre_hook=_set_blocks(up))
            for bm, bn, bk, s, w in _CONFIGS
            if not (up and bn == 256)  # two 128x256 float32 accumulators do not fit the registers
        ]

    up = triton.autotune(configs(True), key=["M", "FFN", "K"])(up_swiglu_kernel)
    down = triton.autotune(configs(False), key=["M", "FFN", "K"])(down_dgrad_swiglu_kernel)
    return up_swiglu_kernel, down_dgrad_swiglu_kernel, up, down


def _block_shapes(which: int, bm: int, bn: int, bk: int) -> list[list[int]]:
    """The TMA block of each descriptor argument: the up kernel's (x, w, gu, h), the down kernel's (dy, w, gu, dgu)."""
    return [[bm, bk], [bn, bk], [bm, bn], [bm, bn]] if which == 0 else [[bm, bk], [bk, bn], [bm, bn], [bm, bn]]


def _desc(t: torch.Tensor, block: list[int]) -> Any:
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch(which: int, descs: tuple[Any, ...], m: int, ffn: int, k: int, blocks: tuple[int, ...] | None) -> None:
    device = descs[0].base.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1 << 30
    if blocks is not None:  # one given tile shape (tests; Triton's CPU interpreter; bench/swiglu_gemm_bench.py)
        bm, bn, bk, *rest = blocks
        stages, warps, persistent = (*rest, *(3, 8, True)[len(rest) :])
        tiles = _cdiv(m, bm) * (ffn // bn)
        programs = min(sms, tiles) if persistent else tiles
        for d, shape in zip(descs, _block_shapes(which, bm, bn, bk), strict=True):
            d.block_shape = shape
        _kernels()[which][(programs,)](
            *descs, m, ffn, k, BM=bm, BN=bn, BK=bk, GROUP_M=8, PROGRAMS=programs, STAGES=stages, num_warps=warps
        )
        return

    def grid(meta: dict[str, Any]) -> tuple[int]:
        # persistent: at most one program per SM, each walking tiles (one tile's epilogue beside the next's loads)
        return (min(sms, _cdiv(m, meta["BM"]) * (ffn // meta["BN"])),)

    _kernels()[2 + which][grid](*descs, m, ffn, k, GROUP_M=8, PROGRAMS=sms)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.is_contiguous() else t2.contiguous()


def up_swiglu(
    x: torch.Tensor, w: torch.Tensor, *, blocks: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([gate; up], h)`` with ``[gate; up] = x @ w.T`` and ``h = silu(gate) * up``, one Triton GEMM.

    ``x`` is ``[..., hidden]``, ``w`` is ``[2 * ffn, hidden]`` (the ``[gate; up]`` halves of the up projection).
    ``blocks`` (``BM, BN, BK``) skips the autotuner (tests, Triton's CPU interpreter)."""
    ffn = w.shape[0] // 2
    x2 = _rows(x)
    m, k = x2.shape
    gu = torch.empty(m, 2 * ffn, dtype=x.dtype, device=x.device)
    h = torch.empty(m, ffn, dtype=x.dtype, device=x.device)
    bm, bn, bk = (blocks or (128, 128, 64))[:3]  # replaced by the autotuner's pre-hook
    descs = (_desc(x2, [bm, bk]), _desc(w.contiguous(), [bn, bk]), _desc(gu, [bm, bn]), _desc(h, [bm, bn]))
    _launch(0, descs, m, ffn, k, blocks)
    return gu.view(*x.shape[:-1], 2 * ffn), h.view(*x.shape[:-1], ffn)


def down_dgrad_swiglu(
    dy: torch.Tensor, w_down: torch.Tensor, gu: torch.Tensor, *, blocks: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``[d_gate; d_up]``, the gradient of ``silu(gate) * up`` at ``gu = [gate; up]`` for ``dh = dy @ w_down``, one
    Triton GEMM (``dh`` stays in registers).

    ``dy`` is ``[..., hidden]`` (the gradient of the down projection's output), ``w_down`` is ``[hidden, ffn]``."""
    ffn = w_down.shape[1]
    dy2, gu2 = _rows(dy), _rows(gu)
    m, k = dy2.shape
    dgu = torch.empty(m, 2 * ffn, dtype=gu.dtype, device=gu.device)
    bm, bn, bk = (blocks or (128, 128, 64))[:3]
    descs = (_desc(dy2, [bm, bk]), _desc(w_down.contiguous(), [bk, bn]), _desc(gu2, [bm, bn]), _desc(dgu, [bm, bn]))
    _launch(1, descs, m, ffn, k, blocks)
    return dgu.view(gu.shape)
