"""Checkpoint save/load benchmark of a training state (not a test).

Builds a ``GPTModel`` preset (bf16 weights) with mcore's mixed-precision optimizer (fp32 master weights and Adam
moments, after one real step) on one GPU, then measures on the same machine and the same tensors:

- mcore sharded zarr checkpoint: synchronous save, async save (time the caller is blocked, and until published), load;
- ``torch.save`` / ``torch.load`` of the same tensors (moved to CPU);
- ``torch.distributed.checkpoint`` (DCP) save / load, and ``async_save`` blocking time.

    python bench/checkpoint_bench.py --preset llama-1b --dir /tmp/ckpt_bench --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_models import GPTModel, preset
from mcore_parallel import ParallelState
from mcore_parallel.checkpoint import CheckpointManager
from mcore_parallel.ddp import DDPConfig, DistributedDataParallel
from mcore_parallel.optim import OptimizerConfig, get_optimizer


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _drop_caches(path: Path) -> None:
    os.sync()
    shutil.rmtree(path, ignore_errors=True)


def _tensor_state(model: GPTModel, opt: Any) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.local.detach() for k, v in model.sharded_state_dict().items()}
    for entry in opt.sharded_state():
        for key, t in entry.tensors.items():
            out[f"optimizer/{entry.name}/{key}"] = t
    return out


def _first_saves(root: Path, state: Any, items: Any, opt: Any, results: dict[str, Any], gb: float, which: str) -> None:
    """The first async save of a fresh manager: blocked time without reserve(), then with it (after the background
    allocation finished, as it does while a training loop runs its next steps)."""
    CheckpointManager(root / "warm", state).save("w", items, metadata={"step": 0})  # imports, writer threads
    _drop_caches(root / "warm")
    for reserve in {"both": (False, True), "plain": (False,), "reserved": (True,)}[which]:
        mgr = CheckpointManager(root / f"first_{int(reserve)}", state, async_save=True)
        if reserve:
            t = time.perf_counter()
            mgr.reserve(items, opt)
            results["mcore_reserve_call_s"] = time.perf_counter() - t
            mgr._staging.nbytes  # noqa: B018 - waits for the background allocation
            results["mcore_reserve_background_s"] = time.perf_counter() - t
        t = time.perf_counter()
        mgr.save("step_1", items, opt, metadata={"step": 1})
        key = "mcore_async_blocking_reserved_first_s" if reserve else "mcore_async_blocking_first_s"
        results[key] = time.perf_counter() - t
        mgr.wait()
        results[key.replace("blocking", "total")] = time.perf_counter() - t
        del mgr
        _drop_caches(root / f"first_{int(reserve)}")
        gc.collect()
    timings = ", ".join(f"{k} {v:.3f} s" for k, v in results.items() if k.startswith("mcore_"))
    print(f"{gb:.2f} GB, first async save: {timings}", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--first-save-only",
        choices=["both", "plain", "reserved"],
        default=None,
        help="only the first async save's blocking time: without reserve(), after it, or both in that order (the "
        "second then reuses the first's cached pinned block; one per process times the background allocation)",
    )
    return parser


def _init_single_process(root: Path) -> ParallelState:
    """A one-rank process group (a file store under ``root``) and its parallel state."""
    store = dist.FileStore(str(root / "store"), 1)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"  # DCP's async save needs a CPU backend
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
    return ParallelState.initialize()


def _trained_state(name: str, state: ParallelState) -> tuple[Any, GPTModel, Any]:
    """The preset's model (bf16 weights) with the mixed-precision optimizer (over its DDP wrapper) after one real
    step: config, model and optimizer."""
    device = state.device
    config = preset(name, params_dtype="bfloat16")
    model = GPTModel(config, device=device)
    ddp = DistributedDataParallel(model, state, DDPConfig())
    opt = get_optimizer(OptimizerConfig(lr=1e-4), [ddp], state)
    ids = torch.randint(0, config.vocab_size, (1, 512), device=device)
    opt.zero_grad()
    ddp(ids, labels=ids).mean().backward()
    ddp.finish_grad_sync()
    opt.step()
    return config, model, opt


def _mcore_saves(root: Path, state: Any, items: Any, opt: Any, config: Any, results: dict[str, Any]) -> None:
    """mcore's sharded zarr checkpoint: synchronous save and load, two async saves, and the first async save after
    ``reserve()``. Each manager lives until the next one exists (its staging buffer is not free to reuse before)."""
    # mcore: synchronous save, load
    mgr = CheckpointManager(root / "mcore", state)
    _sync()
    t = time.perf_counter()
    mgr.save("step_1", items, opt, metadata={"step": 1, "model": config.to_dict()})
    results["mcore_save_s"] = time.perf_counter() - t
    t = time.perf_counter()
    mgr.load(items, opt)
    _sync()
    results["mcore_load_s"] = time.perf_counter() - t
    _drop_caches(root / "mcore")
    # mcore: async saves (blocking part, then until published). The first one also allocates the host staging
    # buffer that later saves reuse; a training run pays that once, so the second save is the steady state.
    mgr = CheckpointManager(root / "mcore_async", state, async_save=True)
    for i, suffix in ((1, "_first"), (2, "")):
        t = time.perf_counter()
        mgr.save(f"step_{i}", items, opt, metadata={"step": i})
        results[f"mcore_async_blocking{suffix}_s"] = time.perf_counter() - t
        mgr.wait()
        results[f"mcore_async_total{suffix}_s"] = time.perf_counter() - t
        _drop_caches(root / "mcore_async")

    # mcore: the first async save of a run whose loop reserved the staging buffer after its first step (the loop
    # trains while the buffer is allocated in the background; here the bench just waits for it)
    mgr = CheckpointManager(root / "mcore_reserved", state, async_save=True)
    t = time.perf_counter()
    mgr.reserve(items, opt)
    results["mcore_reserve_call_s"] = time.perf_counter() - t  # what the loop's step pays for reserve()
    assert mgr._staging.nbytes > 0  # waits for the background allocation
    results["mcore_reserve_background_s"] = time.perf_counter() - t
    t = time.perf_counter()
    mgr.save("step_1", items, opt, metadata={"step": 1})
    results["mcore_async_blocking_reserved_first_s"] = time.perf_counter() - t
    mgr.wait()
    del mgr
    _drop_caches(root / "mcore_reserved")


def _torch_saves(root: Path, tensors: dict[str, torch.Tensor], results: dict[str, Any]) -> None:
    """``torch.save`` / ``torch.load`` of the same tensors (moved to CPU, loaded back into them)."""
    gc.collect()
    t = time.perf_counter()
    cpu = {k: v.detach().cpu() for k, v in tensors.items()}
    torch.save(cpu, root / "torch_save.pt")
    results["torch_save_s"] = time.perf_counter() - t
    del cpu
    t = time.perf_counter()
    loaded = torch.load(root / "torch_save.pt", map_location="cpu", weights_only=True)
    for k, v in loaded.items():
        tensors[k].copy_(v)
    _sync()
    results["torch_load_s"] = time.perf_counter() - t
    del loaded
    (root / "torch_save.pt").unlink()


def _dcp_saves(root: Path, tensors: dict[str, torch.Tensor], results: dict[str, Any]) -> None:
    """``torch.distributed.checkpoint``: save, load, and two ``async_save`` calls where it has one."""
    import torch.distributed.checkpoint as dcp

    t = time.perf_counter()
    dcp.save(tensors, checkpoint_id=str(root / "dcp"))
    results["dcp_save_s"] = time.perf_counter() - t
    t = time.perf_counter()
    dcp.load(tensors, checkpoint_id=str(root / "dcp"))
    _sync()
    results["dcp_load_s"] = time.perf_counter() - t
    _drop_caches(root / "dcp")
    if hasattr(dcp, "async_save"):
        for i, suffix in ((1, "_first"), (2, "")):
            t = time.perf_counter()
            fut = dcp.async_save(tensors, checkpoint_id=str(root / f"dcp_async{i}"))
            results[f"dcp_async_blocking{suffix}_s"] = time.perf_counter() - t
            fut.result()
            results[f"dcp_async_total{suffix}_s"] = time.perf_counter() - t
            _drop_caches(root / f"dcp_async{i}")


def _with_throughputs(results: dict[str, Any], gb: float) -> dict[str, Any]:
    """``results`` with GB/s beside every full save and load time, without the keys whose value is None."""
    for key in [k for k in results if k.endswith("_s")]:
        if "blocking" not in key and "first" not in key and "reserve" not in key:
            results[key[:-2] + "_gb_per_s"] = gb / results[key]
    return {k: v for k, v in results.items() if v is not None}


def _print_table(name: str, results: dict[str, Any], gb: float, n_tensors: int) -> None:
    print(f"{name} training state: {gb:.2f} GB in {n_tensors} tensors on {results['gpu']}")
    print("| method | save s (GB/s) | load s (GB/s) | async blocked s: first / later save | async total s |")
    print("|---|---|---|---|---|")
    for method, label in (("mcore", "mcore zarr"), ("torch", "torch.save/load"),
                          ("dcp", "torch.distributed.checkpoint")):  # fmt: skip
        save, load = results.get(f"{method}_save_s"), results.get(f"{method}_load_s")
        first, blocked = results.get(f"{method}_async_blocking_first_s"), results.get(f"{method}_async_blocking_s")
        total = results.get(f"{method}_async_total_s")
        blocked_col = f"{first:.2f} / {blocked:.2f}" if first is not None and blocked is not None else "-"
        total_col = f"{total:.2f}" if total is not None else "-"
        print(
            f"| {label} | {save:.2f} ({gb / save:.2f}) | {load:.2f} ({gb / load:.2f}) | {blocked_col} | {total_col} |"
        )
    print(
        f"first async save after reserve(): blocked {results['mcore_async_blocking_reserved_first_s']:.2f} s "
        f"(reserve() call {results['mcore_reserve_call_s']:.2f} s, background allocation "
        f"{results['mcore_reserve_background_s']:.2f} s)"
    )


def main() -> None:
    args = _parser().parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    state = _init_single_process(root)
    config, model, opt = _trained_state(args.preset, state)
    tensors = _tensor_state(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    gb = nbytes / 1e9
    results: dict[str, Any] = {"preset": args.preset, "state_gb": gb, "tensors": len(tensors),
                               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    items = model.sharded_state_dict()
    if args.first_save_only:
        _first_saves(root, state, items, opt, results, gb, args.first_save_only)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()
        return
    _mcore_saves(root, state, items, opt, config, results)
    _torch_saves(root, tensors, results)
    _dcp_saves(root, tensors, results)
    results = _with_throughputs(results, gb)
    _print_table(args.preset, results, gb, len(tensors))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
