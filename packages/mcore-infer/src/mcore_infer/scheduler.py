"""Requests in flight and the scheduler: continuous batching, chunked prefill, admission by free KV blocks.

Each step the scheduler fills a token budget (``max_num_batched_tokens``):

1. running requests first, oldest first: one token for those decoding, the next prefill chunk for those still
   reading their prompt. When a request needs a block and none is free, the newest running request is preempted:
   its blocks are freed and it goes back to the head of the queue, to be recomputed (prompt plus the tokens it has
   made so far) when blocks free up. Its output so far is kept.
2. then waiting requests, in arrival order, while the budget, ``max_num_seqs`` and free blocks allow (a small
   reserve of blocks is kept for the running requests' next tokens).

Models with Mamba layers also give each running request a state slot (:mod:`mcore_infer.mamba_cache`), taken at
admission and freed with its blocks (finish, abort, preemption); ``max_num_seqs`` slots exist, so admission by
``max_num_seqs`` always finds one.

Requests that could never fit (prompt plus ``max_tokens`` over the context length or over the whole cache) are
rejected when they are added, never queued.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_infer.kv_cache import BlockManager, blocks_for
from mcore_infer.mamba_cache import SlotManager
from mcore_infer.runner import StepBatch
from mcore_infer.sampling import SamplingParams

__all__ = ["Sequence", "Scheduler"]


@dataclass(eq=False)
class Sequence:
    """One request's state (one completion; ``n > 1`` is several sequences)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stream: bool = False
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    state_slot: int = 0
    """Its Mamba state slot while running (0: none held, or a model without Mamba layers)."""
    num_computed: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    detokenize: bool = True
    """False: a streamed request whose caller detokenizes its tokens (no stop strings): its text stays empty."""
    images: Any = None
    """A VLM request's images (:class:`~mcore_infer.images.RequestImages`), dropped when it finishes or is aborted."""
    # incremental detokenization
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    emitted_tokens: int = 0
    emitted_chars: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.echo and self.params.logprobs is not None


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int
    logits: str  # "none", "last" or "all"


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        reserve_fraction: float = 0.01,
        state_slots: SlotManager | None = None,
    ) -> None:
        self.blocks = blocks
        self.state_slots = state_slots
        self.max_num_seqs, self.budget = max_num_seqs, max(max_num_batched_tokens, max_num_seqs)
        self.reserve = max(1, int(reserve_fraction * blocks.capacity)) if blocks.capacity > 8 else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        self._free_slot(seq)
        if seq.images is not None:  # its pixels (and embeddings, if any were left; at tp > 1 the followers' too)
            seq.images.drop_embeds()
            seq.images = None

    def _free_slot(self, seq: Sequence) -> None:
        if self.state_slots is not None and seq.state_slot:
            self.state_slots.free(seq.state_slot)
        seq.state_slot = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        self._free_slot(seq)  # recomputed from the prompt: a fresh slot when admitted again
        seq.num_computed = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> tuple[list[Scheduled], StepBatch]:
        budget = self.budget
        plan: list[Scheduled] = []
        bs = self.blocks.block_size
        preempted: set[int] = set()
        for seq in list(self.running):
            if budget <= 0:
                break
            if id(seq) in preempted:  # preempted below by an older request
                continue
            n = min(seq.length - seq.num_computed, budget)
            while not self.blocks.grow(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(id(victim))
                if victim is seq:
                    break
            if id(seq) in preempted:
                continue
            plan.append(self._plan(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.length - seq.num_computed, budget)
            need = blocks_for(seq.num_computed + n, bs) - len(seq.block_table)
            reserve = self.reserve if self.running else 0
            if self.blocks.num_free - need < reserve:
                break
            if self.state_slots is not None and not self.state_slots.num_free:
                break
            grown = self.blocks.grow(seq.block_table, seq.num_computed + n)
            assert grown
            if self.state_slots is not None:
                seq.state_slot = self.state_slots.allocate()
            self.waiting.popleft()
            self.running.append(seq)
            plan.append(self._plan(seq, n))
            budget -= n
        batch = StepBatch()
        for item in plan:
            s = item.seq
            batch.add(
                s.tokens(s.num_computed, s.num_computed + item.num_tokens),
                s.num_computed,
                s.block_table,
                bs,
                item.logits,
                s.state_slot,
            )
        return plan, batch

    def continue_decoding(self, seqs: list[Sequence]) -> tuple[list[Scheduled], StepBatch] | None:
        """The next step of ``seqs``, all decoding, whose newest token is not appended yet (the engine's lookahead):
        one token each at position ``seq.length``, blocks grown for it. None when it is not the step
        :meth:`schedule` would build next: someone waits for admission, or a block is short (no preemption here)."""
        if self.waiting:
            return None
        bs = self.blocks.block_size
        batch = StepBatch()
        for seq in seqs:
            pos = seq.length
            if not self.blocks.grow(seq.block_table, pos + 1):
                return None
            batch.add([0], pos, seq.block_table, bs, "last", seq.state_slot)  # the id itself comes from the device
        return [Scheduled(seq, 1, "last") for seq in seqs], batch

    @staticmethod
    def _plan(seq: Sequence, n: int) -> Scheduled:
        reaches_end = seq.num_computed + n == seq.length
        if seq.wants_prompt_logprobs and seq.num_computed < len(seq.prompt_ids) and not seq.output_ids:
            return Scheduled(seq, n, "all")
        return Scheduled(seq, n, "last" if reaches_end else "none")
