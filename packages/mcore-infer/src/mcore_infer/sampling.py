"""Sampling: the per-request :class:`SamplingParams` and the one batched controller that turns logits into tokens.

Order of operations on one row of logits (float32):

1. penalties: repetition (CTRL-style, on prompt and output tokens: positive logits divided by the penalty, negative
   ones multiplied), then presence and frequency (OpenAI-style, on output tokens: ``logit -= presence * seen +
   frequency * count``);
2. log-probabilities reported to the user are ``log_softmax`` of these penalised logits (before temperature and
   truncation, i.e. the model's distribution);
3. ``temperature == 0`` is greedy (argmax); otherwise logits are divided by the temperature, then top-k, top-p
   (nucleus, on the distribution left by top-k) and min-p (tokens below ``min_p`` times the top probability) are
   masked, and a token is drawn. A request with a ``seed`` draws from its own generator, so its output does not
   depend on what else is in the batch.

Numerical safety: no valid parameter can make a row invalid for ``torch.multinomial`` (which raises on the CPU and
kills the CUDA context with a device-side assert). A temperature below :data:`TEMPERATURE_FLOOR` (1e-5) is greedy
(float32 division by it would overflow); the most likely token always survives top-k, top-p and min-p (a tiny
``top_p`` is greedy); the repetition penalty is clamped to :data:`PENALTY_RANGE` and penalised logits to finite
values (``-inf`` stays, NaN becomes ``-inf``); a row left with no usable distribution (every logit ``-inf``, or an
overflow) takes the argmax of its logits instead of a draw. These checks are tensor ops (``torch.where``), never
host reads of device values, so the step keeps its single synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_infer.errors import InvalidRequestError
from mcore_infer.kernels.argmax import row_argmax

__all__ = ["SamplingParams", "Sampler", "SampleResult", "TEMPERATURE_FLOOR", "PENALTY_RANGE"]

TEMPERATURE_FLOOR = 1e-5
"""Temperatures below this are greedy: the limit of sampling as the temperature goes to 0, without the overflow."""
PENALTY_RANGE = (1e-6, 1e6)
"""The repetition penalty is clamped into this range before it scales logits (float32 keeps the result finite)."""


@dataclass
class SamplingParams:
    """How to generate one completion."""

    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    temperature: float = 1.0
    """0 (or anything below TEMPERATURE_FLOOR) is greedy; higher flattens the distribution."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 or -1: off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1: off)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (0: off)."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in the prompt or output (1: off)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    seed: int | None = None
    """Same seed, same prompt, same parameters: same output."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the completion ends before the first one (it is not included)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the completion (included in token ids, not in text)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-document token."""
    logprobs: int | None = None
    """Return the chosen token's log-probability and the top-n alternatives (None: no logprobs)."""
    echo: bool = False
    """Prefix the prompt to the returned text (with prompt logprobs when logprobs is set)."""
    min_tokens: int = 0
    """Do not stop (on EOD or stop tokens) before this many tokens."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`InvalidRequestError` naming the first bad field."""

        def bad(name: str, why: str) -> None:
            raise InvalidRequestError(f"{name} {why} (got {getattr(self, name)!r})", param=name)

        for name in ("max_tokens", "min_tokens", "top_k", "seed"):  # the engine's tensors hold int64
            v = getattr(self, name, None)
            if isinstance(v, int) and not -(2**63) <= v < 2**63:
                bad(name, "must fit a 64-bit integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be a positive integer")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            bad("temperature", "must be in [0, 100]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1, 0 (off) or a positive integer")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            bad("repetition_penalty", "must be positive")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                bad(name, "must be in [-2, 2]")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad("logprobs", "must be between 0 and 20")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if len(self.stop) > 16:
            bad("stop", "may hold at most 16 strings")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids below the vocabulary size {vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class SampleResult:
    """Per row: the chosen token, its logprob and the top-n ``(token, logprob)`` pairs (when asked for)."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


class Drawn:
    """Tokens chosen on the device (``tokens``, not yet waited for) and what :meth:`result` needs.

    The copies to the host start here, in stream order right after the sampling kernels: the engine launches its
    lookahead step after drawing, and a copy started only in :meth:`result` would queue behind that whole step, so
    the host would wait for the step ahead instead of overlapping its bookkeeping with it (on an H200, llama-1b at
    batch 1: 1.28 ms per token with the copy in ``result``, 0.916 ms with it here; the GPU is busy 0.89 ms a step).
    """

    def __init__(self, tokens: torch.Tensor, rows: list[SampleRow], logp: torch.Tensor | None,
                 copy_stream: Any = None) -> None:  # fmt: skip
        self.tokens, self.rows = tokens, rows
        parts = [tokens]
        if logp is not None:
            k = max(r.params.logprobs or 0 for r in rows)
            parts.append(logp.gather(1, tokens[:, None])[:, 0])
            top_v, top_i = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
            parts += [top_v, top_i]
        self._ready: torch.cuda.Event | None = None
        if not tokens.is_cuda or copy_stream is None:
            self._host = [_start_host_copy(t) for t in parts]
            if tokens.is_cuda:
                self._ready = torch.cuda.Event()
                self._ready.record(torch.cuda.current_stream(tokens.device))
            return
        # the copies on their own stream, after the draw: the step's stream goes on to the next step without them
        drawn = torch.cuda.Event()
        drawn.record(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_event(drawn)
            self._host = [_start_host_copy(t) for t in parts]
            self._ready = torch.cuda.Event()
            self._ready.record(copy_stream)
        for t in parts:
            t.record_stream(copy_stream)  # (their memory is not reused before the copies have read it)

    def result(self) -> SampleResult:
        """The tokens (and log-probabilities) on the host: waits for the copies started at construction."""
        if self._ready is not None:
            self._ready.synchronize()
        n = len(self.rows)
        token_list = self._host[0].tolist()
        lps: list[float | None] = [None] * n
        tops: list[list[tuple[int, float]] | None] = [None] * n
        if len(self._host) > 1:
            chosen, top_v_l, top_i_l = (t.tolist() for t in self._host[1:])
            for i, r in enumerate(self.rows):
                if r.params.logprobs is not None:
                    lps[i] = chosen[i]
                    m = r.params.logprobs or 0
                    tops[i] = list(zip(top_i_l[i][:m], top_v_l[i][:m]))
        return SampleResult(token_list, lps, tops)


def _start_host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` taken in stream order now (pinned and asynchronous from a GPU; complete on return on the
    CPU), so that later writes to ``t`` or later work on the stream do not delay or change it."""
    if t.is_cuda:
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        return h
    return t.detach().clone()


@dataclass
class SampleRow:
    """What the sampler needs to know about one row: parameters, history and the request's generator."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None = None
    banned: list[int] | None = None  # tokens masked out for this step (EOD and stop ids before min_tokens)


class Sampler:
    """Batched sampling over rows with different :class:`SamplingParams`."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def request_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        """``logits``: ``[len(rows), vocab]`` (any float dtype, any device)."""
        return self.draw(logits, rows).result()

    def draw(self, logits: torch.Tensor, rows: list[SampleRow], out: torch.Tensor | None = None,
             copy_stream: Any = None, ready: torch.Tensor | None = None) -> Drawn:  # fmt: skip
        """Choose the tokens on the device without waiting for them (``Drawn.tokens``); ``.result()`` fetches them.

        ``out`` (int64 ``[rows]``): where a batch of only plain greedy rows writes its tokens (the engine passes the
        next decode step's input ids); other batches draw into a tensor of their own. ``copy_stream``: the CUDA
        stream that copies the tokens to the host (None: the current stream, in order with the step). ``ready``:
        ``logits.argmax(-1)``, already computed on the device (a decode graph's draw): a batch of only plain greedy
        rows takes it as its tokens."""
        n = len(rows)
        assert logits.shape[0] == n
        fast = all(r.params.greedy and not r.params.needs_penalties and r.params.logprobs is None for r in rows)
        if fast and not any(r.banned for r in rows):  # (one Triton kernel on the GPU: torch's argmax exactly)
            tokens = ready if ready is not None else row_argmax(logits, out=out)
            return Drawn(tokens, rows, None, copy_stream)
        x = logits.float().clone()
        self._penalise(x, rows)
        x = _finite(x)
        for i, r in enumerate(rows):
            if r.banned:
                x[i, r.banned] = float("-inf")
        logp = None
        if any(r.params.logprobs is not None for r in rows):  # a row of only -inf gives NaN: report -inf
            logp = torch.log_softmax(x, dim=-1).nan_to_num(nan=float("-inf"), posinf=0.0, neginf=float("-inf"))
        # which rows are greedy is known on the host: no device round trip
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not drawn:
            tokens = _argmax(x, logits)
        elif not greedy:
            tokens = self._draw(x, rows, _argmax(x, logits))
        else:
            tokens = torch.empty(n, dtype=torch.long, device=x.device)
            g_idx = torch.tensor(greedy, device=x.device)
            d_idx = torch.tensor(drawn, device=x.device)
            tokens[g_idx] = _argmax(x[g_idx], logits[g_idx])
            x_d = x[d_idx]
            tokens[d_idx] = self._draw(x_d, [rows[i] for i in drawn], _argmax(x_d, logits[d_idx]))
        return Drawn(tokens, rows, logp, copy_stream)

    # ---------------------------------------------------------------------------------------------------------
    def _penalise(self, x: torch.Tensor, rows: list[SampleRow]) -> None:
        vocab = x.shape[1]
        lo, hi = PENALTY_RANGE
        for i, r in enumerate(rows):
            p = r.params
            if not p.needs_penalties:
                continue
            if p.repetition_penalty != 1.0:
                penalty = min(max(p.repetition_penalty, lo), hi)
                seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long, device=x.device)
                seen = seen[(seen >= 0) & (seen < vocab)]
                vals = x[i, seen]
                x[i, seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
                out = torch.tensor(r.output_ids, dtype=torch.long, device=x.device)
                counts = torch.zeros(vocab, device=x.device).scatter_add_(0, out, torch.ones_like(out, dtype=x.dtype))
                x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)

    def _draw(self, x: torch.Tensor, rows: list[SampleRow], fallback: torch.Tensor) -> torch.Tensor:
        """Draw one token per row of (penalised) ``x``; rows left without a valid distribution take ``fallback``."""
        dev = x.device
        temp = torch.tensor([r.params.temperature for r in rows], device=dev)[:, None]
        x = x / temp
        vocab = x.shape[1]
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=dev)
        top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        rest = rank > 0  # the most likely token survives every truncation
        sorted_x = sorted_x.masked_fill((rank >= top_k[:, None]) & rest, float("-inf"))
        probs = sorted_x.softmax(-1)
        # nucleus: keep a token while the mass of the tokens before it is below top_p (the first always stays)
        before = probs.cumsum(-1) - probs
        sorted_x = sorted_x.masked_fill((before >= top_p[:, None]) & (top_p[:, None] < 1.0) & rest, float("-inf"))
        probs = sorted_x.softmax(-1)
        sorted_x = sorted_x.masked_fill((probs < min_p[:, None] * probs[:, :1]) & rest, float("-inf"))
        probs = sorted_x.softmax(-1)
        # an overflow (or a row of -inf) leaves NaN: draw from a one-hot there and take the fallback instead
        ok = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
        probs = torch.where(ok[:, None], probs, (rank == 0).to(probs.dtype))
        picked = torch.empty(len(rows), dtype=torch.long, device=dev)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            picked[shared] = torch.multinomial(probs[shared], 1, generator=self.generator)[:, 0]
        for i, r in enumerate(rows):
            if r.generator is not None:
                picked[i] = torch.multinomial(probs[i], 1, generator=r.generator)[0]
        return torch.where(ok, order.gather(1, picked[:, None])[:, 0], fallback)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN as ``-inf`` and ``+inf`` as the largest float (``-inf`` stays: masked tokens)."""
    return x.nan_to_num(nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))


def _argmax(x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Per row the argmax of ``x``, or of the raw logits where every entry of ``x`` is ``-inf``."""
    return torch.where((x > float("-inf")).any(-1), x.argmax(-1), raw.argmax(-1))


def merge_banned(params: SamplingParams, n_out: int, eod: int | None) -> list[int] | None:
    """Tokens that may not be chosen yet: EOD and stop token ids while fewer than ``min_tokens`` were made."""
    if n_out >= params.min_tokens:
        return None
    banned = list(params.stop_token_ids)
    if eod is not None and not params.ignore_eos:
        banned.append(eod)
    return banned or None
