"""Gradient clipping without a host synchronisation on a GPU: the fused AdamW kernel divides each gradient by the
``grad_scale`` tensor (1 / clip factor) as it reads it; parameters equal clipping the gradients first (the path of
non-fused kernels). Run through the device tool, skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _train(fused_clip: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[float]]:
    from mcore_models import GPTModel
    from mcore_parallel import ParallelState
    from mcore_parallel.ddp import DDPConfig, DistributedDataParallel
    from mcore_parallel.optim import MixedPrecisionOptimizer, OptimizerConfig, get_optimizer
    from tests._model_configs import llama

    if not fused_clip:
        monkeypatch.setattr(MixedPrecisionOptimizer, "_fused_kernel", lambda self: False)
    torch.manual_seed(0)
    state = ParallelState.initialize(device=torch.device("cuda"))
    model = GPTModel(llama(params_dtype="bfloat16"), device="cuda").train()
    ddp = DistributedDataParallel(model, state, DDPConfig())
    opt = get_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.05), [ddp], state)
    assert opt._fused_kernel() is fused_clip
    tokens = torch.randint(0, 100, (2, 16), device="cuda")
    norms = []
    for _ in range(3):
        opt.zero_grad()
        ddp(tokens, labels=tokens).float().mean().backward()
        ddp.finish_grad_sync()
        result = opt.step()
        assert isinstance(result.grad_norm_tensor, torch.Tensor)
        norms.append(result.grad_norm)
        if fused_clip:
            assert isinstance(opt.optimizer.grad_scale, torch.Tensor)  # type: ignore[union-attr]
    return [m.detach().clone() for m in opt.master_params()], norms


def test_fused_clip_equals_clipping_the_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    fused, fused_norms = _train(True, monkeypatch)
    with monkeypatch.context() as m:
        plain, plain_norms = _train(False, m)
    assert all(n > 0.05 for n in plain_norms)  # every step clipped
    assert fused_norms == pytest.approx(plain_norms, rel=1e-4)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
