"""GPTModel behaviour: config validation, parameter counts, recompute, pipeline stages, meta device."""

from __future__ import annotations

from typing import Any
from unittest.mock import patch

import pytest
import torch

from mcore_models import ConfigError, GPTModel, TransformerConfig, num_parameters, preset, training_flops_per_token
from mcore_models.transformer.context import ModelContext
from mcore_parallel import Group
from mcore_parallel.tensor import model_parallel_seed
from tests._model_configs import gpt2, llama


def test_invalid_config_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as exc:
        TransformerConfig(hidden_size=30, num_attention_heads=4, num_query_groups=3, activation="relu",
                          hidden_dropout=1.5, recompute_num_layers=2, attention_backend="flash3")  # fmt: skip
    text = str(exc.value)
    for expected in ("hidden_size=30 is not divisible by num_attention_heads=4", "num_attention_heads=4 is not "
                     "divisible by num_query_groups=3", "activation='relu' is not one of", "hidden_dropout=1.5",
                     "recompute_num_layers=2 needs recompute='full'",
                     "attention_backend='flash3' is not one of auto, flash, cudnn, efficient, math"):  # fmt: skip
        assert expected in text
    assert len(exc.value.problems) == 6 and isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(recompute="selective", recompute_modules=("mlp", "norms")),
         "recompute_modules=['mlp', 'norms'] has unknown entries ['norms']; use some of core_attn, mlp"),
        (dict(recompute="selective", recompute_modules=()), "recompute_modules is empty with recompute='selective'"),
        (dict(recompute="full", recompute_modules=("mlp",)),
         "recompute_modules=['mlp'] needs recompute='selective' (recompute='full')"),
        (dict(recompute="selective", recompute_modules="mlp"), "recompute_modules='mlp' must be a list of names"),
    ],
)  # fmt: skip
def test_recompute_modules_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        llama(**kwargs)
    assert message in str(exc.value)


def test_mlp_recompute_needs_a_dense_mlp() -> None:
    """``mlp`` names the dense MLPs (Megatron's meaning): a model whose every MLP is a mixture of experts, or a
    hybrid pattern without ``-``, is refused instead of recomputing nothing."""
    from mcore_models import MambaConfig
    from mcore_models.moe import MoEConfig

    sel = dict(recompute="selective", recompute_modules=("mlp",), add_bias_linear=False)
    with pytest.raises(ConfigError, match="every MLP of this model is a mixture of experts"):
        llama(**sel, moe=MoEConfig(num_experts=4, router_topk=2))
    assert llama(**sel, moe=MoEConfig(num_experts=4, router_topk=2, layer_freq=2)).recompute_mlp  # dense layers too
    hybrid = dict(sel, mamba=MambaConfig(d_state=16, head_dim=8, chunk_size=8), num_layers=2)
    with pytest.raises(ConfigError, match="mlp would recompute nothing"):
        llama(**hybrid, hybrid_pattern="M*")
    assert llama(**hybrid, hybrid_pattern="M-").recompute_mlp


def test_recompute_modules_from_a_list() -> None:
    cfg = llama(recompute="selective", recompute_modules=["mlp"])
    assert cfg.recompute_modules == ("mlp",) and cfg.recompute_mlp and not cfg.recompute_attention
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg


def test_tp_specific_problems() -> None:
    cfg = llama(num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ConfigError) as exc:
        GPTModel(cfg, tp=Group("tp", (0, 1, 2, 3), 0), device="meta")
    assert "num_query_groups=2 is not divisible by the tensor-parallel size 4" in str(exc.value)
    assert "ffn_hidden_size=48" not in str(exc.value)


