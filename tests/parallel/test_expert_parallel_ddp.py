"""Expert-parallel parameters through DDP and the optimizers, against a float64 single-process reference of the
global mean loss: reduced gradients (dense over dp_cp, experts summed over expert_dp and divided by dp_cp), the
gradient norm and zero count (every distinct element once), clipping and Adam steps, with and without the
distributed optimizer, NCCL-style collectives and the p2p exchange, and the setup broadcast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mcore_parallel import ParallelState
from mcore_parallel.ddp import DDPConfig, DistributedDataParallel
from mcore_parallel.optim import MixedPrecisionOptimizer, OptimizerConfig, get_optimizer
from mcore_parallel.testing import run_distributed
from tests.parallel.moe_toy import (
    EXPERT_KEYS,
    FC1,
    E,
    H,
    ToyMoE,
    config,
    full_weights,
    local_piece,
    piece_of,
    reference_grads,
    reference_loss,
    tokens,
)

# (world, ep, expert_tp): expert_dp = world / (ep * expert_tp) with tp = 1
LAYOUTS = {
    "w2-ep2": (2, 2, None),
    "w2-ep1": (2, 1, None),  # expert groups = dense groups
    "w4-ep2": (4, 2, None),  # expert_dp = 2
    "w4-ep4": (4, 4, None),
    "w4-ep2-etp2": (4, 2, 2),
    "w4-ep1-etp2": (4, 1, 2),  # expert_dp = 2, expert TP split
}


def _grads(ep: int, etp: int | None, ddp_config: DDPConfig) -> dict:
    state = ParallelState.initialize(config(ep, etp))
    model = ToyMoE(state, full_weights())
    ddp = DistributedDataParallel(model, state, ddp_config)
    x = tokens(0, state.dp_cp.size)[state.dp_cp.rank].float()
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        ddp(x).backward()  # accumulated, then the last micro-batch reduces
    ddp(x).backward()
    ddp.finish_grad_sync()
    ref = reference_grads(full_weights(), tokens(0, state.dp_cp.size))
    owned = _owned(ddp)
    wrong = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "main_grad"), name
            continue
        want = 2 * piece_of(state, name, ref[name]).float().reshape(-1)
        got, mask = p.main_grad.reshape(-1), owned[name]
        if not torch.allclose(got[mask], want[mask], rtol=1e-4, atol=1e-6):
            wrong.append((name, (got[mask] - want[mask]).abs().max().item()))
    kinds = sorted((buf.group.kind, buf.scale) for buf in ddp.grad_buffers)
    return dict(wrong=wrong, kinds=kinds, expert_dp=state.expert_dp.size, dp_cp=state.dp_cp.size)


def _owned(ddp: DistributedDataParallel) -> dict[str, torch.Tensor]:
    """Per parameter, the flat elements whose reduced gradient this rank holds (all, or its distributed shard)."""
    out = {}
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    for buf in ddp.grad_buffers:
        for bucket in buf.buckets:
            lo, hi = bucket.shard_range(buf.group.rank, buf.dp) if buf.distributed_optimizer else (0, buf.numel)
            for p in bucket.params:
                start, end = buf.ranges[p]
                index = torch.arange(start, end)
                out[names[id(p)]] = (index >= lo) & (index < hi)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reduced_grads_match_reference(layout: str) -> None:
    world, ep, etp = LAYOUTS[layout]
    cfg = DDPConfig(bucket_size=40, overlap_grad_reduce=world == 4)
    for out in run_distributed(_grads, world, ep, etp, cfg):
        assert not out["wrong"], out["wrong"]
        assert out["kinds"] == sorted([("dp_cp", 1 / out["dp_cp"]), ("expert_dp", 1 / out["dp_cp"])])


@pytest.mark.parametrize("dist_opt", [False, True])
def test_reduced_grads_p2p_exchange(dist_opt: bool) -> None:
    cfg = DDPConfig(bucket_size=None, exchange="p2p", use_distributed_optimizer=dist_opt)
    for out in run_distributed(_grads, 4, 2, None, cfg):
        assert not out["wrong"], out["wrong"]


def test_reduced_grads_distributed_optimizer_shards() -> None:
    cfg = DDPConfig(bucket_size=30, use_distributed_optimizer=True)
    for out in run_distributed(_grads, 4, 2, None, cfg):
        assert not out["wrong"], out["wrong"]


def _train(ep: int, etp: int | None, dist_opt: bool, exchange: str, steps: int = 2) -> dict:
    state = ParallelState.initialize(config(ep, etp))
    model = ToyMoE(state, full_weights())
    ddp = DistributedDataParallel(
        model, state, DDPConfig(bucket_size=50, use_distributed_optimizer=dist_opt, exchange=exchange)
    )
    opt = get_optimizer(
        OptimizerConfig(lr=1e-2, clip_grad=0.05, adam_eps=1e-6, use_distributed_optimizer=dist_opt), [ddp], state
    )
    results = []
    for step in range(steps):
        opt.zero_grad()
        ddp(tokens(step, state.dp_cp.size)[state.dp_cp.rank].float()).backward()
        ddp.finish_grad_sync()
        r = opt.step(count_zeros=True)
        assert r.success
        results.append((r.grad_norm, r.num_zeros))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(results=results, params=params, state=(state.ep.rank, state.ep.size, state.expert_tp.rank,
                                                        state.expert_tp.size, state.dp_cp.size))  # fmt: skip


def _reference_training(dp: int, steps: int = 2) -> dict:
    """AdamW in float64 on the full weights with the same clipping, weight-decay groups and data."""
    w = {k: v.clone().requires_grad_(k != "router.expert_bias") for k, v in full_weights().items()}
    decay = [w[k] for k in w if w[k].requires_grad and w[k].dim() >= 2 and not k.endswith("bias")]
    plain = [w[k] for k in w if w[k].requires_grad and not any(w[k] is d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": plain, "weight_decay": 0.0}],
                            lr=1e-2, eps=1e-6)  # fmt: skip
    results = []
    for step in range(steps):
        opt.zero_grad()
        reference_loss(w, tokens(step, dp)).backward()
        grads = [p.grad for p in w.values() if p.grad is not None]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads)).item()
        zeros = sum(int((g == 0).sum()) for g in grads)
        torch.nn.utils.clip_grad_norm_([p for p in w.values() if p.grad is not None], 0.05)
        opt.step()
        results.append((norm, zeros))
    return dict(results=results, params={k: v.detach() for k, v in w.items()})


@pytest.mark.parametrize("dist_opt", [False, True], ids=["plain", "distopt"])
@pytest.mark.parametrize("layout", ["w2-ep2", "w2-ep1", "w4-ep2", "w4-ep2-etp2", "w4-ep1-etp2"])
def test_norm_zeros_and_adam_steps_match_reference(layout: str, dist_opt: bool) -> None:
    world, ep, etp = LAYOUTS[layout]
    outs = run_distributed(_train, world, ep, etp, dist_opt, "nccl")
    _check_training(outs, world)


def test_distributed_optimizer_p2p_matches_reference() -> None:
    _check_training(run_distributed(_train, 4, 2, None, True, "p2p"), 4)


def _check_training(outs: list[dict], dp: int) -> None:
    ref = _reference_training(dp)
    expert_zeros = full_weights()[FC1][0].numel() + full_weights()["experts.linear_fc2.weight"][0].numel()
    assert ref["results"][0][1] >= expert_zeros, "expert 0 should have zero gradients"
    for out in outs:
        for (norm, zeros), (rnorm, rzeros) in zip(out["results"], ref["results"]):
            assert norm > 0.05, "clipping was not exercised"
            assert norm == pytest.approx(rnorm, rel=1e-5), (norm, rnorm)
            assert zeros == rzeros, (zeros, rzeros)
        ep_rank, ep_size, tp_rank, tp_size, _ = out["state"]
        for name, p in out["params"].items():
            if name in EXPERT_KEYS:
                want = local_piece(name, ref["params"][name], (ep_rank, ep_size), (tp_rank, tp_size))
            else:
                want = ref["params"][name]
            torch.testing.assert_close(p.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _broadcast(ep: int) -> list[str]:
    state = ParallelState.initialize(config(ep))
    model = ToyMoE(state, full_weights())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(state.rank)  # every rank different
    DistributedDataParallel(model, state).broadcast_params()
    wrong = []
    for name, p in model.named_parameters():
        src = state.expert_dp.ranks[0] if name in EXPERT_KEYS else state.dp_cp.ranks[0]
        if not torch.equal(p, piece_of(state, name, full_weights()[name]).float() + src):
            wrong.append(name)
    return wrong


def test_broadcast_params_expert_over_expert_dp() -> None:
    for wrong in run_distributed(_broadcast, 4, 2):
        assert not wrong, f"not broadcast from the first rank of their data-parallel group: {wrong}"


def _norm_with_replicated_expert_tensor() -> tuple[float, int]:
    """ep=2, expert_tp=2 (world 4): a non-TP expert tensor is replicated over expert_tp and counted once."""
    state = ParallelState.initialize(config(2, 2))
    full, dense = torch.arange(E * H, dtype=torch.float32).reshape(E, H) - 7, torch.linspace(-1, 1, H)
    n = E // state.ep.size
    module = nn.Module()
    module.bias = nn.Parameter(full[state.ep.rank * n : (state.ep.rank + 1) * n].clone())
    module.bias.expert_parallel, module.bias.expert_shard = True, (state.ep.rank, state.ep.size)  # type: ignore[attr-defined]
    module.bias.global_shape = (E, H)  # type: ignore[attr-defined]
    module.dense = nn.Parameter(dense.clone())
    module.bias.grad, module.dense.grad = module.bias.detach().clone(), dense.clone()
    result = MixedPrecisionOptimizer([module], state, OptimizerConfig(clip_grad=0.0)).step(count_zeros=True)
    return result.grad_norm, result.num_zeros


def test_norm_counts_expert_tp_replicas_once() -> None:
    full, dense = torch.arange(E * H, dtype=torch.float64).reshape(E, H) - 7, torch.linspace(-1, 1, H).double()
    want = torch.sqrt(full.pow(2).sum() + dense.pow(2).sum()).item()
    for norm, zeros in run_distributed(_norm_with_replicated_expert_tensor, 4):
        assert norm == pytest.approx(want, rel=1e-6) and zeros == 1, (norm, want, zeros)
