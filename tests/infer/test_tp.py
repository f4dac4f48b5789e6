"""TP=2 serving over gloo gives the same greedy tokens as TP=1 (rank 0 schedules, rank 1 follows)."""

from __future__ import annotations

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