@pytest.mark.parametrize(
    "config",
    [
        llama(num_query_groups=4),
        llama(num_query_groups=4, share_embeddings_and_output_weights=True, qk_layernorm=True),
        gpt2(),
        gpt2(add_bias_linear=False, normalization="rmsnorm"),
    ],
    ids=["llama", "llama-tied-qknorm", "gpt2", "gpt2-nobias-rms"],
)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parameter_count_matches_the_formula(config: TransformerConfig, tp: int) -> None:
    total = 0
    for rank in range(tp):  # TP-split parameters add up over ranks; replicated ones count once
        model = GPTModel(config, tp=Group("tp", tuple(range(tp)), rank), device="meta")
        total += sum(p.numel() for p in model.parameters() if getattr(p, "tensor_model_parallel", False) or rank == 0)
    assert total == num_parameters(config, tp_size=tp)


def test_presets_and_flops() -> None:
    cfg = preset("llama-1b")
    assert abs(training_flops_per_token(cfg, 4096) / 1e9 - 7.05) < 0.01  # the figure quoted in the speed issue
    assert num_parameters(preset("gpt2-124m"), include_padding=False) == 124_439_808  # GPT-2 small's known size
    with pytest.raises(KeyError, match="unknown preset 'gpt5'"):
        preset("gpt5")
    for name in ("gpt2-350m", "llama3-8b", "llama3-70b"):
        model = GPTModel(preset(name).replace(num_layers=1), device="meta")
        assert all(p.is_meta for p in model.parameters())


def _grads(model: GPTModel, ids: torch.Tensor, labels: torch.Tensor, tracker_seed: int | None) -> dict:
    tracker = None
    if tracker_seed is not None:
        tracker = model_parallel_seed(tracker_seed)
        model.ctx = type(model.ctx)(model.ctx.tp, False, tracker, None, model.ctx.seed)
        for m in model.modules():
            if hasattr(m, "ctx"):
                m.ctx = model.ctx
    model.zero_grad()
    loss = model(ids, labels=labels)
    loss.mean().backward()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


RECOMPUTES = [
    ("selective", None, ("core_attn",)),
    ("selective", None, ("mlp",)),
    ("selective", None, ("core_attn", "mlp")),
    ("selective", 1, ("core_attn", "mlp")),
    ("full", None, ("core_attn",)),
    ("full", 1, ("core_attn",)),
]


