"""The FP8 MLP's fused SwiGLU casts (``model.fp8_fused_swiglu``, ``mcore_models.transformer.fp8_swiglu``).

- The kernels against the unfused path's ops: SwiGLU (or its backward) in float32, rounded to the activation dtype,
  then the PyTorch FP8 cast (``scaling._cast_transposed``): the same FP8 codes, except that the kernel's sigmoid may
  differ from PyTorch's in the last float32 bit, which can move a value across a rounding boundary: at most one
  code in a thousand, each by one code. Shapes off the tiles, saturating scales, the absolute maximum, NaN.
- A tiny Llama in FP8 with delayed scaling, fused against unfused, over three steps (the first builds the history and
  runs unfused): the loss, every gradient (also into ``main_grad``), the histories; the fused path taken.
- The same at tp 2 and tp 2 with sequence parallelism on gloo, against one process (``test_fp8_tp._run``).

On GPUs, or on the CPU under ``TRITON_INTERPRET=1`` (the nox ``kernels`` session); skipped without either."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from mcore_models import GPTModel
from mcore_models.transformer import fp8_swiglu
from mcore_models.transformer.fp8_swiglu import swiglu_backward_quantize, swiglu_quantize
from mcore_models.transformer.mlp import MLP
from mcore_models.transformer.swiglu import swiglu_backward_reference
from mcore_parallel import Group
from mcore_parallel.fp8 import E4M3, E5M2, fp8_step, scaling
from mcore_parallel.testing import run_distributed
from tests._model_configs import llama
from tests.models.test_fp8_tp import _run

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICES: list = []
if torch.cuda.is_available() and HAS_TRITON:
    DEVICES.append(pytest.param("cuda", marks=pytest.mark.gpu))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
if INTERPRETED:
    DEVICES.append("cpu")
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 + Triton")
SHAPES = [(100, 72), (3, 16), (130, 200), (64, 128)]
"""(tokens, ffn): h is [tokens, 2 * ffn]."""


def _h(tokens: int, ffn: int, device: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, 2 * ffn, generator=g) * torch.logspace(-3, 1, 2 * ffn)
    return h.to(device=device, dtype=dtype)


def _stored(t: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Float32 ``t`` rounded to ``dtype`` as the kernel rounds it: to nearest even on GPUs; Triton's interpreter
    converts float32 to bfloat16 by truncation (toward zero), so on the CPU the reference does too."""
    if device == "cpu" and dtype == torch.bfloat16:
        return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)


