"""CUDA graphs of the model runner's steps: decode steps by batch size, and any other step by token count.

A step that runs eagerly pays the host's launch cost of every kernel of every layer (with compiled layers, their
guards and wrappers too): on an H200, a 128-token prefill of ``llama-1b`` takes ~1.2 ms on the GPU and ~13 ms on the
host. Replaying a captured graph costs the host a few copies. Two kinds are captured (GPU, Triton attention backend,
``EngineConfig.cuda_graphs``):

* **decode graphs**, one per batch size of ``EngineConfig.graph_sizes()``: each token the one new token of its request
  (one row of the block table each, the KV write inside the attention kernel where the plan says so).
* **step graphs**, one per token count of ``EngineConfig.step_graph_sizes()``: any step (prefill chunks, decode tokens,
  both) of at most that many tokens, at most ``max_num_seqs`` requests and as many logits rows. Each token names its
  block-table row and context length (the paged kernel is token-parallel), so one graph serves every mix of
  requests. Models with Mamba layers have none: their prefill scans read each request's extent on the host.

Both read their inputs from a static int64 buffer filled from a pinned host mirror with one copy per step. Padded
tokens write their keys and values to the scratch block's slot 0 and attend to nothing; their rows of the logits are
never read. The graphs share one memory pool (captured largest first): a replay's logits are consumed (sampled on the
same stream) before the next replay can overwrite them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mcore_infer.attention import PagedAttentionContext
from mcore_infer.mamba_cache import MambaStepView

if TYPE_CHECKING:
    from mcore_infer.runner import ModelRunner, StepBatch

__all__ = ["DecodeSets", "StaticInputs", "capture_graphs", "replay_decode", "replay_step", "step_graph_fits"]

log = logging.getLogger(__name__)


class StaticInputs:
    """A device buffer of int64 fields (``name -> length``, in order; ``bt`` is ``[rows, width]``) and its pinned
    host mirror: :meth:`upload` copies the mirror's first ``used`` entries once the previous upload has run."""

    def __init__(self, fields: dict[str, int], rows: int, width: int, device: torch.device) -> None:
        size = sum(fields.values()) + rows * width
        self.device_buf = torch.zeros(size, dtype=torch.int64, device=device)
        self.host_buf = torch.zeros(size, dtype=torch.int64).pin_memory()
        self.host = self.host_buf.numpy()
        self.view: dict[str, torch.Tensor] = {}
        self.offset: dict[str, int] = {}
        at = 0
        for name, n in fields.items():
            self.view[name], self.offset[name] = self.device_buf[at : at + n], at
            at += n
        self.offset["bt"], self.width = at, width
        self.view["bt"] = self.device_buf[at:].view(rows, width)
        self._copied: torch.cuda.Event | None = None

    def host_field(self, name: str) -> np.ndarray:
        at = self.offset[name]
        return self.host[at : at + self.view[name].numel()]

    def host_tables(self, rows: int) -> np.ndarray:
        at = self.offset["bt"]
        return self.host[at : at + rows * self.width].reshape(rows, self.width)

    def wait_copied(self) -> None:
        """Before the host mirror is written: the previous step's copy out of it must have run."""
        if self._copied is not None:
            self._copied.synchronize()

    def upload(self, used: int, start: int = 0) -> torch.cuda.Event:
        """Copy the mirror's entries ``[start, used)`` on the current stream; the event that marks the copy done."""
        self.device_buf[start:used].copy_(self.host_buf[start:used], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return self._copied


class DecodeSets:
    """The decode graphs over one input buffer, or over two used in turn (``EngineConfig.side_stream_copies``):
    then a lookahead step's inputs go up on ``upload_stream`` while the step before it runs (into the buffer that
    step does not read), and the step's stream only waits for that copy's event."""

    def __init__(self, sets: list[tuple[StaticInputs, dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]]],
                 upload_stream: torch.cuda.Stream | None, draws: bool = False) -> None:  # fmt: skip
        self.sets = sets
        self.upload_stream = upload_stream
        self.next = 0
        """The set the next decode step replays."""
        self.replayed: list[torch.cuda.Event | None] = [None] * len(sets)
        """Per set, its last replay's end (an upload into the set waits for it)."""
        self.draws = draws
        """Whether each graph writes its rows' argmax into the other set's ids (``DecodePlan.argmax_in_graph``)."""
        self.drawn: int | None = None
        """The rows whose argmax the last step drew into :meth:`next_ids` (None: the last step drew none)."""

    def next_ids(self, n: int) -> torch.Tensor | None:
        """Where a draw of ``n`` tokens may write them for the next decode step to read (two sets only)."""
        if len(self.sets) < 2:
            return None
        inputs, graphs = self.sets[self.next]
        return inputs.view["ids"][:n] if n <= max(graphs) else None

    def drawn_ids(self, n: int) -> torch.Tensor | None:
        """The greedy tokens of the last step's ``n`` rows, already drawn by its graph (None: it drew none for
        them)."""
        return self.next_ids(n) if self.drawn == n else None


