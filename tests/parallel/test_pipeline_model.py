"""A tiny GPT stand-in built from the TP layers, split into pipeline chunks, and the training loop the runtime
tests share (until the models package's GPTModel lands).

Chunk = [embedding] + residual MLP blocks (ColumnParallelLinear -> gelu -> RowParallelLinear) + [LayerNorm + output
layer + vocab-parallel cross-entropy]. Parameter names use global layer numbers, and every weight is drawn from a
seed derived from its name, so the unsharded model is identical for every tp/pp/vpp layout. ``train(spec)`` runs a
few optimizer steps on one rank and returns losses, step results and parameters; :func:`merge_params` rebuilds the
full parameters from every rank's shards so they can be compared with a one-process run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.ddp import DDPConfig, DistributedDataParallel
from mcore_parallel.optim import OptimizerConfig, get_optimizer
from mcore_parallel.pipeline import forward_backward, stage_layer_range, sync_shared_embedding_weights
from mcore_parallel.state import Group
from mcore_parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    derive_seed,
    gather_from_sp_region,
    set_tp_attributes,
    vocab_parallel_cross_entropy,
)
from mcore_parallel.testing import run_distributed

VOCAB, HIDDEN, FFN, SEQ, MBS = 32, 16, 32, 8, 2


class Block(nn.Module):
    def __init__(self, tp: Group, sp: bool, name: str, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(
            HIDDEN,
            FFN,
            tp=tp,
            sequence_parallel=sp,
            seed=derive_seed(seed, f"{name}.fc1"),
            dtype=dtype,
            device=device,
        )
        self.fc2 = RowParallelLinear(
            FFN,
            HIDDEN,
            tp=tp,
            sequence_parallel=sp,
            seed=derive_seed(seed, f"{name}.fc2"),
            dtype=dtype,
            device=device,
        )
        with torch.no_grad():  # non-zero biases (drawn in full, then this rank's slice) so updates are checked too
            full = torch.randn(FFN, generator=torch.Generator().manual_seed(derive_seed(seed, name) % 2**31)) * 0.02
            self.fc1.bias.copy_(full.chunk(tp.size)[tp.rank].to(device))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(h)))


class TinyChunk(nn.Module):
    """One pipeline chunk: global layers ``layers``; ``pre``/``post``: holds the embedding / the output layer."""

    def __init__(
        self,
        tp: Group,
        sp: bool,
        layers: range,
        pre: bool,
        post: bool,
        tie: bool,
        seed: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.sp, self.pre, self.post, self.tie = tp, sp and tp.size > 1, pre, post, tie
        device = device or torch.device("cpu")
        self.input_tensor: torch.Tensor | None = None
        if pre:
            self.embedding = VocabParallelEmbedding(
                VOCAB, HIDDEN, tp=tp, pad_to_multiple_of=1, sequence_parallel=sp,
                seed=derive_seed(seed, "embedding"), dtype=dtype, device=device,
            )  # fmt: skip
            self.embedding.weight.shared_embedding = tie  # type: ignore[attr-defined]
        self.layers = nn.ModuleDict({str(i): Block(tp, sp, f"layers.{i}", seed, dtype, device) for i in layers})
        if post:
            self.norm = nn.LayerNorm(HIDDEN, dtype=dtype, device=device)
            for p in self.norm.parameters():
                p.sequence_parallel = self.sp  # type: ignore[attr-defined]
            if tie and not pre:  # last stage's copy of the tied weight: zeros until synced from the first stage
                self.output_weight = nn.Parameter(torch.zeros(VOCAB // tp.size, HIDDEN, dtype=dtype, device=device))
                set_tp_attributes(self.output_weight, 0, (VOCAB, HIDDEN))
                self.output_weight.shared_embedding = True  # type: ignore[attr-defined]
            elif not tie:
                self.output = ColumnParallelLinear(
                    HIDDEN, VOCAB, tp=tp, bias=False, sequence_parallel=sp, seed=derive_seed(seed, "output"),
                    dtype=dtype, device=device,
                )  # fmt: skip

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens) if self.pre else self.input_tensor
        assert h is not None, "set_input_tensor was not called on a non-first chunk"
        for block in self.layers.values():
            h = block(h)
        if not self.post:
            return h
        h = self.norm(h)
        if not self.tie:
            return self.output(h)
        h = (
            gather_from_sp_region(h, self.tp, tensor_parallel_output_grad=True)
            if self.sp
            else copy_to_tp_region(h, self.tp)
        )
        weight = self.embedding.weight if self.pre else self.output_weight
        return F.linear(h, weight)


@dataclass
class Spec:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    sp: bool = False
    layers: int = 4
    micro: int = 4
    """Micro-batches per data-parallel rank per step."""
    mbs: int = MBS
    steps: int = 3
    tie: bool = True
    dtype: str = "float32"
    optimizer: dict[str, Any] = field(default_factory=lambda: dict(optimizer="sgd", lr=0.5, clip_grad=0.0))
    dist_opt: bool = False
    overlap: bool = True
    bucket_size: int | None = 200
    inject_inf: tuple[int, int] | None = None
    """(step, global rank): put an inf into that rank's gradients at that step."""
    seed: int = 1234
    fixed_batch: bool = False
    """Train on step 0's batch every step (to check that the loss falls)."""
    dp_exchange: str = "nccl"
    """DDPConfig.exchange: nccl collectives (gloo on CPU) or p2p (peer-to-peer copies between shared buffers)."""


