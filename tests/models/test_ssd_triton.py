"""``ssd_scan_triton``: the Mamba-2 chunked SSD scan's Triton kernels, forward and every gradient, against a float64
sequential recurrence (``state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T``, ``y_t = state_t C_t + D x_t``)
differentiated by autograd. The kernels run on GPUs, or on the CPU under ``TRITON_INTERPRET=1`` (float32, tiny
shapes); without either the tests that need them are skipped."""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mcore_models.ssm import ssd_triton
from mcore_models.ssm.ssd_triton import ssd_scan_triton
from tests.models._kernels import HAS_TRITON, KERNEL_DEVICES, needs_kernel

NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states")
BACKWARDS = ("heads", "groups")  # ssd_triton.BACKWARD: the gradients of B and C per head, or through dCB per group


def recurrence(x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, math.inf), initial_states=None):
    """``(y, final_states)`` one position at a time, in the inputs' dtype (float64 here)."""
    b, s, H, P = x.shape
    G, N = B.shape[2:]
    dt = dt + dt_bias if dt_bias is not None else dt
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(dt_limit[0], dt_limit[1])
    Bh, Ch = B.repeat_interleave(H // G, dim=2), C.repeat_interleave(H // G, dim=2)
    state = initial_states if initial_states is not None else x.new_zeros(b, H, P, N)
    ys = []
    for t in range(s):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    return (y + D[:, None] * x if D is not None else y), state


def make_inputs(b, s, H, G, P, N, *, D=False, bias=False, init=False, softplus=True, seed=0):
    """float64 CPU inputs: dt around softplus(-1) (or positive raw dt without softplus), A in [-1.5, -0.2]."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(b, s, H, generator=g, dtype=torch.float64)
    t = {
        "x": torch.randn(b, s, H, P, generator=g, dtype=torch.float64),
        "dt": raw - 1.0 if softplus else 0.05 + 0.5 * torch.rand(b, s, H, generator=g, dtype=torch.float64),
        "A": -(0.2 + 1.3 * torch.rand(H, generator=g, dtype=torch.float64)),
        "B": torch.randn(b, s, G, N, generator=g, dtype=torch.float64) / math.sqrt(N),
        "C": torch.randn(b, s, G, N, generator=g, dtype=torch.float64),
    }
    if D:
        t["D"] = torch.randn(H, generator=g, dtype=torch.float64)
    if bias:
        t["dt_bias"] = 0.5 * torch.randn(H, generator=g, dtype=torch.float64)
    if init:
        t["initial_states"] = torch.randn(b, H, P, N, generator=g, dtype=torch.float64)
    return t


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, name: str) -> None:
    """Elementwise within ``tol`` of the reference's largest magnitude, and within ``tol`` in relative norm."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, name
    scale = want.abs().max().item() + 1e-30
    err = (got - want).abs().max().item()
    rel = ((got - want).norm() / (want.norm() + 1e-30)).item()
    assert err <= tol * scale and rel <= tol, f"{name}: max err {err:.3g} (scale {scale:.3g}), relative norm {rel:.3g}"


def assert_runs_agree(t: dict[str, torch.Tensor], runs: Any, tol: float) -> None:
    """``run_both``'s kernel run within ``tol`` of its reference: y, the final states and every input's gradient."""
    (y, fin), (y_ref, fin_ref), grads, ref_grads = runs
    assert_close(y, y_ref, tol, "y")
    assert_close(fin, fin_ref, tol, "final_states")
    for name in t:
        assert_close(grads[name], ref_grads[name], tol, f"d {name}")


def run_both(t, *, chunk_size, device, dtype, softplus=True, dt_limit=(0.0, math.inf), seed=1):
    """Forward and backward through the kernels (inputs cast to ``dtype`` on ``device``) and through the float64
    recurrence (of the same rounded inputs): ``(outputs, grads)`` of each, the final state's gradient included."""
    kw = {"dt_softplus": softplus, "dt_limit": dt_limit}
    ins = {k: v.to(device, dtype if k in ("x", "B", "C") else torch.float32).requires_grad_() for k, v in t.items()}
    ref = {k: v.detach().double().cpu().requires_grad_() for k, v in ins.items()}
    rx = {k: v for k, v in ref.items() if k not in ("x", "dt", "A", "B", "C")}
    y_ref, fin_ref = recurrence(ref["x"], ref["dt"], ref["A"], ref["B"], ref["C"], **rx, **kw)
    g = torch.Generator().manual_seed(seed)
    dy, dfin = torch.randn(y_ref.shape, generator=g, dtype=torch.float64), torch.randn(fin_ref.shape, generator=g)
    torch.autograd.backward([y_ref, fin_ref], [dy, dfin.double()])
    kx = {k: v for k, v in ins.items() if k not in ("x", "dt", "A", "B", "C")}
    y, fin = ssd_scan_triton(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], chunk_size=chunk_size, **kx, **kw,
                             return_final_states=True)  # fmt: skip
    assert y.dtype == dtype and fin.dtype == torch.float32 and y.shape == ins["x"].shape
    torch.autograd.backward([y, fin], [dy.to(device, dtype), dfin.to(device)])
    grads = {k: v.grad for k, v in ins.items()}
    assert all(grads[k] is not None and grads[k].dtype == ins[k].dtype for k in ins)
    return (y, fin), (y_ref, fin_ref), grads, {k: v.grad for k, v in ref.items()}


