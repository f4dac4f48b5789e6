"""``AsyncEngine``: the engine thread hands each step's outputs over in one call per event loop, and a caller that
fell behind gets everything that arrived since in one batch (what the server writes to a client at once)."""

from __future__ import annotations

import asyncio
import time

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer.async_engine import AsyncEngine
from tests.infer._tiny import tiny_model

CFG = dict(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128)


def test_a_slow_caller_gets_the_outputs_it_missed_in_one_batch() -> None:
    model = tiny_model(max_position_embeddings=256)
    reference = LLM(model=model, config=EngineConfig(**CFG))
    llm = LLM(model=model, config=EngineConfig(**CFG))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt_ids = llm.tokenizer.encode("Hello there")
    expected = reference.generate("Hello there", params)[0].outputs[0]
    engine = AsyncEngine(llm.engine)
    engine.start()

    async def consume() -> list[list[str]]:
        batches: list[list[str]] = []
        async for outs in engine.generate_batches(prompt_ids, params, stream=True):
            batches.append([o.new_text for o in outs])
            if len(batches) == 1:
                time.sleep(0.5)  # block this event loop: the engine thread keeps stepping meanwhile
        return batches

    try:
        batches = asyncio.run(consume())
    finally:
        engine.shutdown(timeout=2.0)
    assert "".join(t for b in batches for t in b) == expected.text
    assert sum(len(b) for b in batches) <= 12 and max(len(b) for b in batches) > 1, batches
    # the plain per-output iterator gives the same stream, one output at a time
    engine = AsyncEngine(llm.engine)
    engine.start()

    async def plain() -> str:
        return "".join([o.new_text async for o in engine.generate(prompt_ids, params, stream=True)])

    try:
        assert asyncio.run(plain()) == expected.text
    finally:
        engine.shutdown(timeout=2.0)


def test_streamed_outputs_combine_into_the_whole_completion() -> None:
    import pytest

    from mcore_infer.engine import RequestOutput

    llm = LLM(model=tiny_model(max_position_embeddings=256), config=EngineConfig(**CFG))
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2)
    deltas = list(llm.generate_stream("Hello there", params))
    assert len(deltas) > 1
    whole = RequestOutput.combine(deltas)
    assert whole.finished and whole.new_token_ids == whole.token_ids and len(whole.token_ids) == 7
    assert whole.new_text == whole.text and whole.new_logprobs == whole.logprobs
    assert whole.new_top_logprobs == whole.top_logprobs
    assert RequestOutput.combine(deltas[:1]) is deltas[0]
    other = RequestOutput("x", [], "", None, None, False)
    with pytest.raises(ValueError, match="one request"):
        RequestOutput.combine([deltas[0], other])
