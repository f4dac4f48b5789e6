"""``parallel.gradient_accumulation_fusion``: weight gradients go straight into ``main_grad``; training is unchanged."""

from __future__ import annotations

import pytest
import torch

from mcore_parallel import Group
from mcore_parallel.tensor import ColumnParallelLinear, RowParallelLinear
from mcore_parallel.testing import run_distributed
from mcore_train import pretrain
from tests.train._util import config


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_layer_accumulates_into_main_grad_and_marks_it(cls: type) -> None:
    torch.manual_seed(0)
    layer = cls(6, 5, tp=Group("tp", (0,), 0), bias=True).train()
    w = layer.weight
    w.main_grad = torch.full_like(w, 0.5)  # what DDP attaches (float32), holding an earlier micro-batch
    w.fuse_wgrad_accumulation = True
    xs = [torch.randn(4, 3, 6, requires_grad=True) for _ in range(2)]
    expected = torch.full_like(w, 0.5)
    for x in xs:
        y = layer(x)
        g = torch.randn_like(y)
        y.backward(g)
        expected += g.reshape(-1, 5).t() @ x.detach().reshape(-1, 6)
        assert w.grad_added_to_main_grad  # the placeholder in .grad must be ignored by the hook
        ref_x = torch.autograd.grad((torch.nn.functional.linear(x, w.detach(), None) * g).sum(), x)[0]
        torch.testing.assert_close(x.grad, ref_x)
        w.grad, w.grad_added_to_main_grad = None, False
    torch.testing.assert_close(w.main_grad, expected, rtol=1e-6, atol=1e-6)


def _losses(overrides: list[str]) -> list[float]:
    return pretrain(config(*overrides)).losses


def _losses_and_fused_calls(overrides: list[str]) -> tuple[list[float], int]:
    """The run's losses and how many weight gradients went straight into main_grad."""
    from mcore_parallel.tensor import mappings

    real, calls = mappings.weight_grad, [0]

    def counted(weight: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor, fuse: bool) -> torch.Tensor:
        calls[0] += int(fuse)
        return real(weight, g2, x2, fuse)

    mappings.weight_grad = counted  # type: ignore[assignment]
    try:
        return _losses(overrides), calls[0]
    finally:
        mappings.weight_grad = real  # type: ignore[assignment]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["model.share_embeddings_and_output_weights=true"],
        ["training.micro_batch_size=1"],
        ["training.compile=layers", "training.device=cpu"],
    ],
    ids=["untied", "tied", "accumulate-8", "compiled-layers"],
)
def test_training_is_unchanged(extra: list[str]) -> None:
    base = ["training.train_iters=4", *extra]
    plain, none = _losses_and_fused_calls([*base, "parallel.gradient_accumulation_fusion=false"])
    fused, calls = _losses_and_fused_calls([*base, "parallel.gradient_accumulation_fusion=true"])
    assert none == 0 and calls > 0
    assert fused == pytest.approx(plain, abs=1e-6)


def test_training_is_unchanged_under_tensor_and_sequence_parallelism() -> None:
    base = ["training.train_iters=3", "parallel.tp=2", "parallel.sequence_parallel=true"]
    plain = run_distributed(_losses, 2, base)[0]
    fused, calls = run_distributed(_losses_and_fused_calls, 2, [*base, "parallel.gradient_accumulation_fusion=true"])[0]
    assert calls > 0
    assert fused == pytest.approx(plain, abs=1e-6)
