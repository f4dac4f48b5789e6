"""The fused QKV projection's output split into queries, keys and values, with RoPE on the queries and keys: one
Triton kernel each way.

The QKV projection writes ``[s, b, groups, heads_per_group + 2, d]`` (each group's query heads, then its key and its
value head, Megatron's layout). Compiled layers turned the split and the rotation into three kernels on llama-1b (an
H200, ``docs/performance.md``): the rotation of queries and keys together, then a copy of the queries into
``[s, b, heads, d]`` order; and backward, two kernels that rebuilt the ``[q; k; v]`` gradient out of zero-filled
slices (32 ms of a 3.36 s step for ~13 ms worth of bytes). :func:`qkv_rope` reads the projection once and writes
contiguous ``q`` ``[s, b, heads, d]``, ``k`` and ``v`` ``[s, b, groups, d]``; its backward reads the three gradients
(in whatever strides the attention kernel returned them) and writes the projection's gradient once.

Rotate-half convention over the whole head dimension (``cos``/``sin`` of ``[s, b or 1, 1, d]``, see
:mod:`mcore_models.transformer.rope`), float32 math, one rounding per output element: the numerics of the compiled
PyTorch path. It is a ``torch.library`` custom op, so compiled layers call it as one opaque kernel. The CUDA
implementation is a Triton kernel; elsewhere (the CPU, float64 references) PyTorch ops compute the same function.
``TransformerConfig.rope_kernel`` chooses it (``triton``, the default) or PyTorch's ops (``torch``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mcore_models.transformer.rope import _rotate_half

__all__ = ["qkv_rope", "qkv_rope_backward_reference", "qkv_rope_reference"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ROWS = 8  # tokens per program


def qkv_rope_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` with ``q`` ``[s, b, heads, d]`` and ``k``, ``v`` ``[s, b, groups, d]``, queries and keys rotated
    (PyTorch ops, float32 math for 16-bit inputs)."""
    s, b = qkv.shape[:2]
    x = qkv.reshape(s, b, groups, -1, head_dim)
    per_group = x.shape[3] - 2
    f = torch.promote_types(qkv.dtype, torch.float32)
    c, sn = cos[:, :, :, None].to(f), sin[:, :, :, None].to(f)
    qk = x[:, :, :, : per_group + 1].to(f)
    qk = (qk * c + _rotate_half(qk) * sn).to(qkv.dtype)
    q = qk[:, :, :, :per_group].reshape(s, b, groups * per_group, head_dim)
    # fresh contiguous tensors (a custom op's outputs may not alias its input)
    k, v = qk[:, :, :, per_group], x[:, :, :, per_group + 1]
    return (
        q.contiguous(),
        k.clone(memory_format=torch.contiguous_format),
        v.clone(memory_format=torch.contiguous_format),
    )


