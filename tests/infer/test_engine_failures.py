"""No request can stop the engine: a fault for one request fails that request alone (its blocks freed, the others'
outputs unchanged), a fault in the model forward fails that step's requests, and the engine serves on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mcore_infer import SamplingParams
from mcore_infer.async_engine import AsyncEngine
from mcore_infer.engine import LLMEngine, RequestOutput
from mcore_infer.errors import RequestFailed
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_llm, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BOOM = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=0.25)  # the marked request


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _run(eng: LLMEngine, limit: int = 500) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(limit):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if not eng.has_work():
            return done
    raise AssertionError("the engine did not finish")


def _served_afterwards(model, llm) -> None:
    p = prompts_of_lengths(11, seed=9)[0]
    assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == reference_greedy(model, p, 8)
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity  # every block came back


def _raise_for(monkeypatch, obj: Any, name: str, bad: Any) -> None:
    """Wrap ``obj.name`` so that it raises when ``bad(*args)`` is true."""
    real = getattr(obj, name)

    def wrapped(*args: Any, **kw: Any) -> Any:
        if bad(*args):
            raise RuntimeError(f"injected failure in {name}")
        return real(*args, **kw)

    monkeypatch.setattr(obj, name, wrapped)


@pytest.mark.parametrize("where", ["append", "sampling", "prompt_logprobs"])
@pytest.mark.parametrize("lookahead", [False, True])
def test_a_failure_for_one_request_fails_it_alone(model, monkeypatch, where: str, lookahead: bool) -> None:
    llm = tiny_llm(model, lookahead=lookahead)
    eng = llm.engine
    prompts = prompts_of_lengths(9, 30, 6, 14, seed=5)
    params = [GREEDY, GREEDY, GREEDY, GREEDY]
    if where == "append":  # a per-request step after sampling (detokenization, stop strings, ...), at its 3rd token
        victim_params = params[2]
        _raise_for(monkeypatch, eng, "_append", lambda seq, *a: seq.request_id == "victim" and len(seq.output_ids) == 2)
    elif where == "sampling":  # the batched draw raises whenever the marked row is in it
        victim_params = BOOM
        _raise_for(monkeypatch, eng.sampler, "_penalise", lambda x, rows: any(r.params is BOOM for r in rows))
    else:
        victim_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, echo=True, logprobs=1)
        _raise_for(monkeypatch, eng, "_prompt_logprobs", lambda item, logits: item.seq.request_id == "victim")
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts[:2], params)]
    eng.add_request(prompts[2], victim_params, request_id="victim")
    rids.append(eng.add_request(prompts[3], params[3]))
    done = _run(eng)
    bad = done["victim"]
    assert bad.finish_reason == "error" and "injected failure" in (bad.error or "")
    for rid, p in zip(rids, [prompts[0], prompts[1], prompts[3]]):
        assert done[rid].error is None and done[rid].token_ids == reference_greedy(model, p, 8)
    assert eng.num_failed == 1
    _served_afterwards(model, llm)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_failed_forward_fails_its_step_and_the_engine_serves_on(model, monkeypatch, lookahead: bool) -> None:
    llm = tiny_llm(model, lookahead=lookahead)
    eng = llm.engine
    calls = {"n": 0}
    real = llm.runner.execute

    def execute(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected forward failure")
        return real(*args, **kw)

    monkeypatch.setattr(llm.runner, "execute", execute)
    prompts = prompts_of_lengths(5, 8, seed=6)
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    done = _run(eng)
    assert all(done[r].finish_reason == "error" and "injected forward" in (done[r].error or "") for r in rids)
    _served_afterwards(model, llm)

    # a forward that always fails: each step fails its requests, nothing spins, the engine is idle afterwards
    monkeypatch.setattr(llm.runner, "execute", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("down")))
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    done = _run(eng, limit=10)
    assert all(done[r].finish_reason == "error" for r in rids)
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity


def test_the_async_engine_raises_request_failed_for_the_failed_request_only(model, monkeypatch) -> None:
    llm = tiny_llm(model)
    _raise_for(monkeypatch, llm.engine, "_append", lambda seq, *a: seq.request_id == "victim")
    engine = AsyncEngine(llm.engine)
    engine.start()
    prompts = prompts_of_lengths(9, 6, seed=7)

    async def one(p: list[int], rid: str | None) -> Any:
        try:
            return [t for o in [o async for o in engine.generate(p, GREEDY, request_id=rid)] for t in o.new_token_ids]
        except RequestFailed as e:
            return e

    async def main() -> list[Any]:
        return await asyncio.gather(one(prompts[0], None), one(prompts[1], "victim"), one(prompts[0], None))

    try:
        ok1, failed, ok2 = asyncio.run(main())
        assert isinstance(failed, RequestFailed) and failed.request_id == "victim"
        assert "injected failure" in failed.message
        assert ok1 == ok2 == reference_greedy(model, prompts[0], 8)
        assert engine.healthy
        # step() itself raising (a bug outside its own handling): every request fails, the loop goes on
        real_step = llm.engine.step
        monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("step bug")))
        err = asyncio.run(one(prompts[0], None))
        assert isinstance(err, RequestFailed) and "step bug" in err.message
        monkeypatch.setattr(llm.engine, "step", real_step)
        assert engine.healthy
        again = asyncio.run(one(prompts[0], None))
        assert again == reference_greedy(model, prompts[0], 8)
    finally:
        engine.shutdown(timeout=2.0)
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity
