"""The dynamic engine: requests in, one scheduled model step at a time, sampled tokens and finished requests out.

:class:`LLMEngine` is single-threaded: :meth:`LLMEngine.step` schedules (continuous batching with chunked
prefill), runs the model runner, samples, detokenizes incrementally, applies stop conditions and frees the KV
blocks of finished requests. :meth:`~LLMEngine.add_request` and :meth:`~LLMEngine.abort` may be called from any
thread: they validate at once (raising on bad requests) and leave a command that the next step picks up.

No request can stop the engine: when something raises for one request (its sampling, prompt log-probabilities,
detokenization, stop strings, its output), only that request ends, with ``finish_reason="error"`` and the message
in :attr:`RequestOutput.error`, and its KV blocks are freed. A batched draw that raises is retried row by row to find
the culprit. A fault that names no request (the model forward, the scheduler) fails the requests of that step (or
every request, when the plan itself is unknown) and the next step runs only for the others and new ones.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mcore_infer.detokenizer import detokenize_step
from mcore_infer.errors import ContextLengthError, InvalidRequestError, OverloadedError
from mcore_infer.images import check_images, image_splice, prefilled
from mcore_infer.kv_cache import blocks_for
from mcore_infer.runner import ModelRunner
from mcore_infer.sampling import Sampler, SampleRow, SamplingParams, merge_banned
from mcore_infer.scheduler import Scheduled, Scheduler, Sequence
from mcore_infer.stop_strings import held_back

__all__ = ["LLMEngine", "RequestOutput"]

log = logging.getLogger(__name__)

TopLogprobs = list[tuple[int, float]]


@dataclass
class RequestOutput:
    """One request's progress: what is new since the last output (streaming) and, once finished, everything."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    new_top_logprobs: list[TopLogprobs] | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # set when finished
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    """Why the request failed inside the engine (with ``finish_reason="error"``); None otherwise."""

    @staticmethod
    def combine(outs: list[RequestOutput]) -> RequestOutput:
        """Consecutive streamed outputs of one request as one: the new tokens, text and log-probabilities of all of
        them, everything else from the last (a server whose client fell behind sends one event for them)."""
        if len(outs) == 1:
            return outs[0]
        if len({o.request_id for o in outs}) != 1:
            raise ValueError("combine() takes outputs of one request")
        lps = None if outs[-1].new_logprobs is None else [x for o in outs for x in o.new_logprobs or []]
        tops = None if outs[-1].new_top_logprobs is None else [x for o in outs for x in o.new_top_logprobs or []]
        first = next((o for o in outs if o.prompt_logprobs is not None), outs[-1])
        return replace(
            outs[-1],
            prompt_logprobs=first.prompt_logprobs,
            prompt_top_logprobs=first.prompt_top_logprobs,
            new_token_ids=[t for o in outs for t in o.new_token_ids],
            new_text="".join(o.new_text for o in outs),
            new_logprobs=lps,
            new_top_logprobs=tops,
        )


