"""The MoE layer across ranks (gloo on CPU) against one process on every token: expert parallelism 2 and 4 through
the all-to-all and the all-gather dispatchers, with data parallelism, and with tensor + sequence parallelism (expert
tensor parallelism 1 and 2). Each rank's output must equal the one-process output of its tokens, and each
parameter's gradient, summed over the ranks that share it, the one-process gradient of its piece."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_models import TransformerConfig
from mcore_models.moe import MoEConfig, MoELayer
from mcore_models.spec import default_spec
from mcore_models.transformer.context import ModelContext
from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.testing import run_distributed

S, B, H = 8, 4, 16  # global sequence, global batch, hidden


def _config(**moe: object) -> TransformerConfig:
    fields = dict(num_experts=8, ffn_hidden_size=12, router_topk=2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    fields.update(moe)
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, activation="swiglu",
                             normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
                             swiglu_backward="torch", moe=MoEConfig(**fields))  # fmt: skip


def _layer(config: TransformerConfig, ctx: ModelContext) -> MoELayer:
    layer = MoELayer(config, ctx, default_spec(), "decoder.layers.0.mlp").double()
    layer.aux_loss_scale.fill_(0.5)
    return layer


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    return x, torch.randn(S, B, H, generator=g, dtype=torch.float64)


def _reference(config: TransformerConfig, batch: slice) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One process on one data-parallel rank's micro-batch (its own load-balancing losses): output, gradients,
    the logged losses."""
    layer = _layer(config, ModelContext(Group.single()))
    x, g = _inputs()
    x = x[:, batch].clone().requires_grad_(True)
    out = layer(x)
    out.backward(g[:, batch])
    grads = {n: p.grad for n, p in layer.named_parameters()}
    grads["x"] = x.grad
    return out.detach(), grads, layer.stats[:2].clone()


def _run(config: TransformerConfig, parallel: ParallelConfig) -> None:
    state = ParallelState.initialize(parallel)
    b = B // state.dp_size
    refs = [_reference(config, slice(d * b, (d + 1) * b)) for d in range(state.dp_size)]
    ref_out, ref_x_grad = refs[state.dp.rank][0], refs[state.dp.rank][1]["x"]
    ref_grads = {n: sum(r[1][n] for r in refs) for n in refs[0][1]}
    sp = state.sequence_parallel
    ctx = ModelContext(state.tp, sp, None, None, config.seed, ep=state.ep, expert_tp=state.expert_tp,
                       balance=state.tp_dp_cp)  # fmt: skip
    layer = _layer(config, ctx)
    x, g = _inputs()
    batch = slice(state.dp.rank * b, (state.dp.rank + 1) * b)
    s = S // state.tp.size if sp else S
    seq = slice(state.tp.rank * s, (state.tp.rank + 1) * s) if sp else slice(0, S)
    mine = x[seq, batch].clone().requires_grad_(True)
    out = layer(mine)
    torch.testing.assert_close(out.detach(), ref_out[seq], rtol=1e-10, atol=1e-12)
    out.backward(g[seq, batch])
    torch.testing.assert_close(mine.grad, ref_x_grad[seq], rtol=1e-9, atol=1e-11)
    # the router is replicated: the ranks' gradients (each from its own tokens) add up to the full one
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)
    torch.testing.assert_close(router, ref_grads["router.weight"], rtol=1e-9, atol=1e-11)
    # experts: this rank's experts and expert-tp share, summed over the expert-data-parallel replicas
    e_local, first = layer.experts.num_local, layer.experts.first
    etp = state.expert_tp
    for name, dim in (("experts.linear_fc1.weight", 1), ("experts.linear_fc2.weight", 2)):
        grad = dict(layer.named_parameters())[name].grad.clone()
        if state.expert_dp.size > 1:
            dist.all_reduce(grad, group=state.expert_dp.pg)
        want = ref_grads[name][first : first + e_local]
        if etp.size > 1:
            blocks = want.chunk(2, dim) if dim == 1 else (want,)  # [gate; up] split with stride 2
            want = torch.cat([blk.chunk(etp.size, dim)[etp.rank] for blk in blocks], dim)
        torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-11)
    # the logged losses are each rank's share: summed over the ranks of one micro-batch they are its full losses
    stats = layer.stats[:2].clone()
    dist.all_reduce(stats)
    torch.testing.assert_close(stats, sum(r[2] for r in refs))


CASES = {
    "ep2": (2, ParallelConfig(ep=2), {}),
    "ep2-allgather": (2, ParallelConfig(ep=2), dict(token_dispatcher="allgather")),
    "ep4": (4, ParallelConfig(ep=4), {}),
    "ep2-dp2": (4, ParallelConfig(ep=2), dict(shared_expert_ffn_hidden_size=8)),
    "tp2-sp-ep2-etp1": (4, ParallelConfig(tp=2, ep=2, expert_tp=1, sequence_parallel=True), {}),
    "tp2-sp-etp2": (2, ParallelConfig(tp=2, sequence_parallel=True), dict(shared_expert_ffn_hidden_size=8)),
    "tp2-sp-etp2-ep2": (4, ParallelConfig(tp=2, ep=2, sequence_parallel=True), dict(token_dispatcher="allgather")),
    "ep2-capacity": (2, ParallelConfig(ep=2), dict(capacity_factor=1.0)),
    "ep2-padded": (2, ParallelConfig(ep=2), dict(capacity_factor=1.0, pad_expert_input_to_capacity=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layer_across_ranks_equals_one_process(name: str) -> None:
    world, parallel, moe = CASES[name]
    run_distributed(_run, world, _config(**moe), parallel)
