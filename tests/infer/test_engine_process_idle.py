"""A front end that has served no request yet still reads the engine's pipe (``serve --api-workers``: the kernel may
give one worker no connection for a long time): the engine sends its load to every front end each step, and a pipe
nobody reads would fill until the engine blocked writing to it, stopping every other worker's requests too. Two
front ends on one engine process, the idle one's pipe shrunk to one page so a few dozen steps would fill it."""

from __future__ import annotations

import asyncio
import fcntl
import multiprocessing as mp

from mcore_infer import SamplingParams
from mcore_infer.engine_process import EngineSpec, SharedEngineClient
from mcore_infer.engine_process._worker import run_engine, widen_pipe
from tests.infer.test_engine_process import build_tiny_llm

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


async def _serve(busy: SharedEngineClient, idle: SharedEngineClient) -> list[int]:
    busy.start()
    idle.start()  # what the app's startup does; the idle front end then gets no request at all
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def one(prompt: list[int]) -> int:
        n = 0
        async for out in busy.generate(prompt, params):
            n += len(out.new_token_ids)
        return n

    # 4 requests one after another: 240 steps, each sending the engine's load to both front ends
    return [await asyncio.wait_for(one([65 + i, 66, 67]), timeout=60) for i in range(4)]


def test_an_idle_front_end_does_not_stop_the_engine() -> None:
    ctx = mp.get_context("spawn")
    commands = [ctx.Pipe(duplex=False) for _ in range(2)]
    outputs = [ctx.Pipe(duplex=False) for _ in range(2)]
    for r, _ in commands + outputs:
        widen_pipe(r)
    fcntl.fcntl(outputs[1][0].fileno(), F_SETPIPE_SZ, 4096)  # the idle front end's pipe: one page
    engine = ctx.Process(target=run_engine, args=(EngineSpec(build_tiny_llm), [r for r, _ in commands],
                                                  [w for _, w in outputs]))  # fmt: skip
    engine.start()
    for r, _ in commands:  # the engine holds these ends now
        r.close()
    for _, w in outputs:
        w.close()
    busy = SharedEngineClient(commands[0][1], outputs[0][0], 0).launch()
    idle = SharedEngineClient(commands[1][1], outputs[1][0], 1).launch()
    try:
        assert asyncio.run(_serve(busy, idle)) == [60] * 4
        assert idle.engine is not None and idle.engine.num_steps > 200  # it kept up with the engine's load
    finally:
        busy.shutdown(5.0)
        idle.shutdown(5.0)
        engine.join(timeout=30)
        if engine.is_alive():
            engine.kill()
    assert engine.exitcode == 0
