"""Tensor/sequence-parallel layers against single-process torch references on random inputs.

Each rank builds the TP layer, copies its slice of a reference weight into it, and checks its slice of the output
and of every gradient against ``torch.nn.Linear`` / ``F.embedding`` / ``F.cross_entropy`` run in float64 on the full
tensors. fp32 is checked tightly, bf16 loosely.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
)
from mcore_parallel.testing import run_distributed

S, B, H_IN, H_OUT, VOCAB = 8, 3, 16, 24, 200
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
CASES = [(tp, sp, dt) for tp in (1, 2, 4) for sp in (False, True) for dt in (torch.float32, torch.bfloat16)]
IDS = [f"tp{tp}-{'sp' if sp else 'nosp'}-{'bf16' if dt == torch.bfloat16 else 'fp32'}" for tp, sp, dt in CASES]


def _state(tp: int, sp: bool) -> ParallelState:
    return ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))


def _with_exchange(state: ParallelState, exchange: dict[str, Any] | None) -> ParallelState:
    """``state`` whose tp group carries a symmetric-memory exchange (``with_symmetric_memory(**exchange)``)."""
    if exchange is None:
        return state
    from mcore_parallel.tensor import with_symmetric_memory

    return dataclasses.replace(state, tp=with_symmetric_memory(state.tp, **exchange))


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    torch.testing.assert_close(
        actual.double().cpu(), expected.double().cpu(), **TOL[dtype], msg=lambda m: f"{what}: {m}"
    )


def _seq_chunk(t: torch.Tensor, state: ParallelState, sp: bool) -> torch.Tensor:
    return t.chunk(state.tp.size, 0)[state.tp.rank] if sp and state.tp.size > 1 else t


def _column(
    tp: int, sp: bool, dtype: torch.dtype, gather_output: bool, device: str = "cpu", exchange: Any = None
) -> None:
    state = _with_exchange(_state(tp, sp), exchange)
    torch.manual_seed(1234)
    ref = torch.nn.Linear(H_IN, H_OUT, dtype=torch.float64)
    x = torch.randn(S, B, H_IN, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(S, B, H_OUT, dtype=torch.float64)
    (ref(x) * dy).sum().backward()

    layer = ColumnParallelLinear(
        H_IN,
        H_OUT,
        tp=state.tp,
        sequence_parallel=sp,
        gather_output=gather_output and not sp,
        dtype=dtype,
        device=device,
    )
    r, n = state.tp.rank, state.tp.size
    with torch.no_grad():
        layer.weight.copy_(ref.weight.chunk(n, 0)[r])
        layer.bias.copy_(ref.bias.chunk(n, 0)[r])
    x_local = _seq_chunk(x.detach(), state, sp).to(device, dtype).requires_grad_()
    y = layer(x_local)
    gathered = gather_output and not sp
    y_ref = ref(x).detach()
    _close(y, y_ref if gathered else y_ref.chunk(n, -1)[r], dtype, "output")
    (y * (dy if gathered else dy.chunk(n, -1)[r]).to(device, dtype)).sum().backward()
    _close(x_local.grad, _seq_chunk(x.grad, state, sp), dtype, "input grad")
    _close(layer.weight.grad, ref.weight.grad.chunk(n, 0)[r], dtype, "weight grad")
    _close(layer.bias.grad, ref.bias.grad.chunk(n, 0)[r], dtype, "bias grad")


def _row(
    tp: int, sp: bool, dtype: torch.dtype, input_is_parallel: bool, device: str = "cpu", exchange: Any = None
) -> None:
    state = _with_exchange(_state(tp, sp), exchange)
    torch.manual_seed(4321)
    ref = torch.nn.Linear(H_IN, H_OUT, dtype=torch.float64)
    x = torch.randn(S, B, H_IN, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(S, B, H_OUT, dtype=torch.float64)
    (ref(x) * dy).sum().backward()

    parallel_in = input_is_parallel or sp
    layer = RowParallelLinear(
        H_IN, H_OUT, tp=state.tp, sequence_parallel=sp, input_is_parallel=parallel_in, dtype=dtype, device=device
    )
    r, n = state.tp.rank, state.tp.size
    with torch.no_grad():
        layer.weight.copy_(ref.weight.chunk(n, 1)[r])
        layer.bias.copy_(ref.bias)
    x_in = x.detach().chunk(n, -1)[r] if parallel_in else x.detach()
    x_in = x_in.to(device, dtype).requires_grad_()
    y = layer(x_in)
    _close(y, _seq_chunk(ref(x).detach(), state, sp), dtype, "output")
    (y * _seq_chunk(dy, state, sp).to(device, dtype)).sum().backward()
    allreduce_sequence_parallel_grads(layer, state.tp)
    _close(x_in.grad, x.grad.chunk(n, -1)[r] if parallel_in else x.grad, dtype, "input grad")
    _close(layer.weight.grad, ref.weight.grad.chunk(n, 1)[r], dtype, "weight grad")
    _close(layer.bias.grad, ref.bias.grad, dtype, "bias grad")


def _embedding(tp: int, sp: bool, dtype: torch.dtype, device: str = "cpu") -> None:
    state = _state(tp, sp)
    torch.manual_seed(99)
    weight = torch.randn(VOCAB, H_IN, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, VOCAB, (S, B))
    ids[0, 0], ids[1, 0] = 0, VOCAB - 1  # both ends of the vocabulary
    dy = torch.randn(S, B, H_IN, dtype=torch.float64)
    (F.embedding(ids, weight) * dy).sum().backward()

    layer = VocabParallelEmbedding(VOCAB, H_IN, tp=state.tp, sequence_parallel=sp, dtype=dtype, device=device)
    padded = padded_vocab_size(VOCAB, tp)
    assert layer.padded_num_embeddings == padded and padded % (128 * tp) == 0
    r, n = state.tp.rank, state.tp.size
    full = torch.cat([weight.detach(), weight.new_zeros(padded - VOCAB, H_IN)])
    with torch.no_grad():
        layer.weight.copy_(full.chunk(n, 0)[r])
    y = layer(ids.to(device))
    _close(y, _seq_chunk(F.embedding(ids, weight).detach(), state, sp), dtype, "output")
    (y * _seq_chunk(dy, state, sp).to(device, dtype)).sum().backward()
    grad_full = torch.cat([weight.grad, weight.new_zeros(padded - VOCAB, H_IN)])
    _close(layer.weight.grad, grad_full.chunk(n, 0)[r], dtype, "weight grad")


def _cross_entropy(tp: int, dtype: torch.dtype, label_smoothing: float, device: str = "cpu") -> None:
    state = _state(tp, False)
    torch.manual_seed(7)
    padded = padded_vocab_size(VOCAB, tp, multiple=8)
    logits = (3 * torch.randn(S, B, padded, dtype=torch.float64)).requires_grad_()
    target = torch.randint(0, VOCAB, (S, B))
    target[0, 0], target[0, 1] = 0, VOCAB - 1
    w = torch.rand(S, B, dtype=torch.float64)
    ref = F.cross_entropy(
        logits[..., :VOCAB].reshape(-1, VOCAB), target.reshape(-1), reduction="none", label_smoothing=label_smoothing
    ).view(S, B)
    (ref * w).sum().backward()

    r, n = state.tp.rank, state.tp.size
    local = logits.detach().chunk(n, -1)[r].to(device, dtype).requires_grad_()
    loss = vocab_parallel_cross_entropy(
        local, target.to(device), state.tp, vocab_size=VOCAB, label_smoothing=label_smoothing
    )
    assert loss.dtype == torch.float32 and loss.shape == (S, B)
    _close(loss, ref.detach(), dtype, "loss")
    (loss * w.float().to(device)).sum().backward()
    assert local.grad.dtype == dtype
    _close(local.grad, logits.grad.chunk(n, -1)[r], dtype, "logits grad")
    if r == n - 1:  # padded columns get exactly zero gradient
        pad_start = VOCAB - r * local.shape[-1]
        assert torch.all(local.grad[..., pad_start:] == 0)


@pytest.mark.parametrize("tp,sp,dtype", CASES, ids=IDS)
@pytest.mark.parametrize("gather_output", [False, True], ids=["split-out", "gather-out"])
def test_column_parallel_linear(tp: int, sp: bool, dtype: torch.dtype, gather_output: bool) -> None:
    if sp and gather_output:
        pytest.skip("sequence parallelism keeps the output split")
    run_distributed(_column, tp, tp, sp, dtype, gather_output)


@pytest.mark.parametrize("tp,sp,dtype", CASES, ids=IDS)
@pytest.mark.parametrize("input_is_parallel", [True, False], ids=["parallel-in", "replicated-in"])
def test_row_parallel_linear(tp: int, sp: bool, dtype: torch.dtype, input_is_parallel: bool) -> None:
    if sp and not input_is_parallel:
        pytest.skip("sequence parallelism needs a parallel input")
    run_distributed(_row, tp, tp, sp, dtype, input_is_parallel)


@pytest.mark.parametrize("tp,sp,dtype", CASES, ids=IDS)
def test_vocab_parallel_embedding(tp: int, sp: bool, dtype: torch.dtype) -> None:
    run_distributed(_embedding, tp, tp, sp, dtype)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["no-smoothing", "smoothing"])
def test_vocab_parallel_cross_entropy(tp: int, dtype: torch.dtype, label_smoothing: float) -> None:
    run_distributed(_cross_entropy, tp, tp, dtype, label_smoothing)


def test_layer_argument_errors() -> None:
    state = ParallelState.initialize(ParallelConfig())
    with pytest.raises(ValueError, match="vocab_size=300 must be in"):
        vocab_parallel_cross_entropy(torch.zeros(2, 256), torch.zeros(2, dtype=torch.long), state.tp, vocab_size=300)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_cross_entropy(torch.zeros(2, 8), torch.zeros(3, dtype=torch.long), state.tp)
    with pytest.raises(ValueError, match="sequence_parallel and gather_output"):
        from mcore_parallel import Group

        ColumnParallelLinear(4, 4, tp=Group("tp", (0, 1), 0), sequence_parallel=True, gather_output=True)


def _divisibility(tp: int) -> None:
    state = _state(tp, False)
    with pytest.raises(ValueError, match="out_features=6 is not divisible by the tensor-parallel size 4"):
        ColumnParallelLinear(4, 6, tp=state.tp)


def test_divisibility_error_names_the_sizes() -> None:
    run_distributed(_divisibility, 4, 4)


def _symmetric(kind: str, tp: int, dtype: torch.dtype, device: str = "cpu", exchange: str = "torch") -> None:
    """The sequence-parallel linears through symmetric memory. With PyTorch's fused ops on CPU, the ops are PyTorch's
    own reference implementations of them (all-gather / reduce-scatter then matmul, over gloo): what is tested is
    this package's use of them (shapes, gather and scatter dimensions, the backward formulas). mcore's exchange runs
    for real on CPU (shared-memory buffers)."""
    from mcore_parallel.tensor import mappings

    real_ops = mappings._fused_ops
    calls = {"gather": 0, "scatter": 0}
    if device == "cpu" and exchange == "torch":
        from torch.distributed import _symmetric_memory as symm

        def gather(*a: object, **k: object) -> object:
            calls["gather"] += 1
            return symm._fused_all_gather_matmul_fallback(*a, **k)  # type: ignore[arg-type]

        def scatter(*a: object) -> object:
            calls["scatter"] += 1
            return symm._fused_matmul_reduce_scatter_fallback(*a)  # type: ignore[arg-type]

        mappings._fused_ops = lambda ops: (gather, scatter)  # type: ignore[assignment]
    try:
        if kind == "column":
            _column(tp, True, dtype, False, device, {"exchange": exchange})
        else:
            _row(tp, True, dtype, True, device, {"exchange": exchange})
    finally:
        mappings._fused_ops = real_ops  # type: ignore[method-assign]  # worker processes run later tests too
    if device == "cpu" and exchange == "torch":
        assert calls == {"gather": 1, "scatter": 1}, calls  # forward one op, backward the other


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("exchange", ["torch", "mcore"])
def test_sequence_parallel_linears_through_symmetric_memory_ops(kind: str, tp: int, exchange: str) -> None:
    run_distributed(_symmetric, tp, kind, tp, torch.float32, "cpu", exchange)


def _exchange_stack(tp: int, dtype: torch.dtype, device: str = "cpu", chunks: int = 2) -> None:
    """mcore's exchange over many calls: three column -> tanh -> row blocks, two forward/backward passes of
    different batch sizes (the workspace grows in the second), so exchanges alternate between the workspace's two
    slots and each slot is rewritten after the peers read it. Outputs and gradients equal the float64 reference
    (float32); in bfloat16, whose rounding grows through the blocks, they are about as far from it as the NCCL
    path's run on the same inputs (at most twice its error plus 3% of the tensor's largest element: wrong rows or a
    stale slot are off by the size of the elements themselves). The activation is smooth: with a ReLU, a rounding
    difference between the two paths can flip a unit near zero and move a bfloat16 gradient by a whole element, which
    failed this bound for most seeds with either path correct."""
    from mcore_parallel.tensor import with_symmetric_memory

    state = _state(tp, True)
    symmetric = with_symmetric_memory(state.tp, exchange="mcore", chunks=chunks)
    r, n = state.tp.rank, state.tp.size
    torch.manual_seed(11)
    refs = [(torch.nn.Linear(H_IN, H_OUT, dtype=torch.float64), torch.nn.Linear(H_OUT, H_IN, bias=False,
             dtype=torch.float64)) for _ in range(3)]  # fmt: skip

    def stack(group: Group) -> list[tuple[ColumnParallelLinear, RowParallelLinear]]:
        layers = []
        for ref1, ref2 in refs:
            col = ColumnParallelLinear(H_IN, H_OUT, tp=group, sequence_parallel=True, dtype=dtype, device=device)
            row = RowParallelLinear(H_OUT, H_IN, tp=group, sequence_parallel=True, input_is_parallel=True,
                                    bias=False, dtype=dtype, device=device)  # fmt: skip
            with torch.no_grad():
                col.weight.copy_(ref1.weight.chunk(n, 0)[r])
                col.bias.copy_(ref1.bias.chunk(n, 0)[r])
                row.weight.copy_(ref2.weight.chunk(n, 1)[r])
            layers.append((col, row))
        return layers

    stacks = {"nccl": stack(state.tp)}
    with torch.random.fork_rng():  # the inputs below are drawn from the same generator state either way
        stacks["mcore"] = stack(symmetric)
    inputs = [(torch.randn(S, batch, H_IN, dtype=torch.float64), torch.randn(S, batch, H_IN, dtype=torch.float64))
              for batch in (B, 2 * B)]  # fmt: skip

    expected: list[torch.Tensor] = []  # per batch: output, input grad; then every weight and bias grad
    for x, dy in inputs:
        x = x.clone().requires_grad_()
        h_ref = x
        for ref1, ref2 in refs:
            h_ref = h_ref + ref2(torch.tanh(ref1(h_ref)))
        (h_ref * dy).sum().backward()
        expected += [_seq_chunk(h_ref.detach(), state, True), _seq_chunk(x.grad, state, True)]
    for ref1, ref2 in refs:  # accumulated over both passes
        expected += [ref1.weight.grad.chunk(n, 0)[r], ref1.bias.grad.chunk(n, 0)[r], ref2.weight.grad.chunk(n, 1)[r]]

    def run(layers: list[tuple[ColumnParallelLinear, RowParallelLinear]]) -> list[torch.Tensor]:
        for col, row in layers:
            col.weight.grad = col.bias.grad = row.weight.grad = None
        got = []
        for x, dy in inputs:
            x_local = _seq_chunk(x, state, True).to(device, dtype).requires_grad_()
            h = x_local
            for col, row in layers:
                h = h + row(torch.tanh(col(h)))
            (h * _seq_chunk(dy, state, True).to(device, dtype)).sum().backward()
            got += [h.detach(), x_local.grad]
        for col, row in layers:
            got += [col.weight.grad, col.bias.grad, row.weight.grad]
        return got

    nccl = run(stacks["nccl"])
    workspace = symmetric.exchange.workspace
    assert workspace is not None and workspace.exchanges == 0  # the NCCL stack (the plain group) never used it
    mcore = run(stacks["mcore"])
    assert workspace.exchanges == 2 * 12  # 6 linears, forward and backward, twice
    for i, (got, base, ref) in enumerate(zip(mcore, nccl, expected, strict=True)):
        if dtype == torch.float32:
            _close(got, ref, dtype, f"tensor {i}")
        else:
            err = (got.double().cpu() - ref).abs().max().item()
            base_err = (base.double().cpu() - ref).abs().max().item()
            scale = ref.abs().max().item()  # a few bf16 ulps of the largest element (2**-8 relative) are noise
            assert err <= 2 * base_err + 0.03 * scale, (
                f"tensor {i}: error {err:.3g}, the NCCL path's {base_err:.3g}, largest element {scale:.3g}"
            )


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mcore_exchange_over_many_calls(tp: int, dtype: torch.dtype) -> None:
    run_distributed(_exchange_stack, tp, tp, dtype)


@pytest.mark.parametrize("chunks", [1, 5])  # 5 pieces of 12 or 24 rows: unequal pieces
def test_mcore_exchange_in_any_number_of_pieces(chunks: int) -> None:
    run_distributed(_exchange_stack, 2, 2, torch.float32, "cpu", chunks)


def test_mcore_exchange_argument_errors() -> None:
    from mcore_parallel import Group
    from mcore_parallel.tensor import with_symmetric_memory

    group = Group("tp", (0, 1), 0)
    with pytest.raises(ValueError, match="exchange='nvshmem' must be one of torch, mcore"):
        with_symmetric_memory(group, exchange="nvshmem")
    with pytest.raises(ValueError, match="chunks=0 must be at least 1"):
        with_symmetric_memory(group, exchange="mcore", chunks=0)
    with pytest.raises(ValueError, match="in_graph=True traces PyTorch's fused ops"):
        with_symmetric_memory(group, in_graph=True, exchange="mcore")
    single = Group.single("tp")
    assert with_symmetric_memory(single, exchange="mcore") is single  # one rank: nothing to exchange


_CPU_SYMM_LIB: list[object] = []


def _register_cpu_symmetric_ops() -> None:
    """CPU kernels for the ``symm_mem`` fused ops (PyTorch's own reference implementations over the process group),
    so that compiled graphs that call the real ops run on CPU; the CUDA kernels are tested on GPUs."""
    if _CPU_SYMM_LIB:
        return
    from torch.distributed import _symmetric_memory as symm

    lib = torch.library.Library("symm_mem", "IMPL")
    lib.impl("fused_all_gather_matmul", symm._fused_all_gather_matmul_fallback, "CPU")
    lib.impl("fused_matmul_reduce_scatter", symm._fused_matmul_reduce_scatter_fallback, "CPU")
    _CPU_SYMM_LIB.append(lib)


def _symmetric_in_graph(tp: int) -> None:
    """``with_symmetric_memory(in_graph=True)``: a column then a row sequence-parallel linear compiled as one graph
    (``fullgraph=True``: no graph break at the fused ops) give the float64 reference's output and gradients."""
    _register_cpu_symmetric_ops()
    state = _with_exchange(_state(tp, True), {"in_graph": True})
    torch.manual_seed(7)
    ref1 = torch.nn.Linear(H_IN, H_OUT, dtype=torch.float64)
    ref2 = torch.nn.Linear(H_OUT, H_IN, bias=False, dtype=torch.float64)
    x = torch.randn(S, B, H_IN, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(S, B, H_IN, dtype=torch.float64)
    (ref2(torch.relu(ref1(x))) * dy).sum().backward()
    r, n = state.tp.rank, state.tp.size
    col = ColumnParallelLinear(H_IN, H_OUT, tp=state.tp, sequence_parallel=True, dtype=torch.float32)
    row = RowParallelLinear(H_OUT, H_IN, tp=state.tp, sequence_parallel=True, input_is_parallel=True, bias=False,
                            dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        col.weight.copy_(ref1.weight.chunk(n, 0)[r])
        col.bias.copy_(ref1.bias.chunk(n, 0)[r])
        row.weight.copy_(ref2.weight.chunk(n, 1)[r])
    torch._dynamo.reset()
    f = torch.compile(lambda t: row(torch.relu(col(t))), fullgraph=True)
    x_local = _seq_chunk(x.detach(), state, True).float().requires_grad_()
    y = f(x_local)
    _close(y, _seq_chunk(ref2(torch.relu(ref1(x))).detach(), state, True), torch.float32, "output")
    (y * _seq_chunk(dy, state, True).float()).sum().backward()
    _close(x_local.grad, _seq_chunk(x.grad, state, True), torch.float32, "input grad")
    _close(col.weight.grad, ref1.weight.grad.chunk(n, 0)[r], torch.float32, "column weight grad")
    _close(row.weight.grad, ref2.weight.grad.chunk(n, 1)[r], torch.float32, "row weight grad")


@pytest.mark.parametrize("tp", [2])
def test_symmetric_memory_linears_trace_into_one_compiled_graph(tp: int) -> None:
    run_distributed(_symmetric_in_graph, tp, tp, timeout=600)
