"""Expert-parallel parameters as global ``[num_experts, ...]`` arrays: ``shard_info`` pieces over ep x expert_tp
(every element once, on chunk boundaries, TP-replicated expert tensors flagged), the checkpoint writers (each chunk
written by exactly one rank), and a checkpoint saved at ep=2 loaded at ep=1, 2 and 4 (with expert TP too) with
weights and optimizer state equal to the saved global arrays, then training on identically to the saving run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mcore_parallel import Group, ParallelState, shard_info
from mcore_parallel.checkpoint import CheckpointManager, read_region, sharded
from mcore_parallel.ddp import DDPConfig, DistributedDataParallel
from mcore_parallel.optim import OptimizerConfig, get_optimizer
from mcore_parallel.testing import run_distributed
from tests.parallel.moe_toy import FC1, FC2, H, ToyMoE, config, full_weights, local_piece, tokens

# ------------------------------------------------------------------------------------------------ shard_info


def _expert(key: str, full: torch.Tensor, ep: tuple[int, int], etp: tuple[int, int]) -> torch.Tensor:
    t = local_piece(key, full, ep, etp) if key in (FC1, FC2) else full.chunk(ep[1])[ep[0]].clone()
    t.expert_parallel, t.expert_shard, t.global_shape = True, ep, tuple(full.shape)  # type: ignore[attr-defined]
    if etp[1] > 1 and key in (FC1, FC2):
        t.tensor_model_parallel, t.partition_dim = True, 1 if key == FC1 else 2  # type: ignore[attr-defined]
        t.partition_stride = 2 if key == FC1 else 1  # type: ignore[attr-defined]
    return t


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("etp", [1, 2])
def test_pieces_cover_the_global_tensor_once(ep: int, etp: int) -> None:
    weights = full_weights(3)
    weights["bias"] = torch.randn(4, H, dtype=torch.float64)  # an expert tensor that expert TP does not split
    for key, full in ((FC1, weights[FC1]), (FC2, weights[FC2]), ("bias", weights["bias"])):
        covered = torch.zeros_like(full)
        assembled = torch.full_like(full, float("nan"))
        for ep_rank in range(ep):
            for tp_rank in range(etp):
                local = _expert(key, full, (ep_rank, ep), (tp_rank, etp))
                info = shard_info(key, local, Group("expert_tp", tuple(range(etp)), tp_rank))
                assert info.expert_parallel and info.global_shape == tuple(full.shape)
                assert info.chunk_shape is not None and info.chunk_shape[0] == 4 // ep
                assert info.replica == (key == "bias" and tp_rank > 0), (key, tp_rank)
                for _, g in info.pieces:
                    assert all(s.start % c == 0 for s, c in zip(g, info.chunk_shape)), "piece off a chunk boundary"
                if not info.replica:
                    info.scatter_into(assembled)
                    for _, g in info.pieces:
                        covered[g] += 1
                back = torch.zeros_like(local)
                shard_info(key, back, Group("expert_tp", tuple(range(etp)), tp_rank), like=local).load_from(full)
                assert torch.equal(back, local), key
        assert torch.all(covered == 1), f"{key}: every element written by exactly one (ep, expert_tp) rank"
        assert torch.equal(assembled, full), key


def test_bad_expert_shard_is_an_error() -> None:
    t = _expert(FC2, full_weights()[FC2], (0, 2), (0, 1))
    t.expert_shard = (0, 4)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="expert_shard"):
        shard_info(FC2, t, Group.single())


# ------------------------------------------------------------------------------------------------ checkpoints
def _setup(ep: int, etp: int | None, dist_opt: bool, seed: int) -> tuple:
    state = ParallelState.initialize(config(ep, etp))
    model = ToyMoE(state, full_weights(seed))
    ddp = DistributedDataParallel(model, state, DDPConfig(bucket_size=40, use_distributed_optimizer=dist_opt))
    opt = get_optimizer(OptimizerConfig(lr=1e-2, adam_eps=1e-6, use_distributed_optimizer=dist_opt), [ddp], state)
    return state, model, ddp, opt


def _step(state: ParallelState, ddp: DistributedDataParallel, opt: object, step: int) -> None:
    x = tokens(step, 4).reshape(state.dp_cp.size, -1, H)[state.dp_cp.rank].float()  # 4 * TOKENS tokens per step
    opt.zero_grad()  # type: ignore[attr-defined]
    ddp(x).backward()
    ddp.finish_grad_sync()
    assert opt.step().success  # type: ignore[attr-defined]


def _pieces(model: ToyMoE) -> dict[str, list]:
    """This rank's pieces of every parameter as (global index, values), to assemble the global tensors."""
    return {k: [(g, info.local.detach()[loc].clone()) for loc, g in info.pieces]
            for k, info in model.sharded_state_dict().items()}  # fmt: skip


