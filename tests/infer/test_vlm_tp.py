"""Serving a LLaVA VLM at tp=2 (gloo, CPU) gives the tp=1 greedy tokens: an image cut across prefill chunks, two
images in one request, two requests in one step, a preempted request (encoded again), an aborted one; each rank runs
the tower as often as tp=1 does, the follower holds exactly the embeddings the first rank holds (nothing left once the
requests are done, nothing after an idle engine's keep-alive). (test_vlm_serving.py: a LLaVA checkpoint at tp=2.)"""

from __future__ import annotations

from typing import Any

import torch

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_models.multimodal import LlavaModel
from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.testing import run_distributed
from tests.infer._vlm import S, prompt, tiny_vlm

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BASE: dict[str, Any] = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_images=2, max_model_len=128)
CASES: dict[str, dict[str, Any]] = {
    "chunked": dict(max_num_batched_tokens=24),  # 24-token chunks cut the images
    "batched": dict(max_num_batched_tokens=128),  # two prefills in one step
    "preempted": dict(num_blocks=8, max_num_batched_tokens=96),  # 7 blocks: the second request is preempted
}


def pixels(seed: int, n: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, S, S, generator=torch.Generator().manual_seed(seed))


def shard(tp: Group) -> LlavaModel:
    """This rank's shard of ``tiny_vlm()``, loaded from its global weights."""
    model = LlavaModel(tiny_vlm().config, tp=tp).eval()
    model.load_global_state_dict(tiny_vlm().global_state_dict())
    return model


class Driver:
    """The first rank's engine, counting the tower runs and checking after every step that the followers are told
    to keep exactly the embeddings the requests hold."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.engine, self.calls = llm, llm.engine, []
        encode = llm.runner.encode_images
        llm.runner.encode_images = lambda px: (self.calls.append(px.shape[0]), encode(px))[1]  # type: ignore

    def add(self, ids: list[int], px: torch.Tensor, params: SamplingParams = GREEDY) -> str:
        return self.engine.add_request(ids, params, images=px)

    def step(self) -> dict[str, list[int]]:
        done = {o.request_id: o.token_ids for o in self.engine.step() if o.finished}
        driver = self.llm.runner.driver_images
        if driver is not None:
            held = {
                s.images.key for s in self.engine._seqs.values() if s.images is not None and s.images.embeds is not None
            }
            assert driver.live == held and None not in held, (driver.live, held)
        return done

    def run(self, reqs: list[tuple[list[int], torch.Tensor]], params: SamplingParams = GREEDY) -> list[list[int]]:
        rids = [self.add(ids, px, params) for ids, px in reqs]
        done: dict[str, list[int]] = {}
        while self.engine.has_work():
            done.update(self.step())
        return [done[r] for r in rids]


def _chunked(d: Driver) -> dict[str, Any]:
    out: dict[str, Any] = {"one": d.run([(prompt(16, 9), pixels(1))]), "one_calls": list(d.calls)}
    out["two_images"] = d.run([(prompt(3, 5, images=2, seed=1), pixels(2, 2))])
    rid = d.add(prompt(16, 9, seed=6), pixels(6))
    d.step()  # its image encoded, half of it prefilled
    assert d.engine._seqs[rid].images.embeds is not None
    d.engine.abort(rid)
    d.step()
    out["after_abort"] = d.run([(prompt(20, 30, seed=7), pixels(7))])
    out["calls"] = d.calls
    return out


def _batched(d: Driver) -> dict[str, Any]:
    rids = [d.add(ids, px) for ids, px in [(prompt(5, 7, seed=3), pixels(4)), (prompt(9, 2, seed=5), pixels(5))]]
    done = d.step()
    first = list(d.calls)  # both prefills in the first step, each image encoded once
    while d.engine.has_work():
        done.update(d.step())
    return {"tokens": [done[r] for r in rids], "first_step_calls": first, "calls": d.calls}


def _preempted(d: Driver) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    tokens = d.run([(prompt(16, 9, seed=8), pixels(8)), (prompt(16, 9, seed=9), pixels(9))], params)
    return {"tokens": tokens, "preemptions": d.engine.scheduler.num_preemptions, "calls": d.calls}


DRIVE = {"chunked": _chunked, "batched": _batched, "preempted": _preempted}


def _follow(llm: LLM) -> dict[str, Any]:
    """A follower: its tower runs, and how many embeddings it holds after each image message and at the end."""
    follower = llm.runner.follower_images
    assert follower is not None
    sizes: list[int] = []
    handle = follower.handle
    follower.handle = lambda m: (handle(m), sizes.append(len(follower.cache)))[0]  # type: ignore
    llm.follow()
    return {"encodes": follower.num_encodes, "left": len(follower.cache), "sizes": sizes}


def _serve(tp_size: int) -> dict[str, Any]:
    state = ParallelState.initialize(ParallelConfig(tp=tp_size))
    model = shard(state.tp)
    out: dict[str, Any] = {}
    for name, cfg in CASES.items():
        llm = LLM(model=model, config=EngineConfig(**{**BASE, **cfg}))
        if not llm.is_driver:
            out[name] = _follow(llm)
            continue
        out[name] = DRIVE[name](Driver(llm))
        llm.runner.keep_alive()  # idle: the drops still pending reach the follower now
        if llm.runner.driver_images is not None:
            assert not llm.runner.driver_images.live and not llm.runner.driver_images.drops
        llm.shutdown()
    return out


def test_tp2_equals_tp1_and_the_follower_holds_what_the_first_rank_holds() -> None:
    (single,) = run_distributed(_serve, 1, 1)
    first, follower = run_distributed(_serve, 2, 2)
    assert first == single  # every token and every tower run (count and size) on the first rank
    c = single["chunked"]
    assert c["one_calls"] == [1] and c["calls"] == [1, 2, 1, 1]  # once per request, over several prefill steps
    assert single["batched"]["first_step_calls"] == [1, 1]
    assert single["preempted"]["preemptions"] >= 1
    assert len(single["preempted"]["calls"]) == 2 + single["preempted"]["preemptions"]  # encoded again
    for name in CASES:
        f = follower[name]
        assert f["encodes"] == len(single[name]["calls"]), name  # the follower ran the tower with it each time
        assert f["left"] == 0 and f["sizes"][-1] == 0, (name, f)  # nothing leaks; the idle keep-alive freed it
        assert max(f["sizes"]) <= 2, (name, f)  # embeddings dropped as the prompts are prefilled