CASES = [  # b, s, H, G, P, N, chunk, options
    (1, 16, 4, 1, 4, 4, 8, {}),
    (2, 37, 4, 2, 8, 8, 16, {"D": True, "bias": True, "init": True}),
    (1, 5, 4, 2, 4, 8, 8, {"softplus": False, "dt_limit": (0.1, 0.4)}),  # one partial chunk, clamped both sides
    (2, 37, 4, 1, 8, 4, 12, {"D": True, "init": True, "dt_limit": (0.2, 0.6)}),  # a chunk length not a power of 2
    (1, 16, 4, 4, 4, 4, 16, {"bias": True, "softplus": True}),  # one whole chunk, a group per head
]


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"s{c[1]}-G{c[3]}-L{c[6]}-{'-'.join(c[7]) or 'plain'}")
def test_kernels_equal_the_float64_recurrence(device: str, case: tuple, backward: str, monkeypatch) -> None:
    monkeypatch.setattr(ssd_triton, "BACKWARD", backward)
    b, s, H, G, P, N, L, opts = case
    softplus, limit = opts.get("softplus", True), opts.get("dt_limit", (0.0, math.inf))
    flags = {k: opts.get(k, False) for k in ("D", "bias", "init")}
    t = make_inputs(b, s, H, G, P, N, softplus=softplus, seed=s + L, **flags)
    assert_runs_agree(t, run_both(t, chunk_size=L, device=device, dtype=torch.float32, softplus=softplus,
                                  dt_limit=limit), 2e-5)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("backward", BACKWARDS)
