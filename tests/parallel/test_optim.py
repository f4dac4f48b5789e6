"""Optimizers against one process: the distributed optimizer (ZeRO-1) with Adam and clipping, optimizer-state
memory falling with dp (measured from the tensors), fp16 loss scaling skipping an injected inf step, weight-decay
groups, and optimizer state in global shapes resharded into a different layout."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_parallel.optim import DynamicLossScaler
from mcore_parallel.testing import run_distributed
from tests.parallel.test_pipeline_model import Spec, assert_matches_reference, setup, train_step

ADAM = dict(optimizer="adam", lr=1e-2, clip_grad=0.3, adam_eps=1e-6)  # clip_grad small enough to clip every step


@pytest.mark.parametrize(
    "spec,world",
    [
        (Spec(micro=2, dist_opt=True, optimizer=ADAM), 4),
        (Spec(tp=2, sp=True, micro=2, dist_opt=True, optimizer=ADAM, bucket_size=None), 4),
        (Spec(tp=2, pp=2, micro=2, dist_opt=True, optimizer=ADAM, steps=2), 8),
        (Spec(pp=2, micro=2, dist_opt=False, optimizer=ADAM, overlap=False), 4),
        (Spec(micro=2, dist_opt=True, optimizer=ADAM, dp_exchange="p2p"), 2),
        (Spec(micro=2, dist_opt=True, optimizer=ADAM, dp_exchange="p2p"), 4),
        (Spec(tp=2, sp=True, micro=2, dist_opt=True, optimizer=ADAM, dp_exchange="p2p"), 4),
        (Spec(pp=2, micro=2, dist_opt=False, optimizer=ADAM, overlap=False, dp_exchange="p2p"), 4),
        (Spec(micro=2, dist_opt=False, optimizer=ADAM, dp_exchange="p2p", bucket_size=1), 4),
    ],
    ids=[
        "dp4-distopt",
        "tp2-dp2-sp-distopt",
        "tp2-pp2-dp2-distopt",
        "pp2-dp2-adam",
        "dp2-distopt-p2p",
        "dp4-distopt-p2p",
        "tp2-dp2-sp-distopt-p2p",
        "pp2-dp2-adam-p2p",
        "dp4-p2p-bucket-per-param",
    ],
)
def test_matches_single_process(spec: Spec, world: int) -> None:
    outs = assert_matches_reference(spec, world, rtol=2e-5, atol=2e-6)
    assert all(r.grad_norm > ADAM["clip_grad"] for o in outs for r in o["results"]), "clipping was not exercised"


def _state_bytes(dist_opt: bool) -> int:
    spec = Spec(layers=4, micro=1, steps=1, dist_opt=dist_opt, optimizer=dict(optimizer="adam", lr=1e-3),
                bucket_size=None)  # fmt: skip
    state, chunks, opt = setup(spec)
    train_step(state, chunks, opt, spec, 0)
    tensors = {id(t): t for st in opt.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)}
    tensors.update({id(m): m for m in opt.master_params() if not any(m is p for c in chunks for p in c.parameters())})
    moments = sum(t.numel() * t.element_size() for t in tensors.values() if t.dim() > 0)
    return moments


def test_optimizer_state_bytes_shrink_with_dp() -> None:
    full = run_distributed(_state_bytes, 1, True)[0]
    sharded = run_distributed(_state_bytes, 4, True)
    assert full > 0
    for b in sharded:  # each rank keeps about a quarter (padding to a multiple of dp adds at most dp-1 elements)
        assert b <= full / 4 + 4 * 3 * 4, (b, full)
        assert b >= full / 4 - 4 * 3 * 4, (b, full)
    assert run_distributed(_state_bytes, 1, False)[0] == full * 2 // 3  # non-distributed fp32: moments only


def _inject_inf(dist_opt: bool, exchange: str = "nccl") -> dict:
    spec = Spec(dtype="float16", micro=2, dist_opt=dist_opt, dp_exchange=exchange,
                optimizer=dict(optimizer="adam", lr=1e-2, hysteresis=1, initial_loss_scale=1024.0),
                inject_inf=(1, 1))  # fmt: skip
    state, chunks, opt = setup(spec)
    results = []

    def snapshot() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = [p.detach().clone() for c in chunks for p in c.parameters()]
        moments = [t.clone() for st in opt.optimizer.state.values() for t in st.values()]
        return params, moments

    for step in range(3):
        before = snapshot()
        scale = opt.scaler.scale
        _, result = train_step(state, chunks, opt, spec, step)
        results.append(result)
        if step == 1:
            after = snapshot()
            unchanged = all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
            halved = opt.scaler.scale == scale / 2
    return dict(results=results, unchanged=unchanged, halved=halved, fp16=opt.fp16)


@pytest.mark.parametrize("dist_opt", [False, True])
@pytest.mark.parametrize("exchange", ["nccl", "p2p"])
def test_fp16_loss_scaling_skips_injected_inf_step(dist_opt: bool, exchange: str) -> None:
    outs = run_distributed(_inject_inf, 2, dist_opt, exchange)  # the inf is only on rank 1: rank 0 must skip too
    for o in outs:
        assert o["fp16"]
        assert [r.success for r in o["results"]] == [True, False, True]
        assert o["unchanged"], "a skipped step changed parameters or optimizer state"
        assert o["halved"], "the loss scale was not halved"
        assert o["results"][1].loss_scale == 1024.0 and o["results"][2].loss_scale == 512.0
        assert math.isfinite(o["results"][2].grad_norm)


def test_dynamic_loss_scaler_hysteresis_and_growth() -> None:
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=2)
    s.update(True)
    assert s.scale == 8.0  # first overflow tolerated
    s.update(True)
    assert s.scale == 4.0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    for _ in range(4):
        s.update(True)
    assert s.scale == 2.0  # never below min_scale


def _groups() -> list[tuple[float, list[str]]]:
    spec = Spec(tie=False, optimizer=dict(optimizer="adam", lr=1e-3, weight_decay=0.1))
    _, _, opt = setup(spec)
    names = {id(s.master): s.name for s in opt.slots}
    return [(g["weight_decay"], sorted(names[id(p)] for p in g["params"])) for g in opt.param_groups]


def test_no_weight_decay_on_biases_and_norms() -> None:
    (wd, decayed), (nwd, plain) = run_distributed(_groups, 1)[0]
    assert wd == 0.1 and nwd == 0.0
    assert all(n.endswith("weight") and not n.startswith("norm") for n in decayed)
    assert "norm.weight" in plain and "norm.bias" in plain and "layers.0.fc1.bias" in plain
    assert "layers.0.fc1.weight" in decayed and "output.weight" in decayed


SHARD_SPEC = Spec(tp=2, micro=2, steps=2, dist_opt=True, optimizer=ADAM)


def _global_state(spec: Spec) -> dict[str, dict[str, torch.Tensor]]:
    """Train, then write this rank's pieces of every optimizer state tensor into NaN-filled global tensors."""
    state, chunks, opt = setup(spec)
    for step in range(spec.steps):
        train_step(state, chunks, opt, spec, step)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for entry in opt.sharded_state():
        assert entry.step == spec.steps
        for key, piece in entry.tensors.items():
            full = out.setdefault(entry.name, {}).setdefault(key, torch.full(entry.global_shape, float("nan")))
            entry.place(full, piece)
    return out


