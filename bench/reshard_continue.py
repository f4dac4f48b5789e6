"""Save under one parallel layout, resume under another, and compare with a run that never stopped (not a test).

Three ``torchrun`` launches of ``mcore_train.cli pretrain`` on mock data, all with the same seed and data order:

1. ``straight``: ``--steps`` steps in layout A;
2. ``first half``: layout A, exits and saves at ``--steps // 2`` (``training.exit_interval``);
3. ``second half``: layout B (e.g. tp4·dp2 after tp2·pp2·dp2) resumes from that checkpoint to ``--steps``.

Reports the per-step losses of the straight run and of the resumed second half and their largest difference:
resharding is exact up to the float rounding of a different reduction order (bf16 noise on a GPU).

    python bench/reshard_continue.py --world 8 --first parallel.tp=2 parallel.pp=2 \\
        --second parallel.tp=4 --preset llama-1b --out reshard.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _pretrain_launch import launch_pretrain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--first", nargs="*", default=["parallel.tp=2", "parallel.pp=2"], help="layout A overrides")
    ap.add_argument("--second", nargs="*", default=["parallel.tp=4"], help="layout B overrides")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--recipe", default="llama-1b")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every launch")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reshard_"))
    common = ["--recipe", args.recipe, f"model.preset={args.preset}", "data.mock=true", "data.tokenizer=byte",
              f"training.train_iters={args.steps}", "logging.log_interval=1", "logging.progress_bar=false",
              "training.eval_iters=0", "training.generate_at_end=0", "scheduler.warmup_iters=2",
              "checkpoint.save_at_end=false", *args.extra]  # fmt: skip
    half = args.steps // 2
    straight = launch_pretrain(args.world, [*common, *args.first], work / "straight", args.timeout)
    ckpt = work / "ckpt"
    launch_pretrain(args.world, [*common, *args.first, f"training.exit_interval={half}", f"checkpoint.dir={ckpt}"],
           work / "first", args.timeout)  # fmt: skip
    second = launch_pretrain(
        args.world, [*common, *args.second, f"checkpoint.dir={ckpt}"], work / "second", args.timeout
    )
    want = {r["step"]: r["loss"] for r in straight}
    got = {r["step"]: r["loss"] for r in second}
    steps = sorted(got)
    if not steps or steps[0] != half + 1:
        raise SystemExit(f"the resumed run did not continue at step {half + 1}: logged steps {steps[:5]}...")
    diffs = [abs(got[s] - want[s]) for s in steps]
    result = {"first": args.first, "second": args.second, "world": args.world, "preset": args.preset,
              "straight": [want[s] for s in sorted(want)], "resumed": [got[s] for s in steps],
              "resumed_from_step": half, "max_abs_diff": max(diffs), "max_rel_diff": max(d / abs(want[s])
              for d, s in zip(diffs, steps))}  # fmt: skip
    print("| step | straight (layout A) | resumed (layout B) | diff |")
    print("|---|---|---|---|")
    for s in steps:
        print(f"| {s} | {want[s]:.5f} | {got[s]:.5f} | {abs(got[s] - want[s]):.2e} |")
    print(f"max |diff| {result['max_abs_diff']:.3e} (relative {result['max_rel_diff']:.2e})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