@pytest.mark.parametrize("recompute,num,modules", RECOMPUTES, ids=[f"{r}-{n}-{'+'.join(m)}" for r, n, m in RECOMPUTES])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_recompute_gives_the_same_gradients(
    recompute: str, num: int | None, modules: tuple[str, ...], dropout: float
) -> None:
    base = llama(num_layers=3, attention_dropout=dropout, hidden_dropout=dropout)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = _grads(GPTModel(base).train(), ids, labels, 5 if dropout else None)
    calls = []
    real = ModelContext.recompute

    def counted(self: ModelContext, fn: Any, *args: Any) -> torch.Tensor:
        calls.append(type(fn).__name__)
        return real(self, fn, *args)

    cfg = base.replace(recompute=recompute, recompute_num_layers=num, recompute_modules=modules)
    with patch.object(ModelContext, "recompute", counted):
        other = _grads(GPTModel(cfg).train(), ids, labels, 5 if dropout else None)
    if recompute == "selective":  # each named part of each of the 3 layers (MLPs: of the first num) recomputed
        assert sorted(set(calls)) == sorted({"core_attn": "SDPACoreAttention", "mlp": "_NormMLP"}[m] for m in modules)
        assert calls.count("SDPACoreAttention") == 3 * ("core_attn" in modules)
        assert calls.count("_NormMLP") == (num or 3) * ("mlp" in modules)
    for k in ref:
        torch.testing.assert_close(other[k], ref[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_chain_to_the_full_model(tied: bool) -> None:
    config = llama(num_layers=4, share_embeddings_and_output_weights=tied)
    full = GPTModel(config)
    stages = [
        GPTModel(config, pre_process=True, post_process=False, layers=range(0, 1)),
        GPTModel(config, pre_process=False, post_process=False, layers=range(1, 3)),
        GPTModel(config, pre_process=False, post_process=True, layers=range(3, 4)),
    ]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(set(names)) == sorted(n for n, _ in full.named_parameters()) + (
        ["output_layer.weight"] if tied else []
    )
    if tied:  # the last stage's copy of the embedding starts identical and is marked for the embedding-group sync
        assert torch.equal(stages[2].output_layer.weight, stages[0].embedding.word_embeddings.weight)
        assert (
            stages[2].output_layer.weight.shared_embedding
            and stages[0].embedding.word_embeddings.weight.shared_embedding
        )
    ids = torch.randint(0, 100, (2, 8))
    labels = torch.randint(0, 100, (2, 8))
    h = stages[0](ids)
    stages[1].set_input_tensor(h)
    h = stages[1](None)
    stages[2].set_input_tensor(h)
    torch.testing.assert_close(stages[2](None, labels=labels), full(ids, labels=labels), rtol=0, atol=0)
    keys = {info.key for s in stages for info in s.sharded_state_dict().values()}
    assert keys == set(full.global_state_dict())


def test_bf16_model_runs_and_stays_bf16() -> None:
    model = GPTModel(llama(params_dtype="bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    loss = model(torch.randint(0, 100, (2, 8)), labels=torch.randint(0, 100, (2, 8)))
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    loss.mean().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_attention_backends_agree_on_gpu(backend: str) -> None:
    """Each SDPA kernel, forced by attention_backend, gives the math kernel's loss and gradients (bf16 noise)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = llama(num_attention_heads=4, num_query_groups=2, hidden_size=256, params_dtype="bfloat16")
    ids = torch.randint(0, cfg.vocab_size, (2, 33), device="cuda")
    out = {}
    for name in ("math", backend):
        model = GPTModel(cfg.replace(attention_backend=name), device="cuda")
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        out[name] = (
            loss.float(),
            next(iter(model.decoder.layers.values())).self_attention.linear_qkv.weight.grad.float(),
        )
    torch.testing.assert_close(out[backend][0], out["math"][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[backend][1], out["math"][1], rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_compiled_loss_equals_the_eager_loss(dtype: torch.dtype) -> None:
    """``compile_layers`` also compiles the one-rank training loss: same per-token loss and gradients (vocabulary
    padded: 250 real columns of 256)."""
    cfg = llama(vocab_size=250, make_vocab_size_divisible_by=128, params_dtype="float32")
    torch.manual_seed(0)
    eager = GPTModel(cfg).to(dtype).train()
    compiled = GPTModel(cfg).to(dtype).train()
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    compiled.compile_layers()
    assert compiled._compiled_loss is not None
    loss_calls = []
    compiled_loss = compiled._compiled_loss

    def counted(*a: torch.Tensor | int) -> torch.Tensor:
        loss_calls.append(1)
        return compiled_loss(*a)

    compiled._compiled_loss = counted
    tokens = torch.randint(0, 250, (2, 12))
    labels = torch.randint(0, 250, (2, 12))
    losses = []
    for model in (eager, compiled):
        loss = model(tokens, labels=labels)
        loss.float().mean().backward()
        losses.append(loss.detach())
    assert losses[0].dtype == losses[1].dtype == torch.float32 and losses[0].shape == (2, 12)
    assert loss_calls == [1]  # the compiled model's loss went through the compiled function
    tol = 1e-5 if dtype == torch.float64 else 2e-2  # the loss math runs in float32 on both paths
    torch.testing.assert_close(losses[1], losses[0], atol=tol, rtol=tol)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad.float(), a.grad.float(), atol=tol * 10, rtol=tol * 10, msg=name)


def test_contiguous_attention_inputs_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_models.transformer import attention as attention_module

    seen: list[bool] = []
    sdpa = attention_module.F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        seen.append(q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(5)
    a = GPTModel(llama()).double().train()
    b = GPTModel(llama(attention_contiguous=True)).double().train()
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, 100, (2, 10))
    losses = []
    for m in (a, b):
        loss = m(tokens, labels=tokens)
        loss.mean().backward()
        losses.append(loss.detach())
    assert seen == [False, False, True, True]  # views by default, contiguous tensors with the option (2 layers)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=1e-12)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-10, atol=1e-12, msg=name)