def _merge(states: list[dict[str, dict[str, torch.Tensor]]]) -> dict[str, dict[str, torch.Tensor]]:
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for st in states:
        for name, tensors in st.items():
            for key, t in tensors.items():
                cur = merged.setdefault(name, {}).setdefault(key, t.clone())
                merged[name][key] = torch.where(torch.isnan(cur), t, cur)
    return merged


def _resume_single(spec: Spec, saved: dict[str, dict[str, torch.Tensor]], saved_steps: int) -> dict:
    """One process: load the saved optimizer state (and weights via the masters), then train one more step."""
    from tests.parallel.test_pipeline_model import param_entries

    state, chunks, opt = setup(spec)
    opt.load_sharded_state(saved, step=saved_steps)
    loss, _ = train_step(state, chunks, opt, spec, saved_steps)
    return dict(loss=loss, params={n: t for n, (t, _) in param_entries(state, chunks).items()})


def test_optimizer_state_in_global_shape_reshards_to_one_process() -> None:
    sharded = _merge(run_distributed(_global_state, 4, SHARD_SPEC))
    single_spec = Spec(**{**SHARD_SPEC.__dict__, "tp": 1, "dist_opt": False, "micro": 4})
    reference = _global_state(single_spec)
    assert sharded.keys() == reference.keys()
    for name in reference:
        assert set(sharded[name]) == {"master", "exp_avg", "exp_avg_sq"}
        for key in reference[name]:
            assert not torch.isnan(sharded[name][key]).any(), f"{name}.{key} not fully covered by the shards"
            torch.testing.assert_close(sharded[name][key], reference[name][key], rtol=2e-5, atol=2e-6)
    # resume the tp2·dp2 distributed state in one process and compare with an uninterrupted 3-step run
    resumed = _resume_single(single_spec, sharded, SHARD_SPEC.steps)
    straight = run_distributed(_straight, 1, Spec(**{**single_spec.__dict__, "steps": 3}))[0]
    torch.testing.assert_close(torch.tensor(resumed["loss"]), torch.tensor(straight["loss"]), rtol=2e-5, atol=2e-6)
    for n, t in straight["params"].items():
        torch.testing.assert_close(resumed["params"][n], t, rtol=2e-5, atol=2e-6)


