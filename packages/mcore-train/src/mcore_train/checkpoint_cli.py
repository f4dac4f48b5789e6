"""``mcore-train checkpoint verify|inspect DIR``: check or describe a checkpoint without loading a model.

mcore-train checkpoint verify runs/demo                 # every checkpoint of a run and its latest pointer
mcore-train checkpoint verify runs/demo/step_0000100    # one checkpoint; exit 0 when good, 2 with the problems
mcore-train checkpoint inspect runs/demo --json         # steps, arrays (shape, dtype), saved layout, config
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_checkpoint_parser", "run_checkpoint_command", "inspect_path"]

_MODEL_SUMMARY = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "vocab_size", "max_position_embeddings")  # fmt: skip
_CONFIG_SUMMARY = ("recipe", "training.train_iters", "training.global_batch_size", "training.micro_batch_size",
                   "data.seq_length", "data.path", "optimizer.optimizer", "optimizer.lr", "parallel.tp", "parallel.pp",
                   "tokenizer")  # fmt: skip
_COUNTERS = ("step", "consumed_samples", "consumed_tokens", "skipped_steps", "format_version")


def add_checkpoint_parser(sub: Any) -> None:
    """Register ``checkpoint verify`` and ``checkpoint inspect`` on the CLI's subparsers."""
    p = sub.add_parser("checkpoint", help="verify or inspect a checkpoint (or a run directory of them)")
    actions = p.add_subparsers(dest="checkpoint_command", required=True)
    verify = actions.add_parser("verify", help="read every chunk: checksums, sizes, missing arrays (exit 2 if bad)")
    verify.add_argument("dir", help="a checkpoint directory (step_...) or a run directory with a latest pointer")
    verify.add_argument("--no-checksums", action="store_true", help="check presence and sizes only")
    inspect = actions.add_parser("inspect", help="steps, arrays with shapes and dtypes, saved layout, config")
    inspect.add_argument("dir", help="a checkpoint directory or a run directory")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")


def _config_summary(meta: dict[str, Any]) -> dict[str, Any]:
    """A few keys of the saved training config (``config`` attribute), by dotted name."""
    out = {}
    for dotted in _CONFIG_SUMMARY:
        node: Any = meta.get("config") if dotted != "tokenizer" else meta
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out[dotted] = node
    return out


def _describe(ckpt: Path) -> dict[str, Any]:
    from mcore_parallel.checkpoint import CheckpointFormatError, read_metadata
    from mcore_parallel.checkpoint.verify import find_arrays

    out: dict[str, Any] = {"path": str(ckpt)}
    try:
        meta = read_metadata(ckpt)
    except CheckpointFormatError as e:
        out["error"] = str(e)
        meta = {}
    out.update({k: meta[k] for k in _COUNTERS if k in meta})
    out["saved_layout"] = meta.get("saved_layout")
    model = meta.get("model") or {}
    lm = model.get("language", model)  # a LLaVA checkpoint: its language model, tower and image token
    out["model"] = {k: lm[k] for k in _MODEL_SUMMARY if k in lm}
    if "vision" in model:
        vision = model["vision"]
        out["model"]["vision"] = (vision.get("extra") or {}).get("preset") or f"{vision.get('num_layers')} layers"
        out["model"].update({k: model[k] for k in ("image_token_id", "projector", "freeze") if k in model})
    out["config"] = _config_summary(meta)
    arrays: list[dict[str, Any]] = []
    for a in find_arrays(ckpt):
        if a.spec is None:
            arrays.append({"name": a.name, "problem": a.problem})
        else:
            arrays.append({"name": a.name, "shape": list(a.spec.shape), "dtype": a.spec.zarr_dtype,
                           "chunk_shape": list(a.spec.chunk_shape), "checksum": a.spec.checksum})  # fmt: skip
    out["arrays"] = arrays
    return out


def inspect_path(path: Path) -> dict[str, Any]:
    """What ``checkpoint inspect`` prints, as a dict: the latest pointer and every checkpoint described."""
    from mcore_parallel.checkpoint import CheckpointFormatError, latest_checkpoint
    from mcore_parallel.checkpoint.verify import checkpoints_in

    if (path / "zarr.json").exists():
        return {"latest": None, "checkpoints": [_describe(path)]}
    try:
        latest = latest_checkpoint(path)
        pointer = None if latest is None else latest.name
    except CheckpointFormatError as e:
        pointer = f"error: {e}"
    return {"latest": pointer, "checkpoints": [_describe(c) for c in checkpoints_in(path)]}


def _print_inspect(info: dict[str, Any]) -> None:
    w = sys.stdout.write
    if info["latest"] is not None:
        w(f"latest: {info['latest']}\n")
    for c in info["checkpoints"]:
        w(f"{c['path']}\n")
        if "error" in c:
            w(f"  error: {c['error']}\n")
        w("  " + ", ".join(f"{k} {c[k]}" for k in _COUNTERS if k in c) + "\n")
        w(f"  saved layout: {c['saved_layout']}\n  model: {c['model']}\n")
        if c["config"]:
            w("  config: " + ", ".join(f"{k}={v}" for k, v in c["config"].items()) + "\n")
        for a in c["arrays"]:
            if "problem" in a:
                w(f"  {a['name']}: PROBLEM {a['problem']}\n")
            else:
                crc = "crc32c" if a["checksum"] else "no checksum"
                w(f"  {a['name']}: {a['dtype']} {tuple(a['shape'])} chunks {tuple(a['chunk_shape'])} {crc}\n")


def run_checkpoint_command(args: argparse.Namespace) -> int:
    """Exit code: 0 when good, 2 when the path is not a good checkpoint (the problems printed on stderr)."""
    path = Path(args.dir)
    if args.checkpoint_command == "inspect":
        if not path.is_dir():
            sys.stderr.write(f"{path}: {'not a directory' if path.exists() else 'does not exist'}\n")
            return 2
        info = inspect_path(path)
        if args.json:
            sys.stdout.write(json.dumps(info, indent=1) + "\n")
        else:
            _print_inspect(info)
        return 0
    from mcore_parallel.checkpoint.verify import verify_path

    result = verify_path(path, checksums=not args.no_checksums)
    for ckpt in result["checked"]:
        sys.stdout.write(f"checked {ckpt}\n")
    if result["problems"]:
        n = len(result["problems"])
        sys.stderr.write(f"{path}: {n} problem{'s' if n != 1 else ''}:\n")
        sys.stderr.write("".join(f"  - {p}\n" for p in result["problems"]))
        return 2
    sys.stdout.write(f"{path}: OK ({len(result['checked'])} checkpoint(s), every chunk read)\n")
    return 0