def _fill_tables(inputs: StaticInputs, tables: list[list[int]], rows: int) -> None:
    bt = inputs.host_tables(rows)
    bt[:] = 0
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t


# ------------------------------------------------------------------------------------------------- capture
def _capture_one(runner: ModelRunner, ctx: PagedAttentionContext, ids: torch.Tensor, pos: torch.Tensor,
                 pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:  # fmt: skip
    args = (ids[None], pos[None])
    stream = torch.cuda.Stream(runner.device)
    stream.wait_stream(torch.cuda.current_stream(runner.device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compiled layers specialise, Triton kernels compile, the allocator settles
            runner.decode(*args, gather_logits=True, inference_context=ctx)
    torch.cuda.current_stream(runner.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = runner.decode(*args, gather_logits=True, inference_context=ctx)
    return graph, out[0]


def _context(runner: ModelRunner, st: dict[str, torch.Tensor], t: int, rows: int, logits: torch.Tensor | None,
             decode: bool, state_slots: torch.Tensor | None = None) -> PagedAttentionContext:  # fmt: skip
    mamba = None if runner.mamba is None or state_slots is None else MambaStepView(runner.mamba, state_slots)
    return runner.attention_context(st["slots"][:t], st["bt"][:rows], st["tseq"][:t], st["tctx"][:t], logits, "triton",
                                    decode, mamba)  # fmt: skip


def _capture_steps(runner: ModelRunner, pool: Any) -> Any:
    sizes = runner.config.step_graph_sizes() if runner.mamba is None else []
    if not sizes:
        return pool
    tmax, rows = sizes[-1], min(runner.config.max_num_seqs, sizes[-1])
    fields = {k: tmax for k in ("ids", "pos", "slots", "tseq", "tctx")} | {"lidx": rows}
    runner.step_inputs = inputs = StaticInputs(fields, rows, runner.max_blocks_per_seq, runner.device)
    st = inputs.view
    for t in sorted(sizes, reverse=True):
        r = min(rows, t)
        ctx = _context(runner, st, t, rows, st["lidx"][:r], decode=False)
        runner.step_graphs[t] = (*_capture_one(runner, ctx, st["ids"][:t], st["pos"][:t], pool), r)
        pool = runner.step_graphs[t][0].pool()
    return pool


def capture_graphs(runner: ModelRunner) -> None:
    """Capture the step graphs, then the decode graphs (over two input buffers with
    ``EngineConfig.side_stream_copies``), into one pool (the caller checked that graphs apply)."""
    sizes = runner.config.graph_sizes()
    mx, w = sizes[-1], runner.max_blocks_per_seq
    fields = {k: mx for k in ("ids", "pos", "slots", "tseq", "tctx", "state_slots")}
    two = runner.config.side_stream_copies and runner.config.lookahead and runner.tp.size == 1
    draws = two and runner.plan.argmax_in_graph
    all_inputs = [StaticInputs(fields, mx, w, runner.device) for _ in range(2 if two else 1)]
    sets = []
    with torch.inference_mode():
        pool = _capture_steps(runner, None)
        for i, inputs in enumerate(all_inputs):
            st = inputs.view
            st["tseq"].copy_(torch.arange(mx, device=runner.device))
            inputs.host_field("tseq")[:] = np.arange(mx)
            graphs = {}
            for b in sorted(sizes, reverse=True):
                ctx = _context(runner, st, b, b, None, decode=True, state_slots=st["state_slots"][:b])
                if draws:  # the greedy draw into the ids of the set the next step replays
                    ctx.argmax_out = all_inputs[1 - i].view["ids"][:b]
                graph, out = _capture_one(runner, ctx, st["ids"][:b], st["pos"][:b], pool)
                pool = graph.pool()
                graphs[b] = (graph, out)
            sets.append((inputs, graphs))
    torch.cuda.synchronize(runner.device)
    runner.graphs = sets[0][1]
    runner.decode_sets = DecodeSets(sets, torch.cuda.Stream(runner.device) if two else None, draws)
    runner._graph_sizes = sorted(runner.graphs)
    log.info("captured CUDA graphs: decode batch sizes %s%s, steps of up to %s tokens", runner._graph_sizes,
             " (two input buffers)" if two else "", sorted(runner.step_graphs))  # fmt: skip


# -------------------------------------------------------------------------------------------------- replay
def replay_decode(runner: ModelRunner, batch: StepBatch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
    """A decode-only step of ``n`` tokens through the graph of the next batch size up (of the next input set)."""
    n = len(batch.tokens)
    b = next(s for s in runner._graph_sizes if s >= n)
    sets = runner.decode_sets
    assert sets is not None
    i = sets.next
    sets.next = (i + 1) % len(sets.sets)
    inputs, graphs = sets.sets[i]
    inputs.wait_copied()
    f = inputs.host_field
    for name, values in (("ids", batch.tokens), ("pos", batch.positions), ("slots", batch.slots),
                         ("state_slots", batch.state_slots)):  # fmt: skip
        f(name)[:b] = 0  # padded rows: token 0 at the scratch slot, the scratch state slot 0
        f(name)[:n] = values
    ctx = f("tctx")
    ctx[:b] = 0  # padded rows attend to nothing
    ctx[:n] = np.asarray(batch.positions) + 1
    _fill_tables(inputs, batch.block_tables, b)
    used = inputs.offset["bt"] + b * inputs.width
    ids = inputs.view["ids"][:n]
    if device_ids is not None and sets.upload_stream is not None:
        # off the step's stream, into the set the running step does not read (the ids come from the device)
        main = torch.cuda.current_stream(runner.device)
        with torch.cuda.stream(sets.upload_stream):
            last = sets.replayed[i]
            if last is not None:
                sets.upload_stream.wait_event(last)
            uploaded = inputs.upload(used, inputs.offset["pos"])
        main.wait_event(uploaded)
    else:
        inputs.upload(used)
    if device_ids is not None and device_ids.data_ptr() != ids.data_ptr():  # (a greedy draw wrote them in place)
        ids.copy_(device_ids)
    if runner.mamba is not None and batch.fresh_slots:  # (one-token prompts) zeroed before the graph runs
        runner.mamba.reset(torch.tensor(batch.fresh_slots, device=runner.device))
    graph, out = graphs[b]
    graph.replay()
    sets.drawn = n if sets.draws and len(batch.logits_index) == n else None
    if sets.upload_stream is not None:
        done = torch.cuda.Event()
        done.record()
        sets.replayed[i] = done
    if len(batch.logits_index) == n:
        return out[:n]
    return out[torch.tensor(batch.logits_index, device=out.device)]


def step_graph_fits(runner: ModelRunner, batch: StepBatch) -> bool:
    """Whether a step graph can run ``batch``: tokens within the largest, requests and logits rows within its rows."""
    if not runner.step_graphs:
        return False
    inputs = runner.step_inputs
    assert inputs is not None
    rows = inputs.view["bt"].shape[0]
    n = len(batch.tokens)
    t = next((s for s in sorted(runner.step_graphs) if s >= n), None)
    return t is not None and len(batch.segments) <= rows and len(batch.logits_index) <= runner.step_graphs[t][2]


def replay_step(runner: ModelRunner, batch: StepBatch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Any step that :func:`step_graph_fits`, through the step graph of the next token count up."""
    n, s, r = len(batch.tokens), len(batch.segments), len(batch.logits_index)
    t = next(x for x in sorted(runner.step_graphs) if x >= n)
    inputs = runner.step_inputs
    assert inputs is not None
    inputs.wait_copied()
    f = inputs.host_field
    for name, values in (("ids", batch.tokens), ("pos", batch.positions), ("slots", batch.slots)):
        f(name)[:t] = 0
        f(name)[:n] = values
    tseq, tctx = f("tseq"), f("tctx")
    tseq[:t] = 0
    tctx[:t] = 0  # padded tokens attend to nothing
    tseq[:n] = np.repeat(np.arange(s), [g.end - g.start for g in batch.segments])
    tctx[:n] = np.asarray(batch.positions) + 1
    lidx = f("lidx")
    lidx[:] = 0
    lidx[:r] = batch.logits_index
    _fill_tables(inputs, batch.block_tables, s)
    inputs.upload(inputs.offset["bt"] + s * inputs.width)
    if device_ids is not None:
        inputs.view["ids"][:n].copy_(device_ids)
    graph, out, _ = runner.step_graphs[t]
    graph.replay()
    return out[:r]