def _straight(spec: Spec) -> dict:
    from tests.parallel.test_pipeline_model import param_entries

    state, chunks, opt = setup(spec)
    loss: list[float] = []
    for step in range(spec.steps):
        loss, _ = train_step(state, chunks, opt, spec, step)
    return dict(loss=loss, params={n: t for n, (t, _) in param_entries(state, chunks).items()})


def test_global_grad_norm_matches_float64() -> None:
    """The multi-tensor norm equals the float64 norm of all elements (fp32 and bf16 gradients, empty lists)."""
    from mcore_parallel import Group
    from mcore_parallel.optim.clip import global_grad_norm

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(513, 7, generator=g) * 1e-3, torch.randn(10_000, generator=g) * 50,
             torch.randn(33, generator=g).bfloat16(), torch.zeros(4)]  # fmt: skip
    want = torch.cat([t.double().reshape(-1) for t in grads]).norm().item()
    assert abs(global_grad_norm(grads, Group.single()) - want) <= 1e-6 * want
    assert global_grad_norm([], Group.single()) == 0.0


def test_zero_count_only_when_asked() -> None:
    """step(count_zeros=False) skips the pass over the gradients; None follows the config; the count is exact."""
    from mcore_parallel import ParallelConfig, ParallelState
    from mcore_parallel.optim import OptimizerConfig, get_optimizer

    state = ParallelState.initialize(ParallelConfig())
    net = torch.nn.Linear(4, 3)
    opt = get_optimizer(OptimizerConfig(lr=0.1), [net], state)

    def grads() -> None:
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        net.weight.grad[0] = 0.0  # four zeros

    grads()
    assert opt.step(count_zeros=False).num_zeros is None
    grads()
    assert opt.step().num_zeros == 4  # log_num_zeros_in_grad defaults to True
    grads()
    assert opt.step(count_zeros=True).num_zeros == 4


def test_fused_adamw_skips_a_nonfinite_step_on_the_device() -> None:
    """step(skip_if_nonfinite=...): a nan loss or an inf gradient leaves weights, moments and Adam's step count as
    they were (the next update equals the first update of a fresh optimizer); only the fused AdamW offers it."""
    from mcore_parallel import ParallelConfig, ParallelState
    from mcore_parallel.optim import OptimizerConfig, get_optimizer

    state = ParallelState.initialize(ParallelConfig())

    def fresh(**kw: object) -> tuple[torch.nn.Linear, object]:
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        return net, get_optimizer(OptimizerConfig(lr=0.1, **kw), [net], state)  # type: ignore[arg-type]

    def grads(net: torch.nn.Linear, value: float = 1.0) -> None:
        for p in net.parameters():
            p.grad = torch.full_like(p, 0.5)
        net.weight.grad[0, 0] = value

    ref, ref_opt = fresh(fused=True)
    grads(ref)
    assert ref_opt.step(skip_if_nonfinite=torch.tensor(2.0)).skipped.item() == 0.0  # type: ignore[attr-defined]

    net, opt = fresh(fused=True)
    assert opt.skips_on_device  # type: ignore[attr-defined]
    before = [p.detach().clone() for p in net.parameters()]
    grads(net)
    assert opt.step(skip_if_nonfinite=torch.tensor(float("nan"))).skipped.item() == 1.0  # type: ignore[attr-defined]
    grads(net, float("inf"))
    assert opt.step(skip_if_nonfinite=torch.tensor(2.0)).skipped.item() == 1.0  # type: ignore[attr-defined]
    for p, b in zip(net.parameters(), before, strict=True):
        assert torch.equal(p, b)
    grads(net)
    opt.step(skip_if_nonfinite=torch.tensor(2.0))  # type: ignore[attr-defined]
    for p, r in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=0, atol=0)

    _, foreach = fresh(fused=False)
    assert not foreach.skips_on_device  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="needs the fused AdamW kernel"):
        foreach.step(skip_if_nonfinite=torch.tensor(2.0))  # type: ignore[attr-defined]
    _, sgd = fresh(fused=True, optimizer="sgd")
    assert not sgd.skips_on_device  # type: ignore[attr-defined]