class LLMEngine:
    """Continuous-batching engine over a :class:`ModelRunner`; ``tokenizer`` needs ``encode``/``decode``/``eod``."""

    def __init__(self, runner: ModelRunner, tokenizer: Any, *, max_queue: int = 4096, seed: int = 0) -> None:
        self.runner, self.tokenizer = runner, tokenizer
        cfg = runner.config
        self.scheduler = Scheduler(runner.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   state_slots=runner.state_slots)  # fmt: skip
        self.sampler = Sampler(runner.device, seed)
        self.max_model_len = runner.max_model_len
        self.max_queue = max_queue
        self.eod: int | None = getattr(tokenizer, "eod", None)
        self.vision = runner.vision  # a VLM's image format (None: text only)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._pending = 0
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.lookahead = cfg.lookahead and runner.tp.size == 1
        self._ahead: tuple[list[Scheduled], torch.Tensor] | None = None
        sets = runner.decode_sets
        # (EngineConfig.side_stream_copies: the sampled tokens go to the host on a stream of their own)
        self._copy_stream = torch.cuda.Stream(runner.device) if sets is not None and len(sets.sets) > 1 else None
        self.num_lookahead_steps = 0
        self.num_steps = 0
        self.num_aborted = 0
        self.num_failed = 0

    # ---------------------------------------------------------------------------------------------- requests
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def check_request(self, prompt_ids: list[int], params: SamplingParams, param: str = "prompt") -> int:
        """Validate; return the resolved ``max_tokens``. Raises InvalidRequestError / ContextLengthError."""
        params.validate(self.runner.vocab_size)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param=param)
        if any(not 0 <= t < self.runner.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.runner.vocab_size})", param=param)
        n = len(prompt_ids)
        vision = getattr(self, "vision", None)  # (also run by the engine process's front end, on its view)
        note = ""
        if vision is not None and vision.image_token_id in prompt_ids:
            k = prompt_ids.count(vision.image_token_id)
            per = "image tile" if vision.tiling.enabled else "image"
            note = f" ({k} of them image tokens: {vision.image_tokens} per {per})"
        if n >= self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens{note}",
                param=param,
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens{note} "
                f"and max_tokens is {max_tokens} ({n + max_tokens} in all). Shorten the prompt or lower max_tokens",
                param="max_tokens",
            )
        need = blocks_for(n + max_tokens, self.runner.block_size)
        if need > self.runner.blocks.capacity:
            raise ContextLengthError(
                f"the request needs {need} KV-cache blocks but the cache has {self.runner.blocks.capacity}",
                param="max_tokens",
            )
        return max_tokens

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        stream: bool = False,
        detokenize: bool = True,
        images: Any = None,
    ) -> str:
        """Queue a request (thread-safe). Raises on bad requests and when the queue is full. ``detokenize=False``
        (a streamed request without stop strings): its outputs carry token ids and no text, for a caller that
        detokenizes them itself (:class:`~mcore_infer.detokenizer.IncrementalText`, as the engine process's front
        end does). ``images``: a VLM request's pixels ``[n, C, S, S]`` (a tensor or a list of ``[C, S, S]``), one per
        ``image_tokens`` run of the image token in the prompt (with tiling: one per tile; :mod:`mcore_infer.images`)."""
        imgs = check_images(self.vision, prompt_ids, images)
        max_tokens = self.check_request(prompt_ids, params)
        if self._pending + len(self.scheduler.waiting) >= self.max_queue:
            raise OverloadedError(f"{self.max_queue} requests are already waiting; try again later")
        rid = request_id or self.new_request_id()
        gen = self.sampler.request_generator(params.seed) if params.seed is not None else None
        seq = Sequence(rid, list(prompt_ids), params, max_tokens, stream=stream, generator=gen,
                       detokenize=detokenize or not stream or bool(params.stop), images=imgs)  # fmt: skip
        if seq.wants_prompt_logprobs:
            seq.prompt_logprobs = [None] * len(prompt_ids)
            seq.prompt_top_logprobs = [None] * len(prompt_ids)
        self._pending += 1
        self._commands.put(("add", seq))
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe); its blocks are freed at the next step."""
        self._commands.put(("abort", request_id))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._commands.empty() or self._ahead is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self._pending

    def _drain(self, outputs: list[RequestOutput]) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._pending -= 1
                self._seqs[arg.request_id] = arg
                self.scheduler.add(arg)
            elif kind == "abort" and arg in self._seqs:
                seq = self._seqs.pop(arg)
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
                self.num_aborted += 1
                outputs.append(self._output(seq))

    # ------------------------------------------------------------------------------------------------- steps
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self._drain(outputs)
        plan: list[Scheduled] | None = None
        try:
            if self._ahead is not None:  # launched during the previous step, its input ids taken on the device
                plan, logits = self._ahead
                self._ahead = None
            else:
                plan, batch = self.scheduler.schedule()
                if not plan:
                    return outputs
                logits = self.runner.execute(batch, images=image_splice(plan, self.runner) if self.vision else None)
            self.num_steps += 1
            self._process(plan, logits, outputs)
        except Exception as e:  # no request to blame (the forward, the scheduler, waiting for the tokens)
            self._fail_step(plan, e, outputs)
        return outputs

    def _process(self, plan: list[Scheduled], logits: torch.Tensor, outputs: list[RequestOutput]) -> None:
        row = 0
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for item in plan:
            seq = item.seq
            n_rows = item.num_tokens if item.logits == "all" else int(item.logits == "last")
            if seq.finished:  # a lookahead row (one "last" row) of a request that ended or was aborted meanwhile
                row += n_rows
                continue
            if item.logits == "all":
                try:
                    self._prompt_logprobs(item, logits[row : row + n_rows])
                except Exception as e:
                    self._fail(seq, e, outputs)
                    row += n_rows
                    continue
            row += n_rows
            seq.num_computed += item.num_tokens
            if seq.images is not None:
                prefilled(seq)  # its image embeddings are done with once its image tokens are computed
            if seq.num_computed == seq.length:
                sample_rows.append(row - 1)
                sample_seqs.append(seq)
        if sample_seqs:
            self._sample(plan, logits, sample_rows, sample_seqs, outputs)

    def _sample(
        self,
        plan: list[Scheduled],
        logits: torch.Tensor,
        sample_rows: list[int],
        sample_seqs: list[Sequence],
        outputs: list[RequestOutput],
    ) -> None:
        sel = logits if len(sample_rows) == logits.shape[0] else logits[torch.tensor(sample_rows, device=logits.device)]
        rows = [
            SampleRow(s.params, s.prompt_ids, s.output_ids, s.generator, merge_banned(s.params, len(s.output_ids), self.eod))
            for s in sample_seqs
        ]  # fmt: skip
        try:
            out = self.runner.next_decode_ids(len(rows)) if self.lookahead else None
            ready = self.runner.drawn_ids(len(rows)) if self.lookahead and sel is logits else None
            drawn = self.sampler.draw(sel, rows, out=out, copy_stream=self._copy_stream, ready=ready)
        except Exception:
            log.warning("sampling a batch of %d failed; drawing its rows one by one", len(rows), exc_info=True)
            picks = self._sample_each(sel, rows, sample_seqs, outputs)
        else:
            if self.lookahead:
                self._ahead = self._launch_ahead(plan, sample_seqs, drawn.tokens)
            result = drawn.result()  # the host waits for this step's tokens here
            picks = [(s, result.tokens[i], result.logprobs[i], result.top[i]) for i, s in enumerate(sample_seqs)]
        now = time.perf_counter()
        for seq, tok, lp, top in picks:
            try:
                self._advance(seq, tok, lp, top, now, outputs)
            except Exception as e:
                self._fail(seq, e, outputs)

    def _sample_each(
        self, sel: torch.Tensor, rows: list[SampleRow], seqs: list[Sequence], outputs: list[RequestOutput]
    ) -> list[tuple[Sequence, int, float | None, TopLogprobs | None]]:
        """Draw row by row (after a batched draw raised): the rows that raise fail their requests alone."""
        picks = []
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            try:
                r = self.sampler.draw(sel[i : i + 1], [row]).result()
            except Exception as e:
                self._fail(seq, e, outputs)
            else:
                picks.append((seq, r.tokens[0], r.logprobs[0], r.top[0]))
        return picks

    def _advance(
        self, seq: Sequence, tok: int, lp: float | None, top: TopLogprobs | None, now: float, out: list[RequestOutput]
    ) -> None:
        """Append the sampled token; emit the request's output (and release it when it finished)."""
        self._append(seq, tok, lp, top, now)
        if seq.finished:
            seq.finish_time = now
            final = self._output(seq)
            self._release(seq)
            out.append(final)
        elif seq.stream:
            delta = self._output(seq)
            if delta.new_token_ids or delta.new_text:
                out.append(delta)

    def _release(self, seq: Sequence) -> None:
        if self._seqs.get(seq.request_id) is seq:
            del self._seqs[seq.request_id]
        self.scheduler.remove(seq)  # frees its blocks (a second call frees nothing)

    # ---------------------------------------------------------------------------------------------- failures
    def _fail(self, seq: Sequence, error: BaseException, outputs: list[RequestOutput], trace: bool = True) -> None:
        """End ``seq`` with ``finish_reason="error"`` and free its blocks; the engine goes on without it."""
        rid, message = seq.request_id, f"{type(error).__name__}: {error}"
        log.error("request %s failed: %s", rid, message, exc_info=error if trace else None)
        seq.finish_reason, seq.stop_reason = "error", None
        seq.finish_time = time.perf_counter()
        self._release(seq)
        self.num_failed += 1
        outputs.append(
            RequestOutput(
                rid, [], "", None, None, True, "error", None, len(seq.prompt_ids), len(seq.output_ids),
                prompt_token_ids=seq.prompt_ids, token_ids=list(seq.output_ids), error=message,
            )
        )  # fmt: skip

    def _fail_step(self, plan: list[Scheduled] | None, error: Exception, outputs: list[RequestOutput]) -> None:
        """A step failed with no request to blame: fail its requests (all of them when the plan is unknown)."""
        seqs = list(self._seqs.values()) if plan is None else [item.seq for item in plan]
        log.error("engine step failed; failing its %d requests", len(seqs), exc_info=error)
        self._ahead = None
        for seq in seqs:
            if self._seqs.get(seq.request_id) is seq:
                self._fail(seq, error, outputs, trace=False)

    def fail_all(self, error: BaseException) -> list[RequestOutput]:
        """Fail every request the engine holds or has queued (after a fault outside :meth:`step`'s own handling)."""
        outputs: list[RequestOutput] = []
        self._ahead = None
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._pending -= 1
                self._seqs[arg.request_id] = arg
        for seq in list(self._seqs.values()):
            self._fail(seq, error, outputs, trace=False)
        return outputs

    def _launch_ahead(
        self, plan: list[Scheduled], sampled: list[Sequence], tokens: torch.Tensor
    ) -> tuple[list[Scheduled], torch.Tensor] | None:
        """Launch the next decode step for the requests that certainly continue, fed by ``tokens`` on the device.

        Only when every request in the step is decoding, nothing waits for admission and the blocks for one more
        token are free: the next step is then exactly what :meth:`Scheduler.schedule` would produce, minus the
        requests that end now (by length here; an EOD or stop hit shows only later and its row is discarded).
        """
        if len(sampled) != len(plan) or any(it.num_tokens != 1 or it.logits != "last" for it in plan):
            return None
        if not self._commands.empty():
            return None
        keep = [i for i, s in enumerate(sampled) if len(s.output_ids) + 1 < s.max_tokens]
        nxt = self.scheduler.continue_decoding([sampled[i] for i in keep]) if keep else None
        if nxt is None:
            return None
        ids = tokens if len(keep) == len(sampled) else tokens[torch.tensor(keep, device=tokens.device)]
        logits = self.runner.execute(nxt[1], device_ids=ids)
        self.num_lookahead_steps += 1
        return nxt[0], logits

    def _prompt_logprobs(self, item: Scheduled, logits: torch.Tensor) -> None:
        seq = item.seq
        assert seq.prompt_logprobs is not None and seq.prompt_top_logprobs is not None
        start, p = seq.num_computed, len(seq.prompt_ids)
        # row j predicts the prompt token at position start + j + 1
        n = min(item.num_tokens, p - 1 - start)
        if n <= 0:
            return
        lp = torch.log_softmax(logits[:n].float(), dim=-1)
        targets = torch.tensor(seq.prompt_ids[start + 1 : start + 1 + n], device=lp.device)
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        k = seq.params.logprobs or 0
        tv, ti = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        tv_l, ti_l = tv.tolist(), ti.tolist()
        for j in range(n):
            seq.prompt_logprobs[start + 1 + j] = chosen[j]
            seq.prompt_top_logprobs[start + 1 + j] = list(zip(ti_l[j], tv_l[j]))

    def _append(self, seq: Sequence, tok: int, lp: float | None, top: TopLogprobs | None, now: float) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_ids.append(tok)
        if lp is not None:
            seq.logprobs.append(lp)
            seq.top_logprobs.append(top or [])
        p = seq.params
        n = len(seq.output_ids)
        text_tokens = n
        if tok == self.eod and not p.ignore_eos and n >= p.min_tokens:
            seq.finish_reason, seq.stop_reason, text_tokens = "stop", None, n - 1
        elif tok in p.stop_token_ids and n >= p.min_tokens:
            seq.finish_reason, seq.stop_reason, text_tokens = "stop", tok, n - 1
        elif n >= seq.max_tokens:
            seq.finish_reason = "length"
        if (seq.stream and seq.detokenize) or p.stop:
            self._detokenize(seq, text_tokens)
            if p.stop:
                self._check_stop_strings(seq)

    def _detokenize(self, seq: Sequence, upto: int) -> None:
        ids = seq.output_ids[:upto] if upto < len(seq.output_ids) else seq.output_ids
        new, seq.prefix_offset, seq.read_offset = detokenize_step(
            self.tokenizer.decode, ids, seq.prefix_offset, seq.read_offset, seq.finished
        )
        seq.text += new

    def _check_stop_strings(self, seq: Sequence) -> None:
        longest = max(len(s) for s in seq.params.stop)
        window_start = max(0, len(seq.text) - longest - 16)
        hit: tuple[int, str] | None = None
        for s in seq.params.stop:
            i = seq.text.find(s, window_start)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is not None:
            seq.text = seq.text[: hit[0]]
            seq.finish_reason, seq.stop_reason = "stop", hit[1]

    def _output(self, seq: Sequence) -> RequestOutput:
        want_lp = seq.params.logprobs is not None
        new_ids = seq.output_ids[seq.emitted_tokens :]
        visible = len(seq.text)
        if not seq.finished and seq.params.stop:  # only what could still start a stop string waits
            visible = max(seq.emitted_chars, len(seq.text) - held_back(seq.text, seq.params.stop))
        new_text = seq.text[seq.emitted_chars : visible]
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            new_logprobs=seq.logprobs[seq.emitted_tokens :] if want_lp else None,
            new_top_logprobs=seq.top_logprobs[seq.emitted_tokens :] if want_lp else None,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
        )
        if seq.emitted_tokens == 0 and new_ids and seq.prompt_logprobs is not None:
            # the prompt is prefilled once the first token exists: a stream's first event echoes the prompt with them
            out.prompt_logprobs, out.prompt_top_logprobs = seq.prompt_logprobs, seq.prompt_top_logprobs
        seq.emitted_tokens, seq.emitted_chars = len(seq.output_ids), visible
        if seq.finished:
            if seq.detokenize and not (seq.stream or seq.params.stop):
                n = len(seq.output_ids) - (1 if seq.finish_reason == "stop" and seq.stop_reason is None else 0)
                if seq.finish_reason == "stop" and isinstance(seq.stop_reason, int):
                    n = len(seq.output_ids) - 1
                seq.text = self.tokenizer.decode(seq.output_ids[:n]) if seq.finish_reason != "abort" else ""
            out.prompt_token_ids = seq.prompt_ids
            out.token_ids = list(seq.output_ids)
            out.text = seq.text
            out.logprobs = list(seq.logprobs) if want_lp else None
            out.top_logprobs = list(seq.top_logprobs) if want_lp else None
            out.prompt_logprobs = seq.prompt_logprobs
            out.prompt_top_logprobs = seq.prompt_top_logprobs
            out.metrics = {
                "arrival": seq.arrival,
                "first_token": seq.first_token_time or 0.0,
                "finished": seq.finish_time or time.perf_counter(),
                "preemptions": float(seq.preemptions),
            }
        return out
