"""Train the same model twice with different settings and compare the loss curves step by step (not a test).

Two ``torchrun`` launches of ``mcore_train.cli pretrain`` from the same seed, data and initialisation, differing only
in ``--a`` and ``--b`` overrides (e.g. the eager path against ``training.compile=layers
model.cross_entropy_fusion=true``). Prints both curves and their largest difference, writes them to ``--out``: an
optimisation that changes no numerics stays within float (on a GPU, bf16) rounding noise of the other curve.

    python bench/compare_runs.py --steps 200 --a --b training.compile=layers model.cross_entropy_fusion=true \\
        --extra model.preset=llama-1b data.seq_length=1024 training.micro_batch_size=4 training.global_batch_size=8
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _pretrain_launch import launch_pretrain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", nargs="*", default=[], help="overrides of run A (default: none)")
    ap.add_argument("--b", nargs="*", default=[], help="overrides of run B")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides of both runs")
    ap.add_argument("--recipe", default="llama-1b")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=560)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="compare_"))
    common = ["--recipe", args.recipe, "data.mock=true", "data.tokenizer=byte", f"training.train_iters={args.steps}",
              "logging.log_interval=1", "logging.progress_bar=false", "training.eval_iters=0",
              "training.generate_at_end=0", *args.extra]  # fmt: skip
    a = {r["step"]: r["loss"] for r in launch_pretrain(args.world, [*common, *args.a], work / "a", args.timeout)}
    b = {r["step"]: r["loss"] for r in launch_pretrain(args.world, [*common, *args.b], work / "b", args.timeout)}
    steps = sorted(set(a) & set(b))
    if len(steps) != args.steps:
        raise SystemExit(f"expected {args.steps} logged steps in both runs, got {len(a)} and {len(b)}")
    diffs = [abs(a[s] - b[s]) for s in steps]
    tail = steps[-min(20, len(steps)) :]
    result = {"a": args.a, "b": args.b, "extra": args.extra, "steps": steps, "loss_a": [a[s] for s in steps],
              "loss_b": [b[s] for s in steps], "max_abs_diff": max(diffs),
              "mean_abs_diff_last_20": sum(abs(a[s] - b[s]) for s in tail) / len(tail),
              "final_a": a[steps[-1]], "final_b": b[steps[-1]]}  # fmt: skip
    every = max(1, len(steps) // 20)
    print("| step | A | B | diff |")
    print("|---|---|---|---|")
    for s in steps[::every] + ([steps[-1]] if steps[-1] not in steps[::every] else []):
        print(f"| {s} | {a[s]:.4f} | {b[s]:.4f} | {abs(a[s] - b[s]):.2e} |")
    print(f"max |diff| {result['max_abs_diff']:.3e}; mean |diff| over the last 20 steps "
          f"{result['mean_abs_diff_last_20']:.3e}; final {result['final_a']:.4f} vs {result['final_b']:.4f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
