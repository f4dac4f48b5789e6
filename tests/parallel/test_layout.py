"""Rank layouts against memberships computed by hand, and the errors promised for impossible layouts."""

from __future__ import annotations

import pytest

from mcore_parallel import LaunchEnvironmentError, ParallelConfig, ParallelConfigError, RankLayout, read_launch_env
from mcore_parallel._launch import first_slurm_host


def groups(cfg: ParallelConfig, world: int, kind: str) -> list[list[int]]:
    return [list(g) for g in RankLayout.build(cfg, world).groups[kind]]


def test_tp2_pp2_dp2_default_order() -> None:
    cfg = ParallelConfig(tp=2, pp=2)
    lay = RankLayout.build(cfg, 8)
    assert lay.dp == 2
    assert groups(cfg, 8, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(cfg, 8, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(cfg, 8, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups(cfg, 8, "mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert groups(cfg, 8, "embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups(cfg, 8, "position_embedding") == [[0], [1], [2], [3]]
    assert groups(cfg, 8, "cp") == [[r] for r in range(8)]
    assert groups(cfg, 8, "dp_cp") == groups(cfg, 8, "dp")


def test_custom_order_tp_pp_dp() -> None:
    cfg = ParallelConfig(tp=2, pp=2, order="tp-pp-dp-cp-ep")
    assert groups(cfg, 8, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(cfg, 8, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(cfg, 8, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_context_parallel_groups() -> None:
    cfg = ParallelConfig(tp=2, cp=2)
    assert RankLayout.build(cfg, 8).dp == 2
    assert groups(cfg, 8, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(cfg, 8, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups(cfg, 8, "dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups(cfg, 8, "tp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_pp4_embedding_group_is_first_and_last_stage() -> None:
    cfg = ParallelConfig(pp=4)
    assert groups(cfg, 8, "pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups(cfg, 8, "embedding") == [[0, 6], [1, 7]]
    assert groups(cfg, 8, "dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_expert_groups_fold_over_dp() -> None:
    cfg = ParallelConfig(ep=4)
    lay = RankLayout.build(cfg, 8)
    assert (lay.dp, lay.expert_dp) == (8, 2)
    assert groups(cfg, 8, "ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(cfg, 8, "expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # expert tensor parallelism smaller than dense tp
    cfg = ParallelConfig(tp=2, ep=2, expert_tp=1)
    assert groups(cfg, 8, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(cfg, 8, "ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(cfg, 8, "expert_tp") == [[r] for r in range(8)]
    assert groups(cfg, 8, "expert_dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # expert_tp defaults to tp: ep then folds over dp*cp
    cfg = ParallelConfig(tp=2, ep=2)
    assert groups(cfg, 8, "expert_tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(cfg, 8, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(cfg, 8, "expert_tp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_every_kind_partitions_the_world() -> None:
    for cfg, world in [
        (ParallelConfig(tp=2, pp=2, cp=2), 16),
        (ParallelConfig(tp=4, ep=2, order="tp-dp-ep-cp-pp"), 16),
        (ParallelConfig(pp=2, cp=2, ep=2), 8),
    ]:
        lay = RankLayout.build(cfg, world)
        for kind, gs in lay.groups.items():
            flat = sorted(r for g in gs for r in g)
            if kind in ("embedding", "position_embedding"):
                continue
            assert flat == list(range(world)), kind
            assert len({len(g) for g in gs}) == 1, kind


def test_world_size_one() -> None:
    lay = RankLayout.build(ParallelConfig(), 1)
    assert all(gs == ((0,),) for gs in lay.groups.values())


def test_bad_layouts_list_every_conflict() -> None:
    with pytest.raises(ParallelConfigError) as exc:
        RankLayout.build(ParallelConfig(tp=3, pp=2), 8)
    msg = str(exc.value)
    assert "world size 8 is not divisible by tp*cp*pp = 3*1*2 = 6" in msg
    with pytest.raises(ParallelConfigError) as exc:
        RankLayout.build(ParallelConfig(tp=2, ep=3), 8)
    assert "ep=3 must divide dp*cp = 4" in str(exc.value)
    with pytest.raises(ParallelConfigError) as exc:
        RankLayout.build(ParallelConfig(tp=2, pp=3, ep=4), 8)
    assert len(exc.value.problems) == 1  # pp does not divide world: the expert check is not stacked on it
    with pytest.raises(ParallelConfigError) as exc:
        RankLayout.build(ParallelConfig(tp=4, cp=2, ep=8, expert_tp=2), 8)
    assert "expert_tp*ep = 2*8 = 16 does not divide" in str(exc.value)


def test_config_validation_reports_all_problems() -> None:
    with pytest.raises(ParallelConfigError) as exc:
        ParallelConfig(tp=0, pp=-1, vpp=0, order="tp-xp-dp-dp")
    problems = exc.value.problems
    text = "\n".join(problems)
    assert "tp=0 must be a positive integer" in text
    assert "pp=-1 must be a positive integer" in text
    assert "vpp=0" in text
    assert "unknown dimension(s) ['xp']" in text
    assert "repeats ['dp']" in text
    assert len(problems) >= 5
    with pytest.raises(ParallelConfigError, match="is missing"):
        ParallelConfig(order="tp-dp-pp")
    with pytest.raises(ParallelConfigError, match="vpp=2 needs pipeline parallelism"):
        ParallelConfig(vpp=2)
    assert isinstance(ParallelConfigError(["x"]), ValueError)


def test_launch_env_torchrun_slurm_and_none() -> None:
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.node_rank, env.source) == (3, 8, 1, 1, "torchrun")
    env = read_launch_env(
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
         "SLURM_JOB_NODELIST": "gpu[007-008]"}
    )  # fmt: skip
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.master_addr, env.master_port, env.source) == ("gpu007", 29500, "slurm")
    assert read_launch_env({}).world_size == 1
    assert first_slurm_host("node01,node02") == "node01"
    assert first_slurm_host("a[3,5-6]") == "a3"
    with pytest.raises(LaunchEnvironmentError, match="RANK='x'"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(LaunchEnvironmentError, match="rank 4 is outside"):
        read_launch_env({"RANK": "4", "WORLD_SIZE": "2"})


def test_a_layout_that_does_not_fit_is_said_in_integers() -> None:
    with pytest.raises(ParallelConfigError) as exc:
        RankLayout.build(ParallelConfig(tp=3), 1)
    msg = str(exc.value)
    assert exc.value.problems == [
        "world size 1 is not divisible by tp*cp*pp = 3*1*1 = 3; launch a multiple of 3 processes, or lower tp, cp "
        "or pp until their product divides 1"
    ]
    assert msg.startswith("parallel layout tp=3 pp=1 cp=1 ep=1 does not fit world size 1 (1 problem)"), msg
    with pytest.raises(ParallelConfigError) as exc:
        RankLayout.build(ParallelConfig(tp=2, cp=2, ep=3), 8)
    assert exc.value.problems[0].endswith("ep=3 must divide dp*cp = 2*2 = 4; choose an ep that divides 4")
