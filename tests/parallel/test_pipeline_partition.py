"""Layer partitioning across pipeline stages: even split, explicit outer-stage counts, interleaved assignment, errors."""

from __future__ import annotations

import pytest

from mcore_parallel.pipeline import stage_layer_counts, stage_layer_range


def test_even_split_covers_every_layer_once() -> None:
    ranges = [stage_layer_range(8, 4, r) for r in range(4)]
    assert ranges == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_explicit_first_and_last_counts() -> None:
    assert stage_layer_counts(10, 4, first_stage_layers=1, last_stage_layers=3) == [1, 3, 3, 3]
    assert [stage_layer_range(10, 4, r, first_stage_layers=1, last_stage_layers=3) for r in range(4)] == [
        range(0, 1), range(1, 4), range(4, 7), range(7, 10)
    ]  # fmt: skip
    assert stage_layer_counts(7, 3, first_stage_layers=1) == [1, 3, 3]
    assert stage_layer_counts(5, 2, last_stage_layers=1) == [4, 1]
    assert stage_layer_counts(4, 2, first_stage_layers=1, last_stage_layers=3) == [1, 3]


def test_interleaved_follows_megatron_assignment() -> None:
    # 8 layers, pp=2, vpp=2: blocks of 2; chunk v of rank p holds block v*pp + p
    got = {(p, v): stage_layer_range(8, 2, p, 2, v) for p in range(2) for v in range(2)}
    assert got == {(0, 0): range(0, 2), (1, 0): range(2, 4), (0, 1): range(4, 6), (1, 1): range(6, 8)}
    all_layers = sorted(i for r in got.values() for i in r)
    assert all_layers == list(range(8))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=10, pp_size=4, pp_rank=0), r"num_layers=10 is not divisible by pp=4"),
        (dict(num_layers=6, pp_size=2, pp_rank=0, vpp_size=2), r"num_layers=6 is not divisible by pp\*vpp = 2\*2 = 4"),
        (
            dict(num_layers=11, pp_size=4, pp_rank=0, first_stage_layers=2, last_stage_layers=2),
            r"the 7 layers left after first_stage_layers=2 and last_stage_layers=2 do not divide evenly over the 2",
        ),
        (
            dict(num_layers=4, pp_size=2, pp_rank=0, first_stage_layers=3, last_stage_layers=3),
            r"first_stage_layers=3 \+ last_stage_layers=3 do not add up to num_layers=4",
        ),
        (
            dict(num_layers=4, pp_size=2, pp_rank=0, first_stage_layers=1, last_stage_layers=1),
            r"do not add up to num_layers=4 over pp=2 stages \(2 layers left for 0 other stages\)",
        ),
        (dict(num_layers=8, pp_size=2, pp_rank=2), r"pp_rank=2 must be in \[0, pp_size=2\)"),
        (dict(num_layers=8, pp_size=2, pp_rank=0, vpp_size=2, vpp_rank=2), r"vpp_rank=2 must be in \[0, vpp_size=2\)"),
        (dict(num_layers=8, pp_size=2, pp_rank=0, vpp_size=2, first_stage_layers=2), r"not supported with virtual"),
        (dict(num_layers=8, pp_size=1, pp_rank=0, first_stage_layers=2), r"the only stage holds all num_layers=8"),
    ],
)
def test_bad_splits_raise_with_numbers(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stage_layer_range(**kwargs)
