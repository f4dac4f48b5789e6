"""Sharded zarr checkpoints: save under one layout, load under another, atomic publishing, async saves."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcore_parallel import Group, ParallelConfig, ParallelState, shard_info
from mcore_parallel.checkpoint import (
    CheckpointFormatError,
    CheckpointManager,
    latest_checkpoint,
    read_region,
    sharded,
    zarr_io,
)
from mcore_parallel.ddp import DDPConfig, DistributedDataParallel
from mcore_parallel.optim import OptimizerConfig, get_optimizer
from mcore_parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mcore_parallel.testing import run_distributed


class Net(nn.Module):
    def __init__(self, tp: Group, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp
        self.emb = VocabParallelEmbedding(50, 16, tp=tp, seed=1, dtype=dtype)
        self.fc1 = ColumnParallelLinear(16, 32, tp=tp, stride=2, seed=2, dtype=dtype)
        self.fc2 = RowParallelLinear(16, 16, tp=tp, seed=3, dtype=dtype)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(self.emb(ids)).chunk(2, dim=-1)
        return (self.fc2(F.silu(gate) * up) * self.scale).float().pow(2).mean()

    def sharded_state_dict(self) -> dict:
        return {n: shard_info(n, p, self.tp) for n, p in self.named_parameters()}


def _setup(tp: int, dist_opt: bool, dtype: torch.dtype = torch.float32) -> tuple:
    state = ParallelState.initialize(ParallelConfig(tp=tp))
    net = Net(state.tp, dtype)
    ddp = DistributedDataParallel(net, state, DDPConfig(bucket_size=200, use_distributed_optimizer=dist_opt))
    opt = get_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=dist_opt), [ddp], state)
    return state, net, ddp, opt


def _train(state: ParallelState, ddp: nn.Module, opt: object, steps: int) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + state.dp.rank)
        opt.zero_grad()  # type: ignore[attr-defined]
        ddp(torch.randint(0, 50, (6, 2), generator=gen)).backward()
        ddp.finish_grad_sync()  # type: ignore[operator]
        opt.step()  # type: ignore[attr-defined]


def _matches_checkpoint(ckpt: Path, net: Net, opt: object | None) -> None:
    """Every piece this rank holds (weights, master weights, moments) equals the saved global arrays."""
    items = net.sharded_state_dict()
    for info in items.values():
        for local_idx, global_idx in info.pieces:
            saved = read_region(ckpt / "model" / info.key, global_idx)
            assert torch.equal(info.local.detach()[local_idx], saved.to(info.local.dtype)), info.key
    if opt is None:
        return
    for entry in opt.sharded_state():  # type: ignore[attr-defined]
        assert set(entry.tensors) == {"master", "exp_avg", "exp_avg_sq"}, entry.name
        for key, piece in entry.tensors.items():
            saved = read_region(ckpt / "optimizer" / entry.name / key)
            assert torch.equal(entry.select(saved), piece.float()), (entry.name, key)


def _save(root: str, tp: int, dist_opt: bool, async_save: bool, dtype: torch.dtype) -> None:
    state, net, ddp, opt = _setup(tp, dist_opt, dtype)
    _train(state, ddp, opt, 2)
    mgr = CheckpointManager(root, state, async_save=async_save)
    if async_save:  # hold the background writer until training has moved on, so a missing snapshot would show
        started = threading.Event()
        real_write = sharded.write_chunk

        def held_write(*args: object, **kwargs: object) -> int:
            started.wait(timeout=30)
            return real_write(*args, **kwargs)  # type: ignore[arg-type]

        sharded.write_chunk = held_write  # type: ignore[assignment]
    mgr.save("step_2", net.sharded_state_dict(), opt, metadata={"step": 2}, rank_state={"rank": state.rank})
    if async_save:  # the saved values are the ones at save(), even if training moves on meanwhile
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        _train(state, ddp, opt, 1)
        assert not all(torch.equal(before[n], p) for n, p in net.named_parameters())
        started.set()
        mgr.wait()
        sharded.write_chunk = real_write
        with torch.no_grad():
            after = {n: p.detach().clone() for n, p in net.named_parameters()}
            for n, p in net.named_parameters():
                p.copy_(before[n])
        _matches_checkpoint(Path(root) / "step_2", net, None)
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(after[n])
    else:
        _matches_checkpoint(Path(root) / "step_2", net, opt)


def _load(root: str, tp: int, dist_opt: bool, dtype: torch.dtype) -> float:
    state, net, ddp, opt = _setup(tp, dist_opt, dtype)
    mgr = CheckpointManager(root, state)
    path, meta, rank_state = mgr.load(net.sharded_state_dict(), opt)
    assert meta["step"] == 2 and meta["saved_layout"]["world_size"] >= 1
    saved_world = meta["saved_layout"]["world_size"]
    assert rank_state == ({"rank": state.rank} if state.rank < saved_world else None)
    _matches_checkpoint(path, net, opt)
    ids = torch.randint(0, 50, (6, 2), generator=torch.Generator().manual_seed(7))
    return ddp(ids).item()


@pytest.mark.parametrize(
    "save_world,save_tp,load_world,load_tp,dist_opt",
    [(4, 2, 2, 1, True), (2, 2, 4, 4, False), (4, 1, 4, 2, True), (2, 1, 1, 1, True)],
    ids=["tp2dp2-zero>dp2", "tp2>tp4", "dp4-zero>tp2dp2-zero", "dp2-zero>single"],
)
def test_reshard_round_trip(tmp_path: Path, save_world: int, save_tp: int, load_world: int, load_tp: int,
                            dist_opt: bool) -> None:  # fmt: skip
    root = str(tmp_path / "ckpt")
    run_distributed(_save, save_world, root, save_tp, dist_opt, False, torch.float32)
    losses = run_distributed(_load, load_world, root, load_tp, dist_opt, torch.float32)
    assert len(set(round(x, 6) for x in losses)) == 1
    assert latest_checkpoint(root) == Path(root) / "step_2"


def test_bf16_params_are_stored_as_zarr_bfloat16(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    run_distributed(_save, 2, root, 2, True, False, torch.bfloat16)
    meta = json.loads((Path(root) / "step_2/model/fc1.weight/zarr.json").read_text())
    assert meta["data_type"] == "bfloat16" and meta["shape"] == [32, 16] and meta["chunk_grid"]["configuration"][
        "chunk_shape"] == [8, 16]  # fmt: skip
    master = json.loads((Path(root) / "step_2/optimizer/fc1.weight/master/zarr.json").read_text())
    assert master["data_type"] == "float32"
    run_distributed(_load, 2, root, 1, False, torch.bfloat16)


def test_async_save_captures_values_at_save_time(tmp_path: Path) -> None:
    run_distributed(_save, 2, str(tmp_path / "ckpt"), 1, True, True, torch.float32)


def test_plain_zarr_reads_the_checkpoint(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    root = tmp_path / "ckpt"
    run_distributed(_save, 2, str(root), 2, False, False, torch.float32)
    arr = zarr.open_array(str(root / "step_2/model/fc1.weight"), mode="r")
    assert arr.shape == (32, 16) and arr.dtype == np.float32
    np.testing.assert_array_equal(arr[:], read_region(root / "step_2/model/fc1.weight").numpy())
    exp_avg = zarr.open_array(str(root / "step_2/optimizer/emb.weight/exp_avg"), mode="r")
    assert exp_avg.shape == (50, 16) and np.abs(exp_avg[:]).sum() > 0


def test_killed_save_leaves_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = ParallelState.initialize(ParallelConfig())
    net = Net(state.tp)
    mgr = CheckpointManager(tmp_path, state, keep_last=2)
    mgr.save("step_1", net.sharded_state_dict(), metadata={"step": 1})
    first = net.fc1.weight.detach().clone()
    with torch.no_grad():
        net.fc1.weight.add_(1.0)
    calls = {"n": 0}
    real = zarr_io.write_chunk

    def dying(*args: object, **kwargs: object) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated kill in the middle of a save")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("mcore_parallel.checkpoint.sharded.write_chunk", dying)
    with pytest.raises(KeyboardInterrupt):
        mgr.save("step_2", net.sharded_state_dict(), metadata={"step": 2})
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    assert (tmp_path / ".tmp.step_2").exists() and not (tmp_path / "step_2").exists()
    fresh = Net(state.tp)
    CheckpointManager(tmp_path, state).load(fresh.sharded_state_dict())
    assert torch.equal(fresh.fc1.weight, first)
    monkeypatch.setattr("mcore_parallel.checkpoint.sharded.write_chunk", real)
    for step in (2, 3, 4):  # the stale temporary directory is replaced; only the last two are kept
        mgr.save(f"step_{step}", net.sharded_state_dict(), metadata={"step": step})
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["latest", "step_3", "step_4"]
    assert not (tmp_path / ".tmp.step_2").exists()


def test_load_errors_name_the_problem(tmp_path: Path) -> None:
    state = ParallelState.initialize(ParallelConfig())
    with pytest.raises(CheckpointFormatError, match="no checkpoint to load"):
        CheckpointManager(tmp_path, state).load(Net(state.tp).sharded_state_dict())
    CheckpointManager(tmp_path, state).save("s", Net(state.tp).sharded_state_dict(), metadata={"step": 0})
    other = Net(state.tp)
    other.scale = nn.Parameter(torch.ones(17))
    with pytest.raises(CheckpointFormatError, match=r"saved shape \(16,\) does not match .* \(17,\) for 'scale'"):
        CheckpointManager(tmp_path, state).load(other.sharded_state_dict())
    (tmp_path / "s/model/fc2.weight/c/0/0").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointFormatError, match="truncated chunk"):
        CheckpointManager(tmp_path, state).load(Net(state.tp).sharded_state_dict())


def test_async_saves_reuse_one_staging_buffer(tmp_path: Path) -> None:
    """The second async save copies into the first one's host buffer (no new allocation); each checkpoint holds the
    values of its own save() call; a save that needs more room grows the buffer."""
    state = ParallelState.initialize(ParallelConfig())
    net = Net(state.tp)
    mgr = CheckpointManager(tmp_path, state, async_save=True)
    items = net.sharded_state_dict()
    mgr.save("step_1", items, metadata={"step": 1})
    buffer = mgr._staging._buffer
    assert buffer is not None and mgr._staging.nbytes >= net.fc1.weight.numel() * 4
    values_1 = net.fc1.weight.detach().clone()
    with torch.no_grad():
        net.fc1.weight.add_(1.0)  # while step_1 may still be written from the buffer
    mgr.save("step_2", items, metadata={"step": 2})  # waits for step_1, then reuses its buffer
    assert mgr._staging._buffer is buffer
    values_2 = net.fc1.weight.detach().clone()
    with torch.no_grad():
        net.fc1.weight.add_(1.0)
    mgr.wait()
    assert torch.equal(read_region(tmp_path / "step_1/model/fc1.weight"), values_1)
    assert torch.equal(read_region(tmp_path / "step_2/model/fc1.weight"), values_2)
    opt = get_optimizer(OptimizerConfig(lr=0.1), [net], state)
    mgr.save("step_3", items, opt, metadata={"step": 3})  # model + fp32 master + moments: more bytes
    mgr.wait()
    assert mgr._staging._buffer is not buffer and mgr._staging.nbytes > buffer.numel()
    assert torch.equal(read_region(tmp_path / "step_3/optimizer/fc1.weight/master"), net.fc1.weight.detach())


def test_reserved_staging_buffer_is_used_by_the_first_save(tmp_path: Path) -> None:
    """reserve() allocates the first save's host buffer ahead of time (in a thread); the first save then stages into
    it without allocating; a synchronous manager reserves nothing."""
    state = ParallelState.initialize(ParallelConfig())
    net = Net(state.tp)
    opt = get_optimizer(OptimizerConfig(lr=0.1), [net], state)
    items = net.sharded_state_dict()
    sync = CheckpointManager(tmp_path / "sync", state)
    sync.reserve(items, opt)
    assert sync._staging.nbytes == 0
    mgr = CheckpointManager(tmp_path / "async", state, async_save=True)
    mgr.reserve(items, opt)
    reserved = mgr._staging._buffer if mgr._staging.nbytes else None  # nbytes waits for the allocation
    assert reserved is not None and mgr._staging.nbytes >= 4 * 3 * net.fc1.weight.numel()  # master + 2 moments
    mgr.reserve(items, opt)  # big enough already: kept
    assert mgr._staging._buffer is reserved
    mgr.save("step_1", items, opt, metadata={"step": 1})
    assert mgr._staging._buffer is reserved
    mgr.wait()
    assert torch.equal(read_region(tmp_path / "async/step_1/optimizer/fc1.weight/master"), net.fc1.weight.detach())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_save_of_gpu_tensors_stages_into_pinned_memory(tmp_path: Path) -> None:
    """On a GPU the staging buffer is pinned and reused; the checkpoint holds the values at save() time."""
    state = ParallelState.initialize(ParallelConfig(), device="cuda")
    net = Net(state.tp).cuda()
    mgr = CheckpointManager(tmp_path, state, async_save=True)
    items = net.sharded_state_dict()
    for step in (1, 2):
        mgr.save(f"step_{step}", items, metadata={"step": step})
        expected = net.fc1.weight.detach().cpu().clone()
        with torch.no_grad():
            net.fc1.weight.add_(1.0)  # training goes on while the writer runs
        mgr.wait()
        assert torch.equal(read_region(tmp_path / f"step_{step}/model/fc1.weight"), expected)
        buffer = mgr._staging._buffer
        assert buffer is not None and buffer.is_pinned()