def _assert_codes_match(q: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Equal FP8 codes but for at most one in a thousand, each the neighbouring code (same sign: FP8 codes are
    ordered by magnitude within a sign)."""
    a, b = q.view(torch.uint8).cpu().int(), ref.view(torch.uint8).cpu().int()
    assert a.shape == b.shape, what
    differ = a != b
    assert differ.float().mean().item() <= 1e-3, f"{what}: {int(differ.sum())} of {a.numel()} codes differ"
    assert ((a - b).abs()[differ] == 1).all(), f"{what}: a code differs by more than one step"


def _scale(t: torch.Tensor, fmt: object, saturate: bool) -> torch.Tensor:
    """The scale that maps max|t| onto the format's maximum, or onto twice it (the largest values saturate)."""
    top = fmt.max * (2.0 if saturate else 1.0)  # type: ignore[attr-defined]
    return torch.tensor(top / t.float().abs().max().item(), device=t.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("saturate", [False, True], ids=["in-range", "saturating"])
def test_swiglu_quantize_equals_swiglu_then_the_cast(
    device: str, dtype: torch.dtype, shape: tuple, saturate: bool
) -> None:
    h = _h(*shape, device, dtype, seed=1)
    gate, up = h.float().chunk(2, dim=-1)
    a = _stored(F.silu(gate) * up, dtype, device)
    scale = _scale(a, E4M3, saturate)
    amax = torch.zeros(1, device=device)
    q, qt = swiglu_quantize(h, scale, E4M3, amax)
    ref, ref_t, _ = scaling._cast_transposed(a, scale, E4M3.max, E4M3.dtype)
    _assert_codes_match(q, ref, "a")
    assert qt is not None and qt.is_contiguous()
    _assert_codes_match(qt, ref_t, "aᵀ")
    torch.testing.assert_close(amax[0].cpu(), a.float().abs().max().cpu(), rtol=2**-7, atol=0)
    q2, none = swiglu_quantize(h, scale, E4M3, torch.zeros(1, device=device), transpose=False)
    assert none is None and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", [E5M2, E4M3], ids=["e5m2", "e4m3"])
def test_swiglu_backward_quantize_equals_the_backward_then_the_cast(
    device: str, dtype: torch.dtype, shape: tuple, fmt: object
) -> None:
    h = _h(*shape, device, dtype, seed=2)
    g = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 1e-2).to(device=device, dtype=dtype)
    dh = _stored(swiglu_backward_reference(h.float(), g.float()), dtype, device)
    scale = _scale(dh, fmt, saturate=False)
    amax = torch.full((1,), 1e-30, device=device)  # folded in: max(previous, this tensor's)
    q, qt = swiglu_backward_quantize(h, g, scale, fmt, amax)  # type: ignore[arg-type]
    ref, ref_t, _ = scaling._cast_transposed(dh, scale, fmt.max, fmt.dtype)  # type: ignore[attr-defined]
    assert q.shape == (shape[0], 2 * shape[1]) and qt.shape == (2 * shape[1], shape[0]) and qt.is_contiguous()
    _assert_codes_match(q, ref, "dh")
    _assert_codes_match(qt, ref_t, "dhᵀ")
    torch.testing.assert_close(amax[0].cpu(), dh.float().abs().max().cpu(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile", fp8_swiglu.TILES, ids=str)
def test_every_tuned_tile_gives_the_same_codes(device: str, tile: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both casts at each tile the tune bench may pick (shapes off the tiles), forward and backward, launched with
    that tile (grid and warps): the codes of the default tiles' casts (the reference tests above pin those), and
    the same maximum."""
    h = _h(130, 200, device, torch.bfloat16, seed=4)
    g = (torch.randn(130, 200, generator=torch.Generator().manual_seed(5)) * 1e-2).to(device, torch.bfloat16)
    scale_a, scale_d = torch.tensor(30.0, device=device), torch.tensor(4000.0, device=device)
    launches: list[tuple[str, tuple, int]] = []
    kernels = fp8_swiglu._kernels()
    for name in ("swiglu_cast", "swiglu_bwd_cast"):
        real = kernels[name]

        class Spy:  # records each launch's grid and warps, then launches the kernel
            def __getitem__(self, grid: tuple, name: str = name, real: object = real) -> object:
                def launch(*args: object, **kw: object) -> object:
                    launches.append((name, grid, int(kw["num_warps"])))  # type: ignore[call-overload]
                    return real[grid](*args, **kw)  # type: ignore[index]

                return launch

        monkeypatch.setitem(kernels, name, Spy())
    outs = []
    for fwd, bwd in ((fp8_swiglu.FWD_TILE, fp8_swiglu.BWD_TILE), (tile, tile)):
        monkeypatch.setattr(fp8_swiglu, "FWD_TILE", fwd)
        monkeypatch.setattr(fp8_swiglu, "BWD_TILE", bwd)
        amax_a, amax_d = torch.zeros(1, device=device), torch.zeros(1, device=device)
        q, qt = swiglu_quantize(h, scale_a, E4M3, amax_a)
        dq, dqt = swiglu_backward_quantize(h, g, scale_d, E5M2, amax_d)
        assert qt is not None
        outs.append([t.view(torch.uint8) for t in (q, qt, dq, dqt)] + [amax_a, amax_d])
    for mine, theirs in zip(outs[1], outs[0], strict=True):
        assert torch.equal(mine, theirs)
    bm, bn, warps = tile
    grid = (-(-130 // bm), -(-200 // bn))
    assert launches[2:] == [("swiglu_cast", grid, warps), ("swiglu_bwd_cast", grid, warps)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_shows_in_the_maximum(device: str) -> None:
    h = _h(40, 32, device, torch.bfloat16, seed=4)
    h[7, 3] = float("nan")
    amax = torch.zeros(1, device=device)
    swiglu_quantize(h, torch.tensor(1.0, device=device), E4M3, amax)
    assert amax.item() == float("inf")
    amax = torch.zeros(1, device=device)
    swiglu_backward_quantize(h, torch.ones(40, 32, device=device, dtype=torch.bfloat16), torch.tensor(1.0, device=device),
                             E5M2, amax)  # fmt: skip
    assert amax.item() == float("inf")
    # a NaN in the up half only: d_gate holds it, d_up stays finite (the two halves' maxima reduced together)
    h = _h(40, 32, device, torch.bfloat16, seed=4)
    h[9, 32 + 5] = float("nan")
    amax = torch.zeros(1, device=device)
    dh, _ = swiglu_backward_quantize(h, torch.ones(40, 32, device=device, dtype=torch.bfloat16),
                                     torch.tensor(1.0, device=device), E5M2, amax)  # fmt: skip
    assert torch.isnan(dh[9, 5].float()) and not torch.isnan(dh[9, 32 + 5].float())
    assert amax.item() == float("inf")


def _config(**kw: object):  # type: ignore[no-untyped-def]
    base = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=128,
                fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_first_layers_bf16=0,
                fp8_last_layers_bf16=1)  # fmt: skip
    base.update(kw)
    return llama(**base)


def _steps(model: GPTModel, steps: int, main_grad: bool) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    out = []
    device = next(model.parameters()).device
    params = dict(model.named_parameters())
    if main_grad:
        for name, p in params.items():
            if name.endswith("linear_fc1.weight") or name.endswith("linear_fc2.weight"):
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)  # type: ignore[attr-defined]
                p.fuse_wgrad_accumulation = True  # type: ignore[attr-defined]
    for step in range(steps):
        torch.manual_seed(21 + step)
        ids = torch.randint(0, model.config.vocab_size, (2, 24)).to(device)
        labels = torch.randint(0, model.config.vocab_size, (2, 24)).to(device)
        with fp8_step([model], Group.single()):
            loss = model(ids, labels=labels)
            (loss * torch.linspace(0.5, 1.5, ids.shape[1], device=device)).sum().backward()
        grads = {}
        for name, p in params.items():
            main = getattr(p, "main_grad", None)
            grads[name] = (main if main is not None else p.grad).detach().clone()
            if main is not None:
                main.zero_()
        with torch.no_grad():
            for name, p in params.items():
                p -= 0.05 * grads[name].to(p.dtype)
        model.zero_grad(set_to_none=True)
        out.append((loss.detach(), grads))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "main_grad,recompute", [(False, "none"), (True, "none"), (True, "full")], ids=["grad", "main_grad", "recompute"]
)
def test_fused_mlp_trains_like_the_unfused_one(device: str, main_grad: bool, recompute: str) -> None:
    """The fused model (with full recompute: its MLP runs twice a step) against the unfused one without."""
    torch.manual_seed(0)
    dtype = "bfloat16" if device == "cuda" else "float32"  # (the GPU runs the models as training does)
    rtol = 1e-3 if device == "cuda" else 1e-4
    plain = GPTModel(_config(params_dtype=dtype, fp8_fused_swiglu=False), device=device)
    fused = GPTModel(_config(params_dtype=dtype, fp8_fused_swiglu=True, recompute=recompute), device=device)
    fused.load_state_dict(plain.state_dict())
    mlps = [m for m in fused.modules() if isinstance(m, MLP)]
    assert [m.fp8_fused for m in mlps] == [True, True, False]  # the last layer stays bf16
    ref, got = _steps(plain, 3, main_grad), _steps(fused, 3, main_grad)
    runs = 2 if recompute == "full" else 1  # forwards of each fused MLP a step
    assert [m.fp8_fused_calls for m in mlps] == [2 * runs, 2 * runs, 0]  # the first step builds the history
    assert not any(m.fp8_fused_calls for m in plain.modules() if isinstance(m, MLP))
    for step, ((ref_loss, ref_grads), (loss, grads)) in enumerate(zip(ref, got, strict=True)):
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=1e-5)
        for name, g in grads.items():
            diff, norm = (g - ref_grads[name]).norm().item(), ref_grads[name].norm().item()
            assert diff <= 1e-2 * norm + 1e-6, f"step {step} {name}: |difference| {diff:.3e}, |gradient| {norm:.3e}"
    ids = torch.randint(0, plain.config.vocab_size, (2, 24)).to(device)
    with torch.no_grad():  # an evaluation: no gradients, no transposes, the histories untouched
        evals = []
        for m in (plain, fused):
            with fp8_step([m], update_scaling=False):
                evals.append(m(ids, labels=ids).mean())
    torch.testing.assert_close(evals[1], evals[0], rtol=rtol, atol=1e-5)
    assert [m.fp8_fused_calls for m in mlps] == [2 * runs + 1, 2 * runs + 1, 0]
    for (name, mine), theirs in zip(fused.runtime_state_dict().items(), plain.runtime_state_dict().values(),
                                    strict=True):  # fmt: skip
        torch.testing.assert_close(mine.local, theirs.local, rtol=2e-2, atol=0, msg=f"{name}: histories differ")


@pytest.mark.skipif(not INTERPRETED, reason="the gloo runs use the interpreted kernels")
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_fused_mlp_under_tp_matches_one_process(sp: bool) -> None:
    run_distributed(_run, 2, _config(fp8_fused_swiglu=True, fp8_last_layers_bf16=0), 2, sp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llama_1b_mlp_fused_equals_unfused_on_the_gpu() -> None:
    """llama-1b's MLP (2048 -> 2 x 8192 -> 2048) at 4096 tokens in bf16, two steps (the first builds the history):
    the fused MLP's output and gradients against the unfused one's from the same weights and histories."""
    from mcore_models.backends import layer_spec
    from mcore_models.presets import preset
    from mcore_models.spec import default_spec
    from mcore_models.transformer.context import ModelContext

    mlps = []
    for fused in (False, True):
        config = preset("llama-1b", params_dtype="bfloat16", fp8="hybrid", fp8_recipe="delayed",
                        fp8_first_layers_bf16=0, fp8_last_layers_bf16=0, fp8_fused_swiglu=fused)  # fmt: skip
        spec = layer_spec(default_spec(), config, 0)
        mlps.append(spec.mlp(config, ModelContext(Group.single("tp"), device="cuda"), spec, "mlp"))
    mlps[1].load_state_dict(mlps[0].state_dict())
    g = torch.Generator(device="cuda").manual_seed(0)
    for step in range(2):
        x = torch.randn(4096, 1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(4096, 1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
        outs = []
        for mlp in mlps:
            xi = x.clone().requires_grad_()
            with fp8_step([mlp]):
                y = mlp(xi)
                y.backward(dy)
            outs.append(
                (y.float(), xi.grad.float(), mlp.linear_fc1.weight.grad.float(), mlp.linear_fc2.weight.grad.float())
            )
            mlp.zero_grad(set_to_none=True)
        for name, a, b in zip(("y", "dx", "dW1", "dW2"), *outs, strict=True):
            assert (a - b).norm() <= 1e-2 * b.norm(), f"step {step} {name}: {(a - b).norm() / b.norm():.2e}"
    assert mlps[1].fp8_fused_calls == 1 and mlps[0].fp8_fused_calls == 0


def test_the_casts_call_their_triton_functions_as_globals() -> None:
    """Inductor, launching a Triton kernel from a compiled graph (the MoE's FP8 experts), emits the kernel's source
    with the jit functions it calls as module globals (its code's names), transitively, but not those it reaches as
    variables of an enclosing function (closure cells): such a callee is missing there and the kernel fails to
    compile (seen on the GPU: the cast's maximum helper reached its ``|x|`` helper that way). No cast kernel or
    helper holds a jit function in a closure cell."""
    from mcore_parallel.fp8 import cast_triton

    functions = {**cast_triton._kernels(), **fp8_swiglu._kernels()}
    functions.update({name: getattr(cast_triton, name) for name in ("_quantize", "_abs_nan_inf", "_tile_amax")})
    functions.update({name: getattr(fp8_swiglu, name) for name in ("_gate_up", "_store")})
    for name, f in functions.items():
        code, cells = f.fn.__code__, f.fn.__closure__ or ()
        held = [v for v, c in zip(code.co_freevars, cells, strict=True) if hasattr(c.cell_contents, "fn")]
        assert not held, f"{name} reaches {held} through a closure, not as module globals"


_COMPILE_FOR_HOPPER = r"""
import itertools, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mcore_parallel.fp8 import cast_triton
from mcore_models.transformer import fp8_swiglu

def signature(fn, consts, fmax_type):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "fmax":
            sig[name] = fmax_type
        elif name.islower():
            sig[name] = "i32"
        else:
            sig[name] = {"T": "*bf16", "H": "*bf16", "G": "*bf16", "Q": "*fp8e4nv", "QT": "*fp8e4nv"}.get(name, "*fp32")
    return sig

kernels = {**cast_triton._kernels(), **fp8_swiglu._kernels()}
failed = []
for name, native, flag in itertools.product(("cast", "swiglu_cast", "swiglu_bwd_cast"), (True, False), (True, False)):
    fn = kernels[name]
    consts = {"EMIN": 121, "MBITS": 3, "NATIVE": native, "BM": 64, "BN": 128}
    consts.update({"AMAX_OUT": flag, "ROWWISE": not flag, "TRANSPOSE": flag} if name == "cast" else {})
    consts.update({"TRANSPOSE": flag} if name == "swiglu_cast" else {})
    try:
        triton.compile(ASTSource(fn=fn, signature=signature(fn, consts, "fp64"), constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except Exception as e:
        failed.append(f"{name} NATIVE={native} flag={flag}: {type(e).__name__}: {str(e)[:200]}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_the_casts_compile_for_hopper_with_fmax_typed_as_inductor_types_it() -> None:
    """The FP8 casts compile for sm_90 with ``fmax`` typed float64, as inductor types a Python float when it
    launches them from a compiled graph (the MoE's FP8 experts). A float64 ``fmax`` once made ``y`` float64, and
    Triton has no float64 -> FP8 conversion: ``make_llir`` failed. Compiled by Triton for the GPU (no GPU needed), in
    a process without ``TRITON_INTERPRET``."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