def test_several_blocks_per_chunk(device: str, backward: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 40 positions in blocks of 16: the row and column loops cross blocks, the last block partial (and
    the group kernels' blocks of 8: five, the pairs of blocks and dt_bwd's partial sums over several)."""
    monkeypatch.setattr(ssd_triton, "BACKWARD", backward)
    monkeypatch.setitem(ssd_triton.TILES["tf32"], "_ROWS", 16)  # float32 inputs take the tf32 tiles
    monkeypatch.setitem(ssd_triton.TILES["tf32"], "_BWD_ROWS", 16)
    monkeypatch.setitem(ssd_triton.TILES["tf32"], "_GRP_ROWS", 8)
    monkeypatch.setattr(ssd_triton, "_STATE_BLOCK", 16)  # the state pass over several tiles (P * N = 32)
    t = make_inputs(1, 50, 4, 2, 4, 8, D=True, bias=True, init=True, seed=3)
    assert_runs_agree(t, run_both(t, chunk_size=40, device=device, dtype=torch.float32), 2e-5)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_compiled_graph_keeps_the_ops(device: str) -> None:
    """Under ``torch.compile(fullgraph=True)`` the ops are opaque nodes (their fake implementations give the
    shapes); outputs and gradients equal eager's, strided inputs included."""
    t = make_inputs(1, 12, 4, 2, 4, 4, D=True, init=True, seed=5)
    ins = {k: v.to(device, torch.float32).requires_grad_() for k, v in t.items()}

    def f(x, dt, A, B, C, D, initial_states):
        y, fin = ssd_scan_triton(x.transpose(1, 2).contiguous().transpose(1, 2), dt, A, B, C, chunk_size=8, D=D,
                                 initial_states=initial_states, return_final_states=True)  # fmt: skip
        return y.square().sum() + fin.sum()

    eager = f(**ins)
    eager_grads = torch.autograd.grad(eager, list(ins.values()))
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(**ins)
    compiled_grads = torch.autograd.grad(compiled, list(ins.values()))
    torch.testing.assert_close(compiled, eager)
    for name, a, b in zip(ins, compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, msg=name)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernels_equal_the_torch_path(device: str) -> None:
    """The same float32 inputs through ``ssd_scan(impl="torch")`` (mcore_models.ssm.ssd): outputs and gradients."""
    ssd = pytest.importorskip("mcore_models.ssm.ssd")
    t = make_inputs(2, 21, 4, 2, 8, 4, D=True, bias=True, init=True, seed=11)
    outs, grads = [], []
    for impl in ("triton", "torch"):
        ins = {k: v.to(device, torch.float32).requires_grad_() for k, v in t.items()}
        fn = ssd_scan_triton if impl == "triton" else functools.partial(ssd.ssd_scan, impl="torch")
        y, fin = fn(**ins, chunk_size=8, dt_limit=(0.0, 1.0), return_final_states=True)
        (y.sin().sum() + fin.square().sum()).backward()
        outs.append((y, fin.float()))
        grads.append({k: v.grad for k, v in ins.items()})
    for a, b, name in zip(outs[0], outs[1], ("y", "final_states"), strict=True):
        assert_close(a, b, 2e-5, name)
    for name in t:
        assert_close(grads[0][name], grads[1][name], 2e-5, f"d {name}")


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_a_minus_infinity_time_step_is_an_identity_step(device: str, impl: str) -> None:
    """How the engine pads prefill chunks of several requests into one batch (``plan_prefill``): raw dt ``-inf``
    after a row's tokens (softplus gives 0: decay 1, no input) leaves every real position's output and the final
    state as the row's own tokens alone give them (rows of 21, 7 and 1 tokens padded to 21, from initial states)."""
    ssd = pytest.importorskip("mcore_models.ssm.ssd")
    t = {k: v.to(device, torch.float32) for k, v in make_inputs(3, 21, 4, 2, 4, 8, D=True, bias=True, init=True,
                                                                   seed=13).items()}  # fmt: skip
    sizes = (21, 7, 1)
    padded = t["dt"].clone()
    for r, n in enumerate(sizes):
        padded[r, n:] = float("-inf")
    y, fin = ssd.ssd_scan(**{**t, "dt": padded}, chunk_size=8, return_final_states=True, impl=impl)
    assert torch.isfinite(y).all() and torch.isfinite(fin).all()
    for r, n in enumerate(sizes):
        row = {k: (v[r : r + 1, :n] if k in ("x", "dt", "B", "C") else v[r : r + 1] if k == "initial_states" else v)
               for k, v in t.items()}  # fmt: skip
        want_y, want_fin = ssd.ssd_scan(**row, chunk_size=8, return_final_states=True, impl=impl)
        assert_close(y[r : r + 1, :n], want_y, 2e-5, f"row {r}: y")
        assert_close(fin[r : r + 1].float(), want_fin.float(), 2e-5, f"row {r}: final state")


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("backward", BACKWARDS)
def test_bf16_inputs_with_either_product_precision(device: str, backward: str, monkeypatch) -> None:
    """bf16 x, B, C: the products on float32 operands (TF32 on GPUs) and on bf16 operands
    (``LOW_PRECISION_DOTS``) each give the float64 recurrence's outputs and gradients within bf16 rounding, and
    the two differ (the 16-bit products really round their operands)."""
    monkeypatch.setattr(ssd_triton, "BACKWARD", backward)
    t = make_inputs(2, 37, 4, 2, 16, 16, D=True, bias=True, init=True, seed=4)
    ys = []
    for low in (False, True):
        monkeypatch.setattr(ssd_triton, "LOW_PRECISION_DOTS", low)
        dot = ssd_triton._dot_dtypes(torch.zeros(1, dtype=torch.bfloat16))["DOT"]
        assert dot.primitive_bitwidth == (16 if low else 32)
        runs = run_both(t, chunk_size=16, device=device, dtype=torch.bfloat16)
        assert_runs_agree(t, runs, 2e-2)
        ys.append(runs[0][1])  # the final states: float32, so the products' rounding shows
    assert not torch.equal(ys[0], ys[1])


def _mixer_layout(t: dict[str, torch.Tensor], device: str, pad: int = 3) -> dict[str, torch.Tensor]:
    """``t``'s tensors in the mixer's layout (float32 on ``device``): ``x``, ``B``, ``C`` slices of one
    ``[b, s, d + 2GN + pad]`` tensor (the convolution's output), ``dt`` a transposed slice of an ``[s, b, W']`` one
    (the in-projection's), as views of leaves that need their gradients."""
    (b, s, H, P), (G, N) = t["x"].shape, t["B"].shape[2:]
    f = {k: v.to(device, torch.float32) for k, v in t.items()}
    conv = torch.cat([f["x"].flatten(2), f["B"].flatten(2), f["C"].flatten(2), f["x"].new_zeros(b, s, pad)], -1)
    proj = torch.cat([f["x"].new_zeros(s, b, pad), f["dt"].transpose(0, 1), f["x"].new_zeros(s, b, pad)], -1)
    conv, proj = conv.requires_grad_(), proj.requires_grad_()
    d, gn = H * P, G * N
    views = {"x": conv[..., :d].view(b, s, H, P), "B": conv[..., d : d + gn].view(b, s, G, N),
             "C": conv[..., d + gn : d + 2 * gn].view(b, s, G, N), "dt": proj[..., pad : pad + H].transpose(0, 1)}  # fmt: skip
    return {**{k: v.requires_grad_() for k, v in f.items() if k not in views}, **views}


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dy_layout", ["transposed", "every-other"])
@pytest.mark.parametrize("backward", BACKWARDS)
def test_strided_inputs_are_read_in_place(device: str, dy_layout: str, backward: str, monkeypatch) -> None:
    """The mixer's views (:func:`_mixer_layout`) and a ``dy`` that is an ``[s, b, H, P]`` tensor transposed reach
    the kernels as they are (the launches get the views' own storage; a ``dy`` whose last dimension is not dense,
    every other element of a wider one, is copied), and the outputs and every gradient equal, bit for bit, those of
    the same scan on contiguous copies. Chunks of 16 in blocks of 8: the row and column loops cross blocks."""
    monkeypatch.setattr(ssd_triton, "BACKWARD", backward)
    monkeypatch.setitem(ssd_triton.TILES["tf32"], "_ROWS", 8)  # float32 inputs take the tf32 tiles
    monkeypatch.setitem(ssd_triton.TILES["tf32"], "_BWD_ROWS", 8)
    monkeypatch.setitem(ssd_triton.TILES["tf32"], "_GRP_ROWS", 8)
    b, s, H, P = 2, 37, 4, 8
    t = make_inputs(b, s, H, 2, P, 4, D=True, bias=True, init=True, seed=17)
    views = _mixer_layout(t, device)
    g = torch.Generator().manual_seed(2)
    dy_sb = torch.randn(s, b, H, 2 * P if dy_layout == "every-other" else P, generator=g).to(device)
    dy = dy_sb.transpose(0, 1)[..., ::2] if dy_layout == "every-other" else dy_sb.transpose(0, 1)
    dfin = torch.randn(b, H, P, 4, generator=g).to(device)
    assert not any(views[k].is_contiguous() or not ssd_triton._in_place(views[k]) for k in ("x", "B", "C", "dt"))
    assert ssd_triton._in_place(dy) == (dy_layout == "transposed") and not dy.is_contiguous()
    launches: list[tuple[str, set[int]]] = []
    kernels = ssd_triton._kernels()

    class Recorded:  # a kernel whose launches record the storage of their tensor arguments
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kw: Any) -> Any:
                launches.append((self.name, {a.data_ptr() for a in args if isinstance(a, torch.Tensor)}))
                return kernels[self.name][grid](*args, **kw)

            return launch

    recorded, results = {name: Recorded(name) for name in kernels}, []
    for strided in (True, False):
        ins = views if strided else {k: v.detach().contiguous().requires_grad_() for k, v in views.items()}
        monkeypatch.setattr(ssd_triton, "_kernels", (lambda: recorded) if strided else (lambda: kernels))
        y, fin = ssd_scan_triton(**ins, chunk_size=16, return_final_states=True)
        grads = torch.autograd.grad([y, fin], list(ins.values()), [dy if strided else dy.contiguous(), dfin])
        results.append([y, fin, *grads])
    for name, a, want in zip(("y", "final_states", *(f"d {k}" for k in views)), *results, strict=True):
        assert want.is_contiguous() and a.stride() == want.stride() and torch.equal(a, want), name
    if backward == "heads":  # the backward's launches that read each input, in order
        bwd = {"x": ["bwd_cols", "bwd_rows"], "B": ["bwd_cols", "bwd_rows"], "C": ["bwd_cols", "bwd_rows"],
               "dy": ["chunk_state", "bwd_cols", "bwd_rows"]}  # fmt: skip
    else:  # bwd_dbdc for dC (reads dy, B, C), then for dB (x, C, B)
        both = ["bwd_dcb", "bwd_dbdc", "bwd_dbdc", "bwd_cols"]
        bwd = {"x": ["bwd_dcb", "bwd_dbdc", "bwd_cols"], "B": both, "C": both,
               "dy": ["chunk_state", "bwd_dcb", "bwd_dbdc", "bwd_cols"]}  # fmt: skip
    reads = {"x": ["chunk_state", "chunk_out", *bwd["x"]], "B": ["chunk_state", "chunk_out", *bwd["B"]],
             "C": ["chunk_out", "chunk_state", *bwd["C"]], "dt": ["dt_fwd", "dt_bwd"]}  # fmt: skip
    for k, names in {**reads, "dy": bwd["dy"] if dy_layout == "transposed" else []}.items():
        t_in = dy if k == "dy" else views[k]
        assert [n for n, ptrs in launches if t_in.data_ptr() in ptrs] == names, k


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_fake_kernels_match_the_real_outputs(device: str) -> None:
    """``opcheck`` compares each op's fake (meta) outputs with its real ones, shapes and strides, on the mixer's
    views and on an ``x`` and ``dy`` that are dense ``[s, b, H, P]`` tensors transposed (read in place: the outputs
    are contiguous all the same, not laid out like them)."""
    t = make_inputs(2, 12, 4, 2, 4, 4, D=True, bias=True, init=True, seed=19)
    f = {k: v.detach() for k, v in _mixer_layout(t, device).items()}
    swapped = f["x"].transpose(0, 1).contiguous().transpose(0, 1)
    fwd, bwd = torch.ops.mcore_models.ssd_scan_fwd, torch.ops.mcore_models.ssd_scan_bwd
    tests = ["test_schema", "test_faketensor"]
    for x in (f["x"], swapped):
        assert ssd_triton._in_place(x) and not x.is_contiguous()
        args = (x, f["dt"], f["A"], f["B"], f["C"], f["D"], f["dt_bias"], f["initial_states"], 8, True, 0.0, math.inf)
        torch.library.opcheck(fwd, args, test_utils=tests)
        y, _, states, dtp, cum = fwd(*args)
        assert y.is_contiguous()
        dy = torch.randn_like(x.transpose(0, 1)).transpose(0, 1)
        bargs = (dy, None, x, f["dt"], f["A"], f["B"], f["C"], f["D"], f["dt_bias"], states, dtp, cum, 8, True, 0.0,
                 math.inf)  # fmt: skip
        torch.library.opcheck(bwd, bargs, test_utils=tests)
        assert all(g.is_contiguous() for g in bwd(*bargs))