def _matches_checkpoint(ckpt: Path, model: ToyMoE, opt: object) -> None:
    for info in model.sharded_state_dict().values():
        for local_idx, global_idx in info.pieces:
            saved = read_region(ckpt / "model" / info.key, global_idx)
            assert torch.equal(info.local.detach()[local_idx], saved.to(info.local.dtype)), info.key
    for entry in opt.sharded_state():  # type: ignore[attr-defined]
        assert set(entry.tensors) == {"master", "exp_avg", "exp_avg_sq"}, entry.name
        for key, piece in entry.tensors.items():
            saved = read_region(ckpt / "optimizer" / entry.name / key)
            assert torch.equal(entry.select(saved), piece.float()), (entry.name, key)


def _save(root: str, ep: int, etp: int | None, dist_opt: bool) -> dict:
    state, model, ddp, opt = _setup(ep, etp, dist_opt, seed=0)
    for step in range(2):
        _step(state, ddp, opt, step)
    items = model.sharded_state_dict()
    plans = sharded.plan_model_writes(items, state) + sharded.plan_optimizer_writes(opt, items, state)
    chunks = [(job.path, index, job.spec.shape, job.spec.chunk_shape) for job in plans for index, _ in job.chunks]
    CheckpointManager(root, state).save("step_2", items, opt, metadata={"step": 2})
    _matches_checkpoint(Path(root) / "step_2", model, opt)
    _step(state, ddp, opt, 2)
    return dict(chunks=chunks, final=_pieces(model))


def _load(root: str, ep: int, etp: int | None, dist_opt: bool) -> dict:
    state, model, ddp, opt = _setup(ep, etp, dist_opt, seed=5)  # other weights: the load must replace them
    path, meta, _ = CheckpointManager(root, state).load(model.sharded_state_dict(), opt)
    assert meta["saved_layout"]["ep"] == 2
    _matches_checkpoint(path, model, opt)
    _step(state, ddp, opt, 2)
    return dict(final=_pieces(model))


def _assemble(outs: list[dict]) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for name, w in full_weights().items():
        t = full.setdefault(name, torch.full(w.shape, float("nan")))
        for out in outs:
            for g, values in out["final"][name]:
                t[g] = values.float()
        assert not t.isnan().any(), f"{name}: not every element is held by some rank"
    return full


SAVES = {"w4-ep2-distopt": (2, None, True), "w4-ep2-etp2": (2, 2, False)}
LOADS = {"w1-ep1": (1, 1, None), "w2-ep1": (2, 1, None), "w2-ep2": (2, 2, None), "w4-ep4": (4, 4, None),
         "w4-ep1-etp2": (4, 1, 2)}  # fmt: skip


@pytest.mark.parametrize("save", list(SAVES))
def test_saved_at_ep2_loads_at_other_layouts(tmp_path: Path, save: str) -> None:
    ep, etp, dist_opt = SAVES[save]
    saved = run_distributed(_save, 4, str(tmp_path), ep, etp, dist_opt)
    written = [c for out in saved for c in out["chunks"]]
    assert len(written) == len(set(written)), "a chunk is written by more than one rank"
    for path, shape, chunk in {(p, s, c) for p, _, s, c in written}:
        grid = math.prod(-(-n // c) for n, c in zip(shape, chunk))
        assert len({i for p, i, _, _ in written if p == path}) == grid, f"{path}: chunks missing"
    assert any(p.startswith("optimizer/experts.linear_fc1.weight/") for p, *_ in written)
    expected = _assemble(saved)  # the saving run, one step after the save
    for world, load_ep, load_etp in LOADS.values():
        loaded = _assemble(run_distributed(_load, world, str(tmp_path), load_ep, load_etp, not dist_opt))
        for name, t in expected.items():
            torch.testing.assert_close(loaded[name], t, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
