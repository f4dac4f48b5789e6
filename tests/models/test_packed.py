"""Packed sequences (``GPTModel.forward(document_ids=...)``, :mod:`mcore_models.transformer.packed`): a row of several
documents gives every document the logits and gradients it gets alone through the unpacked model (float64), with
GQA, learned positions, qk-norm, recompute and compiled layers; tp2 (+ SP) and pp2 equal one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_models import GPTModel, TransformerConfig
from mcore_models.transformer.packed import document_mask, document_positions
from mcore_parallel import Group, ParallelConfig, ParallelState, shard_info
from mcore_parallel.tensor import allreduce_sequence_parallel_grads
from mcore_parallel.testing import run_distributed
from tests._model_configs import gpt2, llama

CONFIGS = {
    "llama-gqa": llama(num_attention_heads=8, num_query_groups=2, hidden_size=32),
    "llama-qknorm": llama(qk_layernorm=True),
    "gpt2": gpt2(),
}
LENGTHS = [[5, 7, 4], [16], [1, 9, 6]]  # three rows of 16 tokens: several documents, one, a one-token document


def _doc_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])


def _model(config: TransformerConfig, **kw: object) -> GPTModel:
    return GPTModel(config, **kw).double()  # type: ignore[arg-type]


def _grads(model: GPTModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_row_equals_each_document_alone(name: str) -> None:
    torch.manual_seed(0)
    config = CONFIGS[name]
    ids = torch.randint(0, config.vocab_size, (3, 16))
    labels = torch.randint(0, config.vocab_size, (3, 16))
    docs = _doc_ids(LENGTHS)
    packed = _model(config)
    alone = _model(config)
    with torch.no_grad():
        logits = packed(ids, document_ids=docs)
    loss = packed(ids, labels=labels, document_ids=docs)
    weights = torch.rand(3, 16, dtype=torch.float64)
    (loss * weights).sum().backward()
    for r, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            sl = slice(start, start + n)
            with torch.no_grad():
                torch.testing.assert_close(logits[r : r + 1, sl], alone(ids[r : r + 1, sl]), rtol=1e-10, atol=1e-10)
            (alone(ids[r : r + 1, sl], labels=labels[r : r + 1, sl]) * weights[r : r + 1, sl]).sum().backward()
            start += n
    got, want = _grads(packed), _grads(alone)
    assert got.keys() == want.keys() and got
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-9, atol=1e-10, msg=key)


def test_positions_restart_per_document() -> None:
    docs = _doc_ids(LENGTHS)
    pos = document_positions(docs)
    assert pos[0].tolist() == [*range(5), *range(7), *range(4)]
    assert pos[1].tolist() == list(range(16))
    assert pos[2].tolist() == [0, *range(9), *range(6)]


def test_dense_mask_is_block_diagonal_causal() -> None:
    mask = document_mask(_doc_ids([[2, 3]]), backend="dense").dense
    assert mask is not None and mask.shape == (1, 1, 5, 5)
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(mask[0, 0], want.bool())


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_of_packed_rows(recompute: str) -> None:
    torch.manual_seed(1)
    config = CONFIGS["llama-gqa"]
    ids = torch.randint(0, config.vocab_size, (3, 16))
    docs = _doc_ids(LENGTHS)
    plain, rec = _model(config), _model(dataclasses.replace(config, recompute=recompute))
    for m in (plain, rec):
        m(ids, labels=ids, document_ids=docs).sum().backward()
    got, want = _grads(rec), _grads(plain)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12, msg=key)


def test_flex_backend_equals_dense() -> None:
    """The CUDA path (compiled flex_attention with a document block mask) forward on CPU, against SDPA's mask; rows
    longer than one 128-token block."""
    torch.manual_seed(2)
    config = CONFIGS["llama-gqa"]
    config = dataclasses.replace(config, max_position_embeddings=512)
    ids = torch.randint(0, config.vocab_size, (2, 300))
    docs = _doc_ids([[100, 150, 50], [7, 200, 93]])
    model = GPTModel(config).eval()
    with torch.no_grad():
        dense = model(ids, document_ids=document_mask(docs, "dense"))
        flex = model(ids, document_ids=document_mask(docs, "flex"))
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)


def test_compiled_layers_with_flex_masks_do_not_recompile() -> None:
    """The CUDA configuration (compiled layers, a flex block mask per micro-batch) forward on CPU: new documents
    each micro-batch reuse the compiled layers."""
    torch.manual_seed(5)
    config = dataclasses.replace(CONFIGS["llama-gqa"], max_position_embeddings=512)
    ids = torch.randint(0, config.vocab_size, (2, 256))
    model, ref = GPTModel(config).eval(), GPTModel(config).eval()
    model.compile_layers()
    torch._dynamo.reset()
    with torch.no_grad():
        for step in range(2):
            docs = torch.randint(0, 4, (2, 256)).sort(dim=-1).values
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                got = model(ids, document_ids=document_mask(docs, "flex"))
            torch.testing.assert_close(got, ref(ids, document_ids=docs), rtol=1e-4, atol=1e-4)


def test_compiled_layers_train_packed_like_eager() -> None:
    torch.manual_seed(3)
    config = CONFIGS["llama-gqa"]
    ids = torch.randint(0, config.vocab_size, (3, 16))
    eager, compiled = GPTModel(config), GPTModel(config)
    compiled.compile_layers()
    for step in range(2):  # new documents each step: no recompilation (shapes are fixed)
        docs = _doc_ids(LENGTHS if step == 0 else LENGTHS[::-1])
        losses = [m(ids, labels=ids, document_ids=docs) for m in (eager, compiled)]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        for loss in losses:
            loss.sum().backward()
    got, want = _grads(compiled), _grads(eager)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


def test_mamba_layers_refuse_packing() -> None:
    from mcore_models import MambaConfig

    config = llama(num_layers=2, hybrid_pattern="M*", mamba=MambaConfig(d_state=8, head_dim=8, n_groups=1))
    model = GPTModel(config)
    with pytest.raises(ValueError, match="Mamba"):
        model(torch.zeros(1, 8, dtype=torch.long), document_ids=torch.zeros(1, 8, dtype=torch.long))


def _tp_run(tp: int, sp: bool) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
    torch.manual_seed(4)
    config = CONFIGS["llama-gqa"]
    ids = torch.randint(0, config.vocab_size, (3, 16))
    docs = _doc_ids(LENGTHS)
    ref, model = _model(config), _model(config, tp=state.tp, sequence_parallel=sp)
    ref_loss = ref(ids, labels=ids, document_ids=docs)
    loss = model(ids, labels=ids, document_ids=docs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)  # the loss is float32
    ref_loss.sum().backward()
    loss.sum().backward()
    allreduce_sequence_parallel_grads(model, state.tp)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        info = shard_info(name, param.grad, state.tp, like=param)
        ref_info = shard_info(name, ref_params[name].grad, Group.single(), like=ref_params[name])
        full = torch.zeros(ref_info.global_shape, dtype=torch.float64)
        ref_info.scatter_into(full)
        for local_idx, global_idx in info.pieces:
            torch.testing.assert_close(
                param.grad[local_idx], full[global_idx], rtol=1e-6, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_packed_equals_one_process(sp: bool) -> None:
    run_distributed(_tp_run, 2, 2, sp)


def test_a_later_pipeline_stage_attends_per_document() -> None:
    """Two stages (the hidden states handed over as the schedule does) with the document ids on both equal the whole
    model: the boundaries reach every stage."""
    torch.manual_seed(6)
    config = CONFIGS["llama-gqa"]
    ids = torch.randint(0, config.vocab_size, (3, 16))
    docs = _doc_ids(LENGTHS)
    whole = _model(config)
    first = _model(config, layers=range(0, 1), post_process=False)
    last = _model(config, layers=range(1, 2), pre_process=False)
    with torch.no_grad():
        last.set_input_tensor(first(ids, document_ids=docs))
        torch.testing.assert_close(last(None, document_ids=docs), whole(ids, document_ids=docs), rtol=1e-10, atol=1e-10)
        last.set_input_tensor(first(ids, document_ids=docs))
        assert not torch.allclose(last(None), whole(ids, document_ids=docs))  # without them it does not
