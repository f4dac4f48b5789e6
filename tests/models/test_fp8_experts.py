"""FP8 routed experts (``experts`` in ``fp8_modules``, ``mcore_parallel.fp8.grouped``).

- ``scaled_grouped_mm`` is each expert's float64 product of the quantised operands, up to float32 accumulation;
  misaligned widths, row counts that do not add up and non-E4M3 operands are refused.
- The FP8 grouped linear's output and input gradient are within the FP8 error bound of the float64 products (both
  operands E4M3 with rowwise scales, ``tests/parallel/test_fp8_linear.py``'s bound), its weight gradient within the
  bound of the exact output gradient times the FP8 input.
- A tiny MoE model's FP8 layers run their experts in FP8 (the bf16 layers and a misaligned width do not), and train
  close to the same model with bf16 experts.
- Expert parallelism 2, and tensor + sequence parallelism 2 with the experts split over expert-tensor-parallel ranks
  (rowwise maxima reduced over them), equal one process (gloo).
On GPUs (marked ``gpu``): ``torch._scaled_grouped_mm`` equals the CPU path on the same operands."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_models import ConfigError, GPTModel
from mcore_models.backends import describe_backend, layer_spec
from mcore_models.moe import MoEConfig, MoELayer
from mcore_models.spec import default_spec
from mcore_models.transformer.context import ModelContext
from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.fp8 import E4M3, E5M2, GroupedPlan, fp8_grouped_linear, fp8_step, scaled_grouped_mm
from mcore_parallel.fp8.scaling import current_scale, quantize
from mcore_parallel.testing import run_distributed
from tests._model_configs import llama
from tests.parallel.test_fp8_linear import _bound, _check, _quantized

E, N, K = 4, 32, 48
COUNTS = [5, 0, 9, 6]


def _rowwise(t: torch.Tensor, fmt=E4M3):  # type: ignore[no-untyped-def]
    return quantize(t, fmt, current_scale(t, fmt, True, 0, None))


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = sum(COUNTS)
    x = torch.randn(m, K, generator=g) * torch.logspace(-1, 1, K)
    w = torch.randn(E, N, K, generator=g) * 0.1
    return x, w, torch.randn(m, N, generator=g)


def _offsets() -> torch.Tensor:
    return torch.cumsum(torch.tensor(COUNTS), 0, dtype=torch.int32)


def test_scaled_grouped_mm_is_each_experts_quantised_product() -> None:
    x, w, _ = _data()
    a, b = _rowwise(x), _rowwise(w.reshape(E * N, K))
    y = scaled_grouped_mm(a, b, _offsets(), E, torch.float32)
    ad, bd = a.dequantize(torch.float64), b.dequantize(torch.float64).view(E, N, K)
    start = 0
    for e, n in enumerate(COUNTS):
        want = ad[start : start + n] @ bd[e].t()
        tol = (K + 8) * 2.0**-24 * (ad[start : start + n].abs() @ bd[e].abs().t())
        assert ((y[start : start + n].double() - want).abs() <= tol).all(), f"expert {e}"
        start += n
    with pytest.raises(ValueError, match="multiples of 16"):
        scaled_grouped_mm(_rowwise(x[:, :40]), _rowwise(w[:, :, :40].reshape(E * N, 40)), _offsets(), E, torch.float32)
    with pytest.raises(ValueError, match="add up to 19, not the 20 rows"):
        scaled_grouped_mm(a, b, torch.tensor([5, 5, 14, 19], dtype=torch.int32), E, torch.float32)
    with pytest.raises(ValueError, match="E4M3 with rowwise scales"):
        scaled_grouped_mm(_rowwise(x, E5M2), b, _offsets(), E, torch.float32)


def test_the_fp8_grouped_linear_is_within_the_fp8_bound() -> None:
    x, w0, g = _data(1)
    x = x.requires_grad_()
    w = torch.nn.Parameter(w0)
    y = fp8_grouped_linear(x, w, torch.tensor(COUNTS), GroupedPlan())
    y.backward(g)
    assert x.grad is not None and w.grad is not None
    u = E4M3.unit_roundoff
    _, dx = _quantized(x.detach(), E4M3, True)
    _, dg = _quantized(g, E4M3, True)
    x64, g64 = x.detach().double(), g.double()
    start = 0
    for e, n in enumerate(COUNTS):
        rows = slice(start, start + n)
        start += n
        we = w0[e].double()
        _, dw = _quantized(w0[e], E4M3, True)
        _, dwt = _quantized(w0[e].t().contiguous(), E4M3, True)
        if n == 0:
            assert (w.grad[e] == 0).all()
            continue
        xe, ge = x64[rows], g64[rows]
        _check(y[rows], xe @ we.t(), _bound(xe, we, u, u, dx[rows], dw), f"expert {e}: forward")
        _check(x.grad[rows], ge @ we, _bound(ge, we.t(), u, u, dg[rows], dwt), f"expert {e}: input gradient")
        wbound = _bound(ge.t(), xe.t(), 0.0, u, torch.zeros_like(ge.t()), dx[rows].t())
        _check(w.grad[e], ge.t() @ xe, wbound, f"expert {e}: weight gradient")


def test_the_backend_line_says_where_the_experts_run() -> None:
    assert "routed experts: E4M3 rowwise grouped GEMMs" in describe_backend(_moe_config(fp8_modules=("experts",)))
    line = describe_backend(_moe_config())
    assert "routed experts" not in line and "MoE experts" in line and "SwiGLU" not in line
    fused = llama(fp8="hybrid", fp8_recipe="delayed", fp8_fused_swiglu=True, hidden_size=64, num_layers=3)
    assert "the MLP's SwiGLU kernels write FP8" in describe_backend(fused)
    # the fused SwiGLU is a dense MLP's: not named where every FP8 layer is an MoE layer
    delayed = dict(fp8="hybrid", fp8_recipe="delayed")
    assert "SwiGLU" not in describe_backend(_moe_config(**delayed))
    mixed = MoEConfig(num_experts=4, ffn_hidden_size=32, router_topk=2, layer_freq=[1, 0, 1])
    assert "the MLP's SwiGLU kernels write FP8" in describe_backend(_moe_config(moe=mixed, **delayed))


def test_experts_without_moe_layers_are_refused() -> None:
    with pytest.raises(ConfigError, match="names experts but the model has no MoE layers"):
        llama(fp8="e4m3", fp8_modules=("qkv", "experts"), hidden_size=64)


def test_the_expert_weight_casts_are_kept_for_a_step() -> None:
    """Inside ``fp8_step`` each expert layer casts its two weights once each way, whatever the micro-batches;
    outside, every call casts afresh (a weight changed between calls is never used stale)."""
    model = GPTModel(_moe_config(fp8_modules=("experts",), fp8_last_layers_bf16=2))
    experts = next(m for m in model.modules() if isinstance(m, MoELayer)).experts
    assert experts.fp8_plans is not None
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    with fp8_step([model]):
        for _ in range(3):
            model(ids, labels=ids).mean().backward()
    assert [c.casts for c in experts.fp8_casts] == [2, 2]  # forward + input-gradient operand, once a step
    model(ids, labels=ids).mean().backward()
    assert [c.casts for c in experts.fp8_casts] == [4, 4]


def _moe_config(**kw: object):  # type: ignore[no-untyped-def]
    base = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                moe=MoEConfig(num_experts=4, ffn_hidden_size=32, router_topk=2), fp8="e4m3",
                fp8_first_layers_bf16=0, fp8_last_layers_bf16=1)  # fmt: skip
    base.update(kw)
    return llama(**base)


def test_fp8_layers_run_their_experts_in_fp8_and_train_like_bf16_experts() -> None:
    torch.manual_seed(0)
    fp8 = GPTModel(_moe_config(fp8_modules=("qkv", "proj", "fc1", "fc2", "experts")))
    plain = GPTModel(_moe_config())
    plain.load_state_dict(fp8.state_dict())
    experts = [m.experts for m in fp8.modules() if isinstance(m, MoELayer)]
    assert [x.fp8_plans is not None for x in experts] == [True, True, False]  # the last layer stays bf16
    assert all(m.experts.fp8_plans is None for m in plain.modules() if isinstance(m, MoELayer))
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(3))
    losses, grads = [], []
    for model in (fp8, plain):
        loss = model(ids, labels=ids).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "experts.linear" in n})
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=0)
    for name, g in grads[0].items():
        ref = grads[1][name]
        assert (g - ref).norm() <= 0.1 * ref.norm(), name
        assert not torch.equal(g, ref) or "layers.2" in name, f"{name}: no FP8 rounding at all"
    narrow = GPTModel(_moe_config(fp8_modules=("experts",), moe=MoEConfig(num_experts=4, ffn_hidden_size=24)))
    layer = next(m for m in narrow.modules() if isinstance(m, MoELayer))
    assert layer.experts.fp8_plans is None and "multiples of 16" in (layer.experts.fp8_reason or "")


def _layer_out(parallel: ParallelConfig | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], tuple]:
    """An FP8-experts MoE layer's output, input gradient and expert weight gradients on this rank's tokens (the
    whole batch without ``parallel``), and the token slices it holds."""
    config = _moe_config(num_layers=1, fp8_last_layers_bf16=0, fp8_modules=("experts",))
    spec = layer_spec(default_spec(), config, 0)
    assert spec.experts_fp8 is not None
    state = None
    if parallel is None:
        ctx, seq, batch = ModelContext(Group.single()), slice(0, 8), slice(0, 4)
    else:
        state = ParallelState.initialize(parallel)
        sp = state.sequence_parallel
        ctx = ModelContext(state.tp, sp, None, None, config.seed, ep=state.ep, expert_tp=state.expert_tp,
                           balance=state.tp_dp_cp)  # fmt: skip
        b = 4 // state.dp_size
        batch = slice(state.dp.rank * b, (state.dp.rank + 1) * b)
        s = 8 // state.tp.size if sp else 8
        seq = slice(state.tp.rank * s, (state.tp.rank + 1) * s) if sp else slice(0, 8)
    layer = MoELayer(config, ctx, spec, "decoder.layers.0.mlp")
    g = torch.Generator().manual_seed(9)
    x, dy = torch.randn(8, 4, 64, generator=g), torch.randn(8, 4, 64, generator=g)
    mine = x[seq, batch].clone().requires_grad_(True)
    out = layer(mine)
    out.backward(dy[seq, batch])
    grads = {n: p.grad for n, p in layer.named_parameters() if "experts.linear" in n}
    return out.detach(), mine.grad, grads, (seq, batch, layer.experts, state)  # type: ignore[return-value]


def _parallel_run(parallel: ParallelConfig) -> None:
    ref_out, ref_dx, ref_grads, _ = _layer_out(None)
    out, dx, grads, (seq, batch, experts, state) = _layer_out(parallel)
    torch.testing.assert_close(out, ref_out[seq, batch], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dx, ref_dx[seq, batch], rtol=1e-4, atol=1e-5)
    etp = state.expert_tp
    for name, dim in (("experts.linear_fc1.weight", 1), ("experts.linear_fc2.weight", 2)):
        grad = grads[name].clone()
        if state.expert_dp.size > 1:
            dist.all_reduce(grad, group=state.expert_dp.pg)
        want = ref_grads[name][experts.first : experts.first + experts.num_local]
        if etp.size > 1:
            blocks = want.chunk(2, dim) if dim == 1 else (want,)  # [gate; up] split with stride 2
            want = torch.cat([blk.chunk(etp.size, dim)[etp.rank] for blk in blocks], dim)
        assert (grad - want).norm() <= 1e-3 * want.norm(), name


@pytest.mark.parametrize(
    "parallel", [ParallelConfig(ep=2), ParallelConfig(tp=2, sequence_parallel=True)], ids=["ep2", "tp2-sp-etp2"]
)
def test_fp8_experts_across_ranks_equal_one_process(parallel: ParallelConfig) -> None:
    run_distributed(_parallel_run, 2, parallel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_grouped_gemm_equals_the_cpu_path() -> None:
    x, w, g = _data(2)
    a, b = _rowwise(x.cuda().bfloat16()), _rowwise(w.reshape(E * N, K).cuda().bfloat16())
    y = scaled_grouped_mm(a, b, _offsets().cuda(), E, torch.bfloat16)
    cpu = [type(t)(t.data.cpu(), t.scale_inv.cpu(), t.fmt) for t in (a, b)]
    want = scaled_grouped_mm(cpu[0], cpu[1], _offsets(), E, torch.float32)
    torch.testing.assert_close(y.float().cpu(), want, rtol=2e-2, atol=1e-2)
    xg, wg = x.cuda().bfloat16().requires_grad_(), torch.nn.Parameter(w.cuda().bfloat16())
    fp8_grouped_linear(xg, wg, torch.tensor(COUNTS, device="cuda"), GroupedPlan()).backward(g.cuda().bfloat16())
    xc, wc = x.bfloat16().requires_grad_(), torch.nn.Parameter(w.bfloat16())
    fp8_grouped_linear(xc, wc, torch.tensor(COUNTS), GroupedPlan()).backward(g.bfloat16())
    torch.testing.assert_close(xg.grad.float().cpu(), xc.grad.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(wg.grad.float().cpu(), wc.grad.float(), rtol=2e-2, atol=2e-2)