def qkv_rope_backward_reference(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The gradient of the QKV projection's output for the gradients of :func:`qkv_rope_reference`'s outputs."""
    s, b, heads, d = dq.shape
    groups = dk.shape[2]
    f = torch.promote_types(dq.dtype, torch.float32)
    dqk = torch.cat([dq.reshape(s, b, groups, heads // groups, d), dk[:, :, :, None]], dim=3).to(f)
    c, sn = cos[:, :, :, None].to(f), sin[:, :, :, None].to(f)
    # the transpose of x -> x * cos + rotate_half(x) * sin: rotate_half's transpose is -rotate_half
    dqk = dqk * c - _rotate_half(dqk * sn)
    return torch.cat([dqk.to(dq.dtype), dv[:, :, :, None]], dim=3).reshape(s, b, -1)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError(
            "model.rope_kernel=triton needs Triton on CUDA (it comes with PyTorch's CUDA wheels); use rope_kernel=torch"
        ) from e

    @triton.jit  # type: ignore[misc]
    def fwd(  # type: ignore[no-untyped-def]
        QKV,
        COS,
        SIN,
        Q,
        K,
        V,
        rows,
        B,
        cs_s,
        cs_b,
        HEADS: tl.constexpr,
        PG: tl.constexpr,
        G: tl.constexpr,
        HP: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        R: tl.constexpr,
    ):
        half: tl.constexpr = D // 2
        r = tl.program_id(0) * R + tl.arange(0, R)  # token rows (s-major, then b)
        rmask = r < rows
        r64 = r.to(tl.int64)
        i = tl.arange(0, half)
        cs = (r64 // B) * cs_s + (r64 % B) * cs_b  # [R]
        c1 = tl.load(COS + cs[:, None] + i[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        c2 = tl.load(COS + cs[:, None] + half + i[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        s1 = tl.load(SIN + cs[:, None] + i[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        s2 = tl.load(SIN + cs[:, None] + half + i[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        width: tl.constexpr = G * (PG + 2) * D
        # queries: head h of group h // PG sits at slot h % PG of its group
        h = tl.arange(0, HP)
        src = ((h // PG) * (PG + 2) + h % PG) * D
        m = rmask[:, None, None] & (h < HEADS)[None, :, None]
        base = QKV + r64[:, None, None] * width + src[None, :, None] + i[None, None, :]
        x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + half, mask=m, other=0.0).to(tl.float32)
        dst = Q + r64[:, None, None] * (HEADS * D) + (h * D)[None, :, None] + i[None, None, :]
        tl.store(dst, (x1 * c1[:, None, :] - x2 * s1[:, None, :]).to(Q.dtype.element_ty), mask=m)
        tl.store(dst + half, (x2 * c2[:, None, :] + x1 * s2[:, None, :]).to(Q.dtype.element_ty), mask=m)
        # keys (rotated) and values (copied): slots PG and PG + 1 of each group
        g = tl.arange(0, GP)
        mg = rmask[:, None, None] & (g < G)[None, :, None]
        base = QKV + r64[:, None, None] * width + (g * (PG + 2) * D + PG * D)[None, :, None] + i[None, None, :]
        x1 = tl.load(base, mask=mg, other=0.0).to(tl.float32)
        x2 = tl.load(base + half, mask=mg, other=0.0).to(tl.float32)
        dst = r64[:, None, None] * (G * D) + (g * D)[None, :, None] + i[None, None, :]
        tl.store(K + dst, (x1 * c1[:, None, :] - x2 * s1[:, None, :]).to(K.dtype.element_ty), mask=mg)
        tl.store(K + dst + half, (x2 * c2[:, None, :] + x1 * s2[:, None, :]).to(K.dtype.element_ty), mask=mg)
        tl.store(V + dst, tl.load(base + D, mask=mg), mask=mg)
        tl.store(V + dst + half, tl.load(base + D + half, mask=mg), mask=mg)

    @triton.jit  # type: ignore[misc]
    def bwd(  # type: ignore[no-untyped-def]
        DQ,
        DK,
        DV,
        COS,
        SIN,
        DQKV,
        rows,
        B,
        cs_s,
        cs_b,
        q_s,
        q_b,
        q_h,
        k_s,
        k_b,
        k_h,
        v_s,
        v_b,
        v_h,
        HEADS: tl.constexpr,
        PG: tl.constexpr,
        G: tl.constexpr,
        HP: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        R: tl.constexpr,
    ):
        half: tl.constexpr = D // 2
        r = tl.program_id(0) * R + tl.arange(0, R)
        rmask = r < rows
        r64 = r.to(tl.int64)
        si, bi = r64 // B, r64 % B
        i = tl.arange(0, half)
        cs = si * cs_s + bi * cs_b
        c1 = tl.load(COS + cs[:, None] + i[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        c2 = tl.load(COS + cs[:, None] + half + i[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        s1 = tl.load(SIN + cs[:, None] + i[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        s2 = tl.load(SIN + cs[:, None] + half + i[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        width: tl.constexpr = G * (PG + 2) * D
        # the transpose of the rotation: dx1 = dy1 * c1 + dy2 * s2, dx2 = dy2 * c2 - dy1 * s1
        h = tl.arange(0, HP)
        m = rmask[:, None, None] & (h < HEADS)[None, :, None]
        src = DQ + (si * q_s + bi * q_b)[:, None, None] + (h * q_h)[None, :, None] + i[None, None, :]
        y1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        y2 = tl.load(src + half, mask=m, other=0.0).to(tl.float32)
        dst = (
            DQKV + r64[:, None, None] * width + (((h // PG) * (PG + 2) + h % PG) * D)[None, :, None] + i[None, None, :]
        )
        tl.store(dst, (y1 * c1[:, None, :] + y2 * s2[:, None, :]).to(DQKV.dtype.element_ty), mask=m)
        tl.store(dst + half, (y2 * c2[:, None, :] - y1 * s1[:, None, :]).to(DQKV.dtype.element_ty), mask=m)
        g = tl.arange(0, GP)
        mg = rmask[:, None, None] & (g < G)[None, :, None]
        src = DK + (si * k_s + bi * k_b)[:, None, None] + (g * k_h)[None, :, None] + i[None, None, :]
        y1 = tl.load(src, mask=mg, other=0.0).to(tl.float32)
        y2 = tl.load(src + half, mask=mg, other=0.0).to(tl.float32)
        dst = DQKV + r64[:, None, None] * width + (g * (PG + 2) * D + PG * D)[None, :, None] + i[None, None, :]
        tl.store(dst, (y1 * c1[:, None, :] + y2 * s2[:, None, :]).to(DQKV.dtype.element_ty), mask=mg)
        tl.store(dst + half, (y2 * c2[:, None, :] - y1 * s1[:, None, :]).to(DQKV.dtype.element_ty), mask=mg)
        src = DV + (si * v_s + bi * v_b)[:, None, None] + (g * v_h)[None, :, None] + i[None, None, :]
        tl.store(dst + D, tl.load(src, mask=mg), mask=mg)
        tl.store(dst + D + half, tl.load(src + half, mask=mg), mask=mg)

    return fwd, bwd


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _cos_strides(cos: torch.Tensor, b: int) -> tuple[int, int]:
    """Strides of ``cos``/``sin`` (``[s, b or 1, 1, d]``) over the sequence and the batch (0: broadcast)."""
    return cos.stride(0), (cos.stride(1) if cos.shape[1] == b and b > 1 else 0)


def _uses_kernel(head_dim: int, *ts: torch.Tensor) -> bool:
    """The Triton kernel on CUDA (or the CPU under Triton's interpreter) for half head dims that are powers of two."""
    on_device = all(t.is_cuda or (t.device.type == "cpu" and _interpreting()) for t in ts)
    return on_device and ts[0].dtype in _KERNEL_DTYPES and head_dim // 2 == _pow2(head_dim // 2)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


@torch.library.custom_op("mcore_models::qkv_rope", mutates_args=())
def _qkv_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _uses_kernel(head_dim, qkv, cos):
        return qkv_rope_reference(qkv, cos, sin, groups, head_dim)
    s, b, width = qkv.shape
    per_group = width // (groups * head_dim) - 2
    heads = groups * per_group
    x = qkv.contiguous()
    c, sn = cos.contiguous(), sin.contiguous()
    q = x.new_empty(s, b, heads, head_dim)
    k = x.new_empty(s, b, groups, head_dim)
    v = x.new_empty(s, b, groups, head_dim)
    rows = s * b
    grid = (-(-rows // _ROWS),)
    _kernels()[0][grid](x, c, sn, q, k, v, rows, b, *_cos_strides(c, b), HEADS=heads, PG=per_group, G=groups,
                        HP=_pow2(heads), GP=_pow2(groups), D=head_dim, R=_ROWS, num_warps=4)  # fmt: skip
    return q, k, v


@_qkv_rope.register_fake
def _(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s, b, width = qkv.shape
    heads = width // head_dim - 2 * groups
    return qkv.new_empty(s, b, heads, head_dim), qkv.new_empty(s, b, groups, head_dim), qkv.new_empty(s, b, groups, head_dim)  # fmt: skip


@torch.library.custom_op("mcore_models::qkv_rope_backward", mutates_args=())
def _qkv_rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    if not _uses_kernel(dq.shape[-1], dq, dk, dv, cos) or any(t.stride(-1) != 1 for t in (dq, dk, dv)):
        return qkv_rope_backward_reference(dq, dk, dv, cos, sin)
    s, b, heads, d = dq.shape
    groups = dk.shape[2]
    c, sn = cos.contiguous(), sin.contiguous()
    out = dq.new_empty(s, b, (heads + 2 * groups) * d)
    rows = s * b
    grid = (-(-rows // _ROWS),)
    _kernels()[1][grid](dq, dk, dv, c, sn, out, rows, b, *_cos_strides(c, b), *dq.stride()[:3], *dk.stride()[:3],
                        *dv.stride()[:3], HEADS=heads, PG=heads // groups, G=groups, HP=_pow2(heads),
                        GP=_pow2(groups), D=d, R=_ROWS, num_warps=4)  # fmt: skip
    return out


@_qkv_rope_backward.register_fake
def _(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    s, b, heads, d = dq.shape
    return dq.new_empty(s, b, (heads + 2 * dk.shape[2]) * d)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])


def _backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[Any, ...]:
    cos, sin = ctx.saved_tensors
    return _qkv_rope_backward(dq, dk, dv, cos, sin), None, None, None, None


_qkv_rope.register_autograd(_backward, setup_context=_setup)


def qkv_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``qkv`` (``[s, b, groups * (heads_per_group + 2) * head_dim]``) into contiguous ``q`` ``[s, b, heads,
    head_dim]``, ``k`` and ``v`` ``[s, b, groups, head_dim]``, with RoPE (``cos``/``sin`` of ``[s, b or 1, 1,
    head_dim]``) applied to ``q`` and ``k``. Differentiable in ``qkv``."""
    if head_dim % 2 or cos.shape[-1] != head_dim:
        raise ValueError(f"qkv_rope rotates whole heads: cos has {cos.shape[-1]} dims for head_dim {head_dim}")
    return _qkv_rope(qkv, cos, sin, groups, head_dim)
