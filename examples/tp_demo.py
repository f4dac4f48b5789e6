"""The main job until training lands: a tensor- and sequence-parallel byte-level language model on CPU.

Run with ``torchrun --standalone --nproc-per-node 2 examples/tp_demo.py`` (any rank count that divides 4 * hidden).
Every rank trains its shard of a small model (vocab-parallel embedding -> column-parallel up-projection -> GELU ->
row-parallel down-projection with a residual -> column-parallel output layer -> vocab-parallel cross-entropy) on
next-byte prediction over real text (the Python standard library's own source files). Rank 0 also trains the
same model unsharded in one process, and every step's loss must match it.
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

from mcore_parallel import Group, ParallelConfig, ParallelState, read_launch_env
from mcore_parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    derive_seed,
    model_parallel_seed,
    vocab_parallel_cross_entropy,
)

VOCAB = 256  # bytes


class TinyLM(nn.Module):
    def __init__(self, tp: Group, hidden: int, sequence_parallel: bool, seed: int, device: torch.device) -> None:
        super().__init__()
        self.tp, self.sp = tp, sequence_parallel and tp.size > 1
        common = dict(tp=tp, sequence_parallel=self.sp, device=device)
        self.embed = VocabParallelEmbedding(VOCAB, hidden, seed=derive_seed(seed, "embed"), **common)
        self.up = ColumnParallelLinear(hidden, 4 * hidden, seed=derive_seed(seed, "up"), **common)
        self.down = RowParallelLinear(4 * hidden, hidden, seed=derive_seed(seed, "dn"), **common)
        self.out = ColumnParallelLinear(hidden, VOCAB, bias=False, seed=derive_seed(seed, "out"), **common)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # [s / tp, b, hidden] with sequence parallelism, else [s, b, hidden]
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.out(h)  # [s, b, vocab / tp]: the output layer gathers the sequence back
        return vocab_parallel_cross_entropy(logits, labels, self.tp, vocab_size=VOCAB).mean()


def corpus(max_bytes: int) -> torch.Tensor:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    state = ParallelState.initialize(
        ParallelConfig(tp=read_launch_env().world_size, sequence_parallel=not args.no_sequence_parallel)
    )
    model_parallel_seed(args.seed, tp_rank=state.tp.rank)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls, so the comparison below is meaningful
    data = corpus(2_000_000)
    model = TinyLM(state.tp, args.hidden, state.sequence_parallel, args.seed, state.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref = ref_opt = None
    if state.rank == 0:
        ref = TinyLM(Group.single(), args.hidden, False, args.seed, state.device)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
        print(
            f"tensor parallel size {state.tp.size} ({state.backend or 'no backend'} on {state.device.type}), "
            f"sequence parallel {state.sequence_parallel}, "
            f"{sum(p.numel() for p in ref.parameters())} parameters, {len(data) / 1e6:.1f} MB of stdlib source"
        )
        print(f"{'step':>4} {'loss (tp)':>10} {'loss (1 proc)':>13} {'|diff|':>9}")

    gen = torch.Generator().manual_seed(args.seed)
    worst, first, last, start = 0.0, None, None, time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        window = torch.stack([data[s : s + args.seq + 1] for s in starts.tolist()]).t()  # [s+1, b]
        tokens, labels = window[:-1].to(state.device), window[1:].to(state.device)
        loss = model(tokens, labels)
        loss_value = loss.detach()
        opt.zero_grad()
        loss.backward()
        allreduce_sequence_parallel_grads(model, state.tp)
        opt.step()
        if ref is not None and ref_opt is not None:
            ref_loss = ref(tokens, labels)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            diff = abs(loss_value.item() - ref_loss.item())
            worst = max(worst, diff)
            first = first if first is not None else loss_value.item()
            last = loss_value.item()
            if step == 1 or step % 5 == 0 or step == args.steps:
                print(f"{step:>4} {loss_value:>10.4f} {ref_loss.item():>13.4f} {diff:>9.2e}")
    if state.rank == 0:
        assert first is not None and last is not None
        print(f"done in {time.perf_counter() - start:.1f} s: loss {first:.3f} -> {last:.3f}, worst |diff| {worst:.2e}")
        if worst > 1e-3:
            raise SystemExit(f"FAILED: tensor-parallel loss left the single-process loss by {worst:.2e} (> 1e-3)")
        if not last < first - 0.5:
            raise SystemExit(f"FAILED: the loss did not fall ({first:.3f} -> {last:.3f})")
        print("OK: tensor-parallel training matches the single-process run")
    if torch.distributed.is_initialized():
        # every rank waits for rank 0's check before tearing gloo down: a rank that destroys its group while
        # another still holds connections to it can abort (seen once in CI at tp4)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
