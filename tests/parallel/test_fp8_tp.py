"""FP8 column/row-parallel linears at tp 2 and 4 (with and without sequence parallelism, the FP8 all-gather on and
off) on gloo against the same FP8 layer in one process: outputs, input, weight and bias gradients over two optimizer
steps (so delayed scaling runs from its history in the second), and the delayed-scaling histories themselves.

The ranks scale every tensor like the one process that holds it whole (absolute maxima reduced over the group), so
the FP8 operands are the same and only the fp32 summation order of split contractions differs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.fp8 import Fp8ColumnParallelLinear, Fp8Recipe, Fp8RowParallelLinear, fp8_step
from mcore_parallel.tensor import allreduce_sequence_parallel_grads
from mcore_parallel.testing import run_distributed

S, B, IN, OUT = 8, 3, 64, 64
RECIPES = {
    "hybrid": Fp8Recipe("hybrid"),
    "hybrid-delayed": Fp8Recipe("hybrid", "delayed", amax_history_len=3),
    "e4m3-rowwise": Fp8Recipe("e4m3", "rowwise"),
}
TOL = dict(rtol=2e-5, atol=2e-6)


def _pieces(kind: str, tp: Group, sp: bool) -> dict[str, Any]:
    """Functions cutting the one-process tensors to this rank's pieces."""
    r, n = tp.rank, tp.size

    def seq(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(n, 0)[r] if sp else t

    def last(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(n, -1)[r]

    if kind == "column":
        return dict(x=seq, y=last, dx=seq, dw=lambda t: t.chunk(n, 0)[r], db=last)
    return dict(x=last, y=seq, dx=last, dw=last, db=lambda t: t)


def _compare(kind: str, recipe: Fp8Recipe, tp_group: Group, sp: bool) -> None:
    cls = Fp8ColumnParallelLinear if kind == "column" else Fp8RowParallelLinear
    ref = cls(IN, OUT, tp=Group.single(), bias=True, recipe=recipe, seed=5)
    layer = cls(IN, OUT, tp=tp_group, bias=True, recipe=recipe, seed=5, sequence_parallel=sp)
    assert ref.runs_fp8 and layer.runs_fp8
    cut = _pieces(kind, tp_group, sp)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        ref.bias.normal_(generator=gen)
        layer.bias.copy_(cut["db"](ref.bias))
    for step in range(2):
        x = torch.randn(S, B, IN, generator=gen) * (1 + step)
        g = torch.randn(S, B, OUT, generator=gen)
        xr, xl = x.clone().requires_grad_(), cut["x"](x).clone().requires_grad_()
        with fp8_step([ref]):
            yr = ref(xr)
            yr.backward(g)
        with fp8_step([layer], tp_group):
            yl = layer(xl)
            yl.backward(cut["y"](g))
        allreduce_sequence_parallel_grads(layer, tp_group)  # a row-parallel bias sees its sequence chunk under SP
        what = f"{kind} sp={sp} allgather={recipe.allgather} step {step}"
        pairs = {"output": (yl, cut["y"](yr)), "dx": (xl.grad, cut["dx"](xr.grad)),
                 "dW": (layer.weight.grad, cut["dw"](ref.weight.grad)), "db": (layer.bias.grad, cut["db"](ref.bias.grad))}  # fmt: skip
        for part, (actual, expected) in pairs.items():
            torch.testing.assert_close(actual, expected, **TOL, msg=lambda m, w=f"{what} {part}": f"{w}: {m}")
        with torch.no_grad():  # the same SGD update of both
            for p in (*ref.parameters(), *layer.parameters()):
                p -= 0.1 * p.grad
                p.grad = None
    if recipe.delayed:
        torch.testing.assert_close(layer.fp8_scaling.amax_history, ref.fp8_scaling.amax_history, rtol=0, atol=0)
        torch.testing.assert_close(layer.fp8_scaling.scale, ref.fp8_scaling.scale, rtol=0, atol=0)
        assert (ref.fp8_scaling.amax_history[:2] > 0).all()  # both steps recorded


def _run(tp: int, name: str) -> None:
    for sp, allgather in ((False, False), (True, False), (True, True)):
        state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
        recipe = dataclasses.replace(RECIPES[name], allgather=allgather)
        for kind in ("column", "row"):
            _compare(kind, recipe, state.tp, sp)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_layers_under_tp_match_one_process(tp: int, name: str) -> None:
    run_distributed(_run, tp, tp, name)


def _delayed_over_data_parallel() -> list[float]:
    """Each rank trains on its own data: the histories, reduced over the group, hold the largest maximum of any
    rank, so every rank keeps the same scales."""
    state = ParallelState.initialize(ParallelConfig(tp=1))
    world = torch.distributed.group.WORLD
    group = Group("dp", tuple(range(state.world_size)), state.rank, world)
    layer = Fp8RowParallelLinear(IN, OUT, tp=Group.single(), recipe=RECIPES["hybrid-delayed"], seed=5)
    x = torch.full((S, B, IN), float(state.rank + 1))
    with fp8_step([layer], group):
        layer(x.requires_grad_()).sum().backward()
    return layer.fp8_scaling.amax_history[0].tolist()


def test_delayed_histories_reduced_over_the_group() -> None:
    histories = run_distributed(_delayed_over_data_parallel, 2)
    assert histories[0] == histories[1]
    assert histories[0][0] == 2.0  # the input maximum of rank 1 (all twos), the larger one