def test_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = make_inputs(1, 4, 2, 1, 2, 2)
    with pytest.raises(ValueError, match="needs its tensors on one CUDA device"):
        ssd_scan_triton(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=4)
    with pytest.raises(ValueError, match="H % G == 0"):
        ssd_scan_triton(t["x"], t["dt"], t["A"], t["B"].expand(1, 4, 3, 2), t["C"].expand(1, 4, 3, 2), chunk_size=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("low", [False, True], ids=["tf32-dots", "16bit-dots"])
@pytest.mark.parametrize("backward", BACKWARDS)
def test_realistic_shapes_in_bf16_on_the_gpu(low: bool, backward: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """b=2, H=32, P=64, G=1, N=128, chunks of 256, bf16: forward and every gradient against the float64 recurrence
    on 600 positions (two whole chunks and a partial one); the forward at s=2048 against the recurrence too; with
    the products on float32 (TF32) or bf16 operands."""
    monkeypatch.setattr(ssd_triton, "LOW_PRECISION_DOTS", low)
    monkeypatch.setattr(ssd_triton, "BACKWARD", backward)
    t = make_inputs(2, 600, 32, 1, 64, 128, D=True, bias=True, init=True, seed=7)
    (y, fin), (y_ref, fin_ref), grads, ref_grads = run_both(t, chunk_size=256, device="cuda", dtype=torch.bfloat16)
    assert_close(y, y_ref, 2e-2, "y")
    assert_close(fin, fin_ref, 1e-2, "final_states")
    for name in t:
        assert_close(grads[name], ref_grads[name], 2e-2, f"d {name}")
    t = make_inputs(2, 2048, 32, 1, 64, 128, D=True, bias=True, seed=8)
    cuda = {k: v.cuda() for k, v in t.items()}
    with torch.no_grad():
        y_ref, fin_ref = recurrence(**cuda)
    ins = {k: v.to(torch.bfloat16 if k in ("x", "B", "C") else torch.float32) for k, v in cuda.items()}
    y, fin = ssd_scan_triton(**ins, chunk_size=256, return_final_states=True)
    assert_close(y, y_ref, 2e-2, "y at s=2048")
    assert_close(fin, fin_ref, 1e-2, "final_states at s=2048")
    # timing, for the log (pytest -s): forward and forward + backward at s=2048
    leaves = {k: v.requires_grad_() for k, v in ins.items()}
    for label, with_backward in (("forward", False), ("forward+backward", True)):
        for i in range(6):
            if i == 1:
                torch.cuda.synchronize()
                start = time.perf_counter()
            y = ssd_scan_triton(**leaves, chunk_size=256)
            if with_backward:
                y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
        print(
            f"ssd_scan_triton {label} b=2 s=2048 H=32 P=64 N=128 L=256 bf16 (16-bit products: {low}): "
            f"{(time.perf_counter() - start) / 5 * 1e3:.2f} ms"
        )
