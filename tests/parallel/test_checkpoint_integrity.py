"""Checksums and damage detection of the zarr checkpoint format, below the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.checkpoint import CheckpointFormatError, CheckpointManager, read_region, zarr_io
from tests.parallel.test_checkpoint import Net


def _saved(tmp_path: Path) -> tuple[ParallelState, Net]:
    state = ParallelState.initialize(ParallelConfig())
    net = Net(state.tp)
    CheckpointManager(tmp_path, state).save("s", net.sharded_state_dict(), metadata={"step": 1})
    return state, net


def test_chunks_carry_the_standard_crc32c_codec(tmp_path: Path) -> None:
    _saved(tmp_path)
    meta = json.loads((tmp_path / "s/model/fc1.weight/zarr.json").read_text())
    assert meta["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    chunk = tmp_path / "s/model/scale/c/0"
    raw = chunk.read_bytes()
    assert len(raw) == 16 * 4 + 4
    import crc32c

    assert int.from_bytes(raw[-4:], "little") == crc32c.crc32c(raw[:-4])
    assert json.loads((tmp_path / "s/zarr.json").read_text())["attributes"]["format_version"] == 2


def test_plain_zarr_checks_the_checksum_too(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    _saved(tmp_path)
    chunk = tmp_path / "s/model/scale/c/0"
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "s/model/scale"), mode="r")[:],
                                  read_region(tmp_path / "s/model/scale").numpy())  # fmt: skip
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x40
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        zarr.open_array(str(tmp_path / "s/model/scale"), mode="r")[:]
    with pytest.raises(CheckpointFormatError, match=f"{chunk}: checksum mismatch"):
        read_region(tmp_path / "s/model/scale")
    assert read_region(tmp_path / "s/model/scale", verify=False).shape == (16,)


def _strip_checksums(ckpt: Path) -> None:
    """Turn a checkpoint into the format-1 layout: chunks without CRC, no crc32c codec."""
    for meta_path in ckpt.rglob("zarr.json"):
        meta = json.loads(meta_path.read_text())
        if meta["node_type"] == "array":
            meta["codecs"] = meta["codecs"][:1]
            for chunk in (p for p in (meta_path.parent / "c").rglob("*") if p.is_file()):
                chunk.write_bytes(chunk.read_bytes()[:-4])
        elif meta_path.parent == ckpt:
            meta["attributes"]["format_version"] = 1
        meta_path.write_text(json.dumps(meta))


def test_old_checkpoints_without_checksums_still_load(tmp_path: Path) -> None:
    state, net = _saved(tmp_path)
    _strip_checksums(tmp_path / "s")
    fresh = Net(state.tp)
    CheckpointManager(tmp_path, state).load(fresh.sharded_state_dict())
    for (name, a), b in zip(net.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    (tmp_path / "s/model/scale/c/0").write_bytes(b"\0" * 60)  # sizes are still checked
    with pytest.raises(CheckpointFormatError, match="truncated chunk"):
        CheckpointManager(tmp_path, state).load(fresh.sharded_state_dict())


def test_missing_chunk_in_a_partial_read_is_an_error(tmp_path: Path) -> None:
    spec = zarr_io.ArraySpec((8, 4), torch.float32, (4, 4))
    zarr_io.write_array_metadata(tmp_path / "a", spec)
    zarr_io.write_chunk(tmp_path / "a", spec, (0, 0), torch.ones(4, 4))
    assert torch.equal(read_region(tmp_path / "a", (slice(1, 3), slice(0, 4))), torch.ones(2, 4))
    with pytest.raises(CheckpointFormatError, match=f"{tmp_path / 'a/c/1/0'}: missing chunk"):
        read_region(tmp_path / "a", (slice(2, 6), slice(0, 4)))
    with pytest.raises(CheckpointFormatError, match="missing chunk"):
        read_region(tmp_path / "a", (slice(5, 7), slice(0, 4)))


def test_every_problem_is_reported_before_any_tensor_is_touched(tmp_path: Path) -> None:
    state, _ = _saved(tmp_path)
    (tmp_path / "s/model/scale/c/0").unlink()
    (tmp_path / "s/model/fc2.weight/zarr.json").unlink()
    fresh = Net(state.tp)
    before = fresh.emb.weight.detach().clone()
    with pytest.raises(CheckpointFormatError, match="2 problems") as info:
        CheckpointManager(tmp_path, state).load(fresh.sharded_state_dict())
    assert sorted(p.split(":")[0] for p in info.value.problems) == [
        str(tmp_path / "s/model/fc2.weight/zarr.json"),
        str(tmp_path / "s/model/scale/c/0"),
    ]
    assert torch.equal(fresh.emb.weight, before)  # nothing was loaded


def _load_on_each_rank(root: str) -> str:
    state = ParallelState.initialize(ParallelConfig(tp=2))
    net = Net(state.tp)
    CheckpointManager(root, state).save("s", net.sharded_state_dict(), metadata={"step": 1})
    if state.rank == 0:
        (Path(root) / "s/model/fc2.weight/c/0/1").unlink()  # only rank 1 reads this chunk
    torch.distributed.barrier()
    try:
        CheckpointManager(root, state).load(Net(state.tp).sharded_state_dict())
    except CheckpointFormatError as e:
        return str(e)
    return "loaded"


def test_a_problem_only_one_rank_sees_stops_every_rank(tmp_path: Path) -> None:
    from mcore_parallel.testing import run_distributed

    messages = run_distributed(_load_on_each_rank, 2, str(tmp_path))
    assert "another rank found missing or damaged files" in messages[0]
    assert f"{tmp_path / 's/model/fc2.weight/c/0/1'}: missing chunk" in messages[1]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("data_type", "float16", "chunk of the wrong size"),  # the chunk's bytes read as another dtype
        ("shape", [5, 16], r"saved shape \(5, 16\) does not match the model.s global shape"),
    ],
)
def test_edited_array_metadata_is_an_error(tmp_path: Path, field: str, value: object, says: str) -> None:
    state, _ = _saved(tmp_path)
    meta_path = tmp_path / "s/model/fc1.weight/zarr.json"
    meta = json.loads(meta_path.read_text())
    assert meta[field] != value
    meta[field] = value
    meta_path.write_text(json.dumps(meta))
    fresh = Net(state.tp)
    with pytest.raises(CheckpointFormatError, match=says):
        CheckpointManager(tmp_path, state).load(fresh.sharded_state_dict())


def test_sample_verification_checks_the_first_and_every_eighth_chunk(tmp_path: Path) -> None:
    spec = zarr_io.ArraySpec((10, 4), torch.float32, (1, 4))
    zarr_io.write_array_metadata(tmp_path / "a", spec)
    for i in range(10):
        zarr_io.write_chunk(tmp_path / "a", spec, (i, 0), torch.full((1, 4), float(i)))
    for i in (0, 3, 8):
        raw = bytearray(zarr_io.chunk_path(tmp_path / "a", (i, 0)).read_bytes())
        raw[0] ^= 0x01
        zarr_io.chunk_path(tmp_path / "a", (i, 0)).write_bytes(bytes(raw))
    row = {i: (slice(i, i + 1), slice(0, 4)) for i in range(10)}
    for i in (0, 8):  # sampled: the first chunk, and chunk indices summing to a multiple of eight
        with pytest.raises(CheckpointFormatError, match="checksum mismatch"):
            read_region(tmp_path / "a", row[i], verify="sample")
    read_region(tmp_path / "a", row[3], verify="sample")  # not sampled: read as stored
    with pytest.raises(CheckpointFormatError, match="checksum mismatch"):
        read_region(tmp_path / "a", row[3], verify=True)
    read_region(tmp_path / "a", row[3], verify=False)


def test_verify_reports_an_array_the_manifest_lists_and_the_checkpoint_lacks(tmp_path: Path) -> None:
    import shutil

    from mcore_parallel.checkpoint import verify_checkpoint

    _saved(tmp_path)
    assert verify_checkpoint(tmp_path / "s") == []
    shutil.rmtree(tmp_path / "s/model/fc2.weight")  # the whole array, metadata and chunks
    assert verify_checkpoint(tmp_path / "s") == [
        f"{tmp_path / 's/model/fc2.weight'}: missing (listed in {tmp_path / 's/manifest.json'})"
    ]


def _save_tp2(root: str) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=2))
    CheckpointManager(root, state).save("s", Net(state.tp).sharded_state_dict(), metadata={"step": 1})


def test_the_manifest_lists_every_rank_s_arrays(tmp_path: Path) -> None:
    from mcore_parallel.testing import run_distributed

    run_distributed(_save_tp2, 2, str(tmp_path))
    listed = json.loads((tmp_path / "s/manifest.json").read_text())["arrays"]
    on_disk = {str(p.parent.relative_to(tmp_path / "s")) for p in (tmp_path / "s").rglob("zarr.json")}
    assert set(listed) == on_disk - {".", "model", "optimizer"}
    assert listed["model/fc1.weight"]["shape"] == list(Net(ParallelState.initialize().tp).fc1.weight.shape)


def _damage(chunk: Path) -> None:
    """Flip one bit of a chunk: same size, so only its checksum (checked as it is read) can tell."""
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))


def _load_with_a_damaged_chunk(root: str, optimizer: bool) -> str:
    """dp2 with the distributed optimizer (each rank reads its own half of the optimizer state) or tp2 (each rank its
    half of ``fc2.weight``): one chunk that only rank 1 reads is damaged."""
    from mcore_parallel.ddp import DDPConfig, DistributedDataParallel
    from mcore_parallel.optim import OptimizerConfig, get_optimizer

    state = ParallelState.initialize(ParallelConfig(tp=1 if optimizer else 2))
    net = Net(state.tp)
    # one bucket: the flat range splits in two halves, so some parameters lie wholly in rank 1's
    ddp = DistributedDataParallel(net, state, DDPConfig(bucket_size=1 << 20, use_distributed_optimizer=True))
    opt = get_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [ddp], state)
    CheckpointManager(root, state).save("s", net.sharded_state_dict(), opt, metadata={"step": 1})
    held = [None, None]  # the parameters whose optimizer state each rank holds a piece of
    torch.distributed.all_gather_object(held, {e.name for e in opt.sharded_state()})
    if state.rank == 0:
        ckpt = Path(root) / "s"
        if optimizer:  # a moment of a parameter only rank 1 holds a piece of
            name = sorted(held[1] - held[0])[0]
            _damage(sorted(f for f in (ckpt / "optimizer" / name / "exp_avg").rglob("*") if f.is_file())[0])
        else:
            _damage(ckpt / "model/fc2.weight/c/0/1")
    torch.distributed.barrier()
    try:
        CheckpointManager(root, state).load(net.sharded_state_dict(), opt if optimizer else None)
    except CheckpointFormatError as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize("optimizer", [False, True], ids=["model-tp2", "distributed-optimizer-dp2"])
def test_a_checksum_mismatch_one_rank_reads_stops_every_rank(tmp_path: Path, optimizer: bool) -> None:
    """A damaged chunk shows only on the ranks that read it, as they read it: every rank still raises (none goes
    on with a half-loaded state or waits in the distributed optimizer's all-gather)."""
    from mcore_parallel.testing import run_distributed

    messages = run_distributed(_load_with_a_damaged_chunk, 2, str(tmp_path), optimizer)
    assert "checksum mismatch" in messages[1], messages
    assert "another rank found a damaged chunk" in messages[0], messages
