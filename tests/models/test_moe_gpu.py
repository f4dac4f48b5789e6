"""The MoE layer on a GPU: grouped GEMM against the per-expert loop, no host synchronisation in the dropless
one-rank forward and backward (so CUDA graphs can capture it), and compiled layers against eager ones."""

from __future__ import annotations

import pytest
import torch

from mcore_models import GPTModel, TransformerConfig
from mcore_models.moe import MoEConfig, grouped_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _config(model: dict[str, object] | None = None, **moe: object) -> TransformerConfig:
    fields = dict(num_experts=8, ffn_hidden_size=256, router_topk=2, aux_loss_coeff=1e-2)
    fields.update(moe)
    shape: dict[str, object] = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2)
    shape.update(model or {})
    return TransformerConfig(**shape, activation="swiglu", normalization="rmsnorm", position_embedding="rope",
                             add_bias_linear=False, vocab_size=512, params_dtype="bfloat16",
                             moe=MoEConfig(**fields))  # fmt: skip


def test_grouped_mm_matches_the_per_expert_loop_forward_and_backward() -> None:
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 17, 3, 40, 1, 0, 62], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 384, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = grouped_linear(x, w, counts)
    g = torch.randn_like(out)
    dx, dw = torch.autograd.grad(out, [x, w], g)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = grouped_linear(x32, w32, counts)  # float32: the loop path
    rdx, rdw = torch.autograd.grad(ref, [x32, w32], g.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(dx.float(), rdx, rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(dw.float(), rdw, rtol=2e-2, atol=5e-1)
    assert dw[1].abs().sum() == 0 and dw[6].abs().sum() == 0  # experts without rows get no gradient


def test_dropless_forward_and_backward_never_wait_for_the_gpu() -> None:
    torch.manual_seed(1)
    model = GPTModel(_config(), device="cuda")
    tokens = torch.randint(0, 512, (4, 128), device="cuda")
    model(tokens, labels=tokens).mean().backward()  # warm up (lazy inits may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(tokens, labels=tokens).mean().backward()
        model.eval()
        with torch.no_grad():
            model(tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _compiled_against_eager(config: TransformerConfig, tokens: torch.Tensor, tol: float, cosine: float) -> None:
    """The same weights in eager and compiled layers: the loss within ``tol``, layer 1's first expert weight's
    gradient at a cosine similarity above ``cosine``."""
    eager = GPTModel(config, device="cuda")
    compiled = GPTModel(config, device="cuda")
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_layers()
    a = eager(tokens, labels=tokens).mean()
    b = compiled(tokens, labels=tokens).mean()
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    ga = eager.decoder.layers["1"].mlp.experts.linear_fc1.weight.grad.float()
    gb = compiled.decoder.layers["1"].mlp.experts.linear_fc1.weight.grad.float()
    assert torch.nn.functional.cosine_similarity(ga.flatten(), gb.flatten(), dim=0) > cosine


def test_compiled_moe_layers_match_eager() -> None:
    torch.manual_seed(2)
    config = _config(shared_expert_ffn_hidden_size=128)
    _compiled_against_eager(config, torch.randint(0, 512, (2, 256), device="cuda"), 1e-2, 0.99)


FP8_EXPERTS = dict(fp8="hybrid", fp8_recipe="delayed", fp8_modules=("qkv", "proj", "fc1", "fc2", "experts"),
                   fp8_first_layers_bf16=0, fp8_last_layers_bf16=0)  # fmt: skip


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs compute capability 9.0"
)
def test_compiled_fp8_experts_match_eager() -> None:
    """FP8 routed experts inside compiled layers at moe-8x4k's widths (hidden 2048, 8 experts of ffn 4096), the
    case ``bench/run.py train-fp8-moe`` runs; the FP8 cast kernel, which inductor launches from this graph with its
    ``fmax`` typed float64, once failed Triton's compilation (``test_fp8_swiglu.py`` checks that on the CPU)."""
    shape = dict(num_layers=2, hidden_size=2048, num_attention_heads=16, num_query_groups=8, **FP8_EXPERTS)
    torch.manual_seed(3)
    config = _config(shape, ffn_hidden_size=4096)
    _compiled_against_eager(config, torch.randint(0, 512, (2, 2048), device="cuda"), 2e-2, 0.98)
