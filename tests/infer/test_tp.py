"""TP=2 serving over gloo gives the same greedy tokens as TP=1 (rank 0 schedules, rank 1 follows)."""

from __future__ import annotations

import time

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.testing import run_distributed
from tests.infer._tiny import prompts_of_lengths, tiny_model

PROMPTS = prompts_of_lengths(7, 30, 12, seed=3)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CFG = dict(block_size=16, num_blocks=32, max_num_batched_tokens=16, max_num_seqs=2)


def _serve(tp: int) -> list[list[int]] | None:
    state = ParallelState.initialize(ParallelConfig(tp=tp))
    llm = LLM(model=tiny_model(tp=state.tp), config=EngineConfig(**CFG))
    if not llm.is_driver:
        llm.follow()
        return None
    out = [g.outputs[0].token_ids for g in llm.generate(PROMPTS, PARAMS)]
    llm.shutdown()
    return out


def test_tp2_greedy_equals_tp1() -> None:
    (single,) = run_distributed(_serve, 1, 1)
    results = run_distributed(_serve, 2, 2)
    assert results[1] is None
    assert results[0] == single


def _idle_then_serve(idle_s: float) -> list[int] | None:
    """tp2 over a process group that times out after 2 s: the engine idles ``idle_s`` s (its loop running, as a
    server's does between requests), then serves a request."""
    import asyncio
    import datetime

    import torch.distributed as dist

    from mcore_infer.async_engine import AsyncEngine
    from mcore_parallel import Group

    ParallelState.initialize(ParallelConfig(tp=2))
    pg = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2), backend="gloo")
    tp = Group("tp", (0, 1), dist.get_rank(), pg)
    llm = LLM(model=tiny_model(tp=tp), config=EngineConfig(**CFG))
    if not llm.is_driver:
        llm.follow()  # a collective that waits for the next step: it fails after 2 s without a message
        return None
    llm.runner.keep_alive_s = 0.5
    engine = AsyncEngine(llm.engine)
    engine.start()
    time.sleep(idle_s)

    async def one() -> list[int]:
        last = None
        async for out in engine.generate(PROMPTS[0], PARAMS, stream=False):
            last = out
        assert last is not None
        return last.token_ids

    try:
        return asyncio.run(one())
    finally:
        engine.shutdown(5.0)


def test_an_idle_tensor_parallel_engine_keeps_its_followers() -> None:
    """Idle for longer than the process group's timeout, the first rank's engine loop sends keep-alives, so its
    follower is still there for the next request (which gets the tp1 tokens)."""
    (single,) = run_distributed(_serve, 1, 1)
    results = run_distributed(_idle_then_serve, 2, 3.5)
    assert results == [single[0], None]