def build_chunks(state: ParallelState, spec: Spec) -> list[TinyChunk]:
    pp, r, v = state.pp.size, state.pp.rank, spec.vpp
    dtype = getattr(torch, spec.dtype)
    chunks = []
    for c in range(v):
        layers = stage_layer_range(spec.layers, pp, r, v, c)
        pre, post = r == 0 and c == 0, r == pp - 1 and c == v - 1
        # built on the CPU (CPU and CUDA generators draw different numbers), then moved: same weights everywhere
        chunks.append(TinyChunk(state.tp, spec.sp, layers, pre, post, spec.tie, spec.seed, dtype).to(state.device))
    return chunks


def batches(step: int, n: int, mbs: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [(torch.randint(0, VOCAB, (SEQ, mbs), generator=g), torch.randint(0, VOCAB, (SEQ, mbs), generator=g))
            for _ in range(n)]  # fmt: skip


def loss_func(labels: torch.Tensor, tp: Group, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = vocab_parallel_cross_entropy(logits.float(), labels, tp, vocab_size=VOCAB).mean()
    return loss, {"loss": loss.detach().clone()}


def forward_step(data: Any, chunk: nn.Module) -> tuple[torch.Tensor, Any]:
    tokens, labels = next(data)
    inner = chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
    return chunk(tokens), functools.partial(loss_func, labels, inner.tp)


def setup(spec: Spec) -> tuple[ParallelState, list[DistributedDataParallel], Any]:
    config = ParallelConfig(tp=spec.tp, pp=spec.pp, vpp=spec.vpp if spec.vpp > 1 else None, sequence_parallel=spec.sp)
    state = ParallelState.initialize(config)
    ddp_config = DDPConfig(bucket_size=spec.bucket_size, overlap_grad_reduce=spec.overlap,
                           use_distributed_optimizer=spec.dist_opt, exchange=spec.dp_exchange)  # fmt: skip
    chunks = [DistributedDataParallel(c, state, ddp_config) for c in build_chunks(state, spec)]
    sync_shared_embedding_weights(chunks, state)
    opt = get_optimizer(OptimizerConfig(**spec.optimizer, use_distributed_optimizer=spec.dist_opt), chunks, state)
    return state, chunks, opt


def train_step(state: ParallelState, chunks: list, opt: Any, spec: Spec, step: int) -> tuple[list[float], Any]:
    dp, d, m = state.dp.size, state.dp.rank, spec.micro
    mine = batches(0 if spec.fixed_batch else step, m * dp, spec.mbs, spec.seed)[d * m : (d + 1) * m]
    mine = [(t.to(state.device), y.to(state.device)) for t, y in mine]
    opt.zero_grad()
    reported = forward_backward(
        forward_step, [iter(mine) for _ in chunks], chunks, m, SEQ, spec.mbs, HIDDEN, state,
        getattr(torch, spec.dtype), grad_scale_func=opt.scale_loss, p2p_timeout=60,
    )  # fmt: skip
    if spec.inject_inf is not None and spec.inject_inf == (step, state.rank):
        chunks[0].grad_buffers[0].grad_data.fill_(float("inf"))  # after the dp reduction: only this rank sees it
    return [r["loss"].item() for r in reported], opt.step()


def param_entries(state: ParallelState, chunks: list) -> dict[str, tuple[torch.Tensor, int | None]]:
    out = {}
    for chunk in chunks:
        for name, p in chunk.module.named_parameters():
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            out[name] = (p.detach().float().cpu().clone(), dim)
    return out


def train(spec: Spec) -> dict[str, Any]:
    state, chunks, opt = setup(spec)
    losses, results = [], []
    for step in range(spec.steps):
        loss, result = train_step(state, chunks, opt, spec, step)
        losses.append(loss)
        results.append(result)
    return dict(
        rank=state.rank, tp_rank=state.tp.rank, dp_rank=state.dp.rank, pp_rank=state.pp.rank, dp=state.dp.size,
        last=state.is_last_stage, losses=losses, results=results, params=param_entries(state, chunks),
        scale=None if opt.scaler is None else opt.scaler.scale,
    )  # fmt: skip


def merge_params(outs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's shards; checks data-parallel replicas agree. ``output_weight`` (the last
    stage's tied copy) is checked against ``embedding.weight`` and dropped."""
    shards: dict[str, dict[int, tuple[torch.Tensor, int | None]]] = {}
    for o in outs:
        for name, (t, dim) in o["params"].items():
            slot = shards.setdefault(name, {})
            if o["tp_rank"] in slot:
                torch.testing.assert_close(
                    t, slot[o["tp_rank"]][0], rtol=0, atol=0, msg=f"dp replicas of {name} differ"
                )
            else:
                slot[o["tp_rank"]] = (t, dim)
    full = {}
    for name, by_tp in shards.items():
        parts = [by_tp[r] for r in sorted(by_tp)]
        dim = parts[0][1]
        full[name] = torch.cat([t for t, _ in parts], dim) if dim is not None else parts[0][0]
    if "output_weight" in full:
        torch.testing.assert_close(full.pop("output_weight"), full["embedding.weight"], rtol=1e-6, atol=1e-7)
    return full


def step_losses(outs: list[dict[str, Any]]) -> list[list[float]]:
    """Per step, the losses of every micro-batch in global order (data-parallel rank major)."""
    last = {o["dp_rank"]: o["losses"] for o in outs if o["last"] and o["tp_rank"] == 0}
    steps = len(next(iter(last.values())))
    return [[x for d in sorted(last) for x in last[d][s]] for s in range(steps)]


def reference(spec: Spec, dp: int) -> dict[str, Any]:
    """The same training on one process: dp * micro micro-batches per step."""
    ref = Spec(**{**spec.__dict__, "tp": 1, "pp": 1, "vpp": 1, "sp": False, "dist_opt": False, "dp_exchange": "nccl",
                  "micro": spec.micro * dp, "inject_inf": None})  # fmt: skip
    return run_distributed(train, 1, ref)[0]


def assert_matches_reference(
    spec: Spec, world: int, rtol: float = 1e-5, atol: float = 1e-6, backend: str = "gloo"
) -> list[dict]:
    outs = run_distributed(train, world, spec, timeout=120, backend=backend)
    dp = outs[0]["dp"]
    ref = reference(spec, dp)
    torch.testing.assert_close(
        torch.tensor(step_losses(outs)), torch.tensor(ref["losses"]), rtol=rtol, atol=atol, msg=lambda m: f"losses: {m}"
    )
    got, want = merge_params(outs), merge_params([ref])
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    for o in outs:
        for r, rr in zip(o["results"], ref["results"]):
            assert r.success == rr.success
            if rr.grad_norm is not None:
                assert abs(r.grad_norm - rr.grad_norm) <= 1e-5 * rr.grad_norm + 1e-7, (r, rr)
                if rr.num_zeros is not None:
                    assert r.num_zeros == rr.num_zeros, (r, rr)
    return outs


def test_reference_model_trains() -> None:
    """Sanity check of the stand-in model itself: the single-process loss falls."""
    out = reference(Spec(steps=5, fixed_batch=True, optimizer=dict(optimizer="adam", lr=1e-2, clip_grad=0.0)), 1)
    first, last = sum(out["losses"][0]), sum(out["losses"][-1])
    assert last < first, out["losses"]
