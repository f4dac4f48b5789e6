"""The benchmark suites of mcore: one command per suite, each with its anchor measured in the same call.

    python bench/run.py --list                           # the suites, what they measure, how long they take
    python bench/run.py train-1gpu                       # -> bench/results/train-1gpu/<hardware>.{json,md}
    python bench/run.py serve kernels --out /tmp/res     # several suites, results under /tmp/res
    python bench/run.py data --quick                     # fewer steps and smaller inputs: checks, not the numbers
    python bench/run.py train-2gpu --dry-run             # print the commands a suite would run
    python bench/run.py --compare old.json new.json      # two results of a suite side by side

A suite runs the scripts beside this file as child processes (``torchrun`` where a case needs several GPUs), with
the packages of this checkout on ``PYTHONPATH`` (or of another one, ``--packages``). It writes one JSON per suite,
``<out>/<suite>/<hardware>.json`` (the commands, the environment: GPU, driver, torch, CUDA, date, commit, and the
tables; every row names the command that measured it) and the same tables as markdown beside it, and prints them.
``<hardware>`` is the GPU's name from ``nvidia-smi`` (``h200``; ``h200x2`` when the suite used two), or
``cpu-<N>cores`` for a suite that ran without a GPU. ``bench/README.md`` describes the suites.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _fp8_suites import FP8_SUITES
from _harness import Context
from _long_suites import LONG_SUITES
from _mamba_suites import MAMBA_SUITES
from _system_suites import SYSTEM_SUITES
from _train_suites import TRAIN_SUITES

SUITES = {s.name: s for s in [*TRAIN_SUITES, *LONG_SUITES, *MAMBA_SUITES, *FP8_SUITES, *SYSTEM_SUITES]}

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib, json, platform, torch
cuda = torch.cuda.is_available()
missing = []
for module in ("mcore_train", "mcore_infer", "mcore_export"):  # each imports the packages below it
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing.append(e.name)
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                  "gpus": torch.cuda.device_count() if cuda else 0,
                  "gpu": torch.cuda.get_device_name(0) if cuda else None, "missing": sorted(set(missing))}))
"""


def child_env(packages: Path, wheels: Path | None, work: Path) -> dict[str, str]:
    """The environment of every command: the packages of ``packages`` (a checkout) first on ``PYTHONPATH``, and
    ``wheels`` installed into the work folder for machines without a package index."""
    paths = [str(p) for p in sorted((packages / "packages").glob("*/src"))]
    if not paths:
        raise SystemExit(f"no packages/*/src under {packages}: --packages takes the root of an mcore checkout")
    if wheels is not None:
        site = work / "site"
        files = sorted(str(w) for w in wheels.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--target", str(site), *files]  # fmt: skip
        if not files or subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"could not install the wheels of {wheels}")
        paths.append(str(site))
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}


def probe(env: dict[str, str]) -> dict[str, Any]:
    """torch, CUDA and the GPUs the children will see; the GPU's memory and driver from ``nvidia-smi``."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"could not import torch with this Python ({sys.executable}):\n{out.stderr[-2000:]}")
    info: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    missing = info.pop("missing", [])
    if missing:
        raise SystemExit(f"the mcore packages do not import with this Python ({sys.executable}): no module "
                         f"{', '.join(missing)}; "
                         "install it, or carry its wheels (and their dependencies) and pass --wheels DIR")  # fmt: skip
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        first = smi.stdout.strip().splitlines()[0].split(", ") if smi.returncode == 0 and smi.stdout.strip() else []
    except (OSError, subprocess.TimeoutExpired):
        first = []
    if len(first) == 3:
        info.update(gpu_memory=first[1], driver=first[2])
    return info


def commit(root: Path) -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "packages", "bench"],
                               capture_output=True, text=True)  # fmt: skip
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def hardware(info: dict[str, Any], used: int) -> str:
    if used == 0:
        return f"cpu-{os.cpu_count()}cores"
    name = (info.get("gpu") or "gpu").replace("NVIDIA ", "").strip().lower().replace(" ", "-")
    return name + (f"x{used}" if used > 1 else "")


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and spec:
        return format(value, spec)
    if isinstance(value, int) and spec and spec[-1] in "df,":
        return format(value, spec.replace(".0f", "d") if spec.endswith(".0f") else spec)
    return str(value)


def markdown(result: dict[str, Any]) -> str:
    """The tables of a result as markdown, each row numbered to the command that measured it."""
    env = result["environment"]
    labels = {"torch": "torch", "cuda": "CUDA", "driver": "driver", "commit": "commit", "recorded_in": "recorded in"}
    where = ", ".join(f"{v} {env[k]}" for k, v in labels.items() if env.get(k))
    lines = [f"# {result['suite']} on {result['hardware']}", "", result["summary"], "",
             f"Anchor: {result['anchor']}", "",
             f"Written {env.get('date')} by `{result['command']}` ({env.get('gpu') or 'no GPU'}; {where})."]  # fmt: skip
    commands: list[str] = []
    for table in result["tables"]:
        rows = table["rows"]
        dated = {(r.get("measured"), r.get("hardware")) for r in rows if r.get("measured")}
        cols = [c for c in table["columns"] if any(r.get(c[0]) is not None for r in rows) or c is table["columns"][0]]
        extra = [("measured", "measured", ""), ("hardware", "hardware", "")] if len(dated) > 1 else []
        lines += ["", f"## {table['title']}", ""]
        if len(dated) == 1:
            date, hw = dated.pop()
            lines += [f"Measured {date} on {hw}.", ""]
        head = [c[1] for c in cols + extra] + ["command"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cmd = r.get("command")
            if cmd and cmd not in commands:
                commands.append(cmd)
            ref = f"[{commands.index(cmd) + 1}]" if cmd else ""
            cells = [fmt(r.get(k), spec) for k, _, spec in cols + extra]
            if r.get("error"):
                cells[-1] = f"failed: {r['error'].splitlines()[0][:80]}" if len(cells) > 1 else cells[-1]
            lines.append("| " + " | ".join(cells + [ref]) + " |")
        lines += [""] + [f"- {n}" for n in table.get("notes", [])] if table.get("notes") else []
    lines += ["", "## Commands", ""] + [f"{i}. `{c}`" for i, c in enumerate(commands, 1)]
    return "\n".join(lines) + "\n"


def compare(a_path: str, b_path: str) -> None:
    """Rows of two results of one suite matched by table and name; every shared numeric column as B / A."""
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    print(f"A: {a_path} ({a['environment'].get('commit')}), B: {b_path} ({b['environment'].get('commit')})")
    for ta in a["tables"]:
        tb = next((t for t in b["tables"] if t["title"] == ta["title"]), None)
        if tb is None:
            continue
        key = ta["columns"][0][0]
        print(f"\n## {ta['title']}\n\n| {ta['columns'][0][1]} | column | A | B | B / A |\n|---|---|---|---|---|")
        for ra in ta["rows"]:
            rb = next((r for r in tb["rows"] if r.get(key) == ra.get(key)), None)
            for k, header, spec in ta["columns"][1:] if rb else []:
                va, vb = ra.get(k), rb.get(k)
                if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va:
                    print(f"| {ra.get(key)} | {header} | {fmt(va, spec)} | {fmt(vb, spec)} | {vb / va:.3f} |")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="*", metavar="SUITE", help=f"one or more of: {', '.join(SUITES)}")
    ap.add_argument("--list", action="store_true", help="describe the suites and exit")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs a suite may use (default: all the machine has)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="results go to OUT/<suite>/<hardware>.*")
    ap.add_argument("--quick", action="store_true", help="fewer steps and smaller inputs (checks the suite quickly)")
    ap.add_argument("--dry-run", action="store_true", help="print each suite's commands instead of running them")
    ap.add_argument("--packages", default=str(REPO), metavar="CHECKOUT",
                    help="take the mcore packages from this checkout (e.g. a worktree of another commit)")  # fmt: skip
    ap.add_argument("--wheels", default=None, metavar="DIR", help="install these wheels for the commands first")
    ap.add_argument("--label", default=None, help="a note stored with the environment (e.g. 'before the change')")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two results side by side")
    return ap


def list_suites() -> None:
    for s in SUITES.values():
        need = f"{s.gpus} GPU" + ("s" if s.gpus > 1 else "") if s.gpus else "CPU or GPU"
        print(f"{s.name:15} {need}, ~{s.minutes} min: {s.summary}\n{'':15} anchor: {s.anchor}")


def suite_result(name: str, args: argparse.Namespace, info: dict[str, Any], used: int, tables: list[dict[str, Any]],
                 ctx: Context, packages: Path) -> dict[str, Any]:  # fmt: skip
    """The JSON of one suite's run: its tables (every row given the hardware it ran on), the command, the
    environment and the steps."""
    suite = SUITES[name]
    now = datetime.datetime.now(datetime.timezone.utc)
    hw = hardware(info, used)
    for table in tables:
        for row in table["rows"]:
            row.setdefault("hardware", f"{info['gpu']}" + (f" x{used}" if used > 1 else "") if used
                           else f"CPU ({os.cpu_count()} cores)")  # fmt: skip
    command = " ".join(["python bench/run.py", name, *(["--quick"] if args.quick else []),
                        *([f"--gpus {args.gpus}"] if args.gpus else [])])  # fmt: skip
    return {
        "suite": name,
        "hardware": hw,
        "summary": suite.summary,
        "anchor": suite.anchor,
        "command": command,
        "quick": args.quick,
        "environment": {
            **{k: info.get(k) for k in ("gpu", "gpu_memory", "driver", "torch", "cuda", "python")},
            "gpus": used,
            "cpus": os.cpu_count(),
            "date": now.date().isoformat(),
            "time": now.isoformat(timespec="seconds"),
            "commit": commit(packages),
            "packages": str(packages),
            "label": args.label,
        },
        "tables": tables,
        "steps": ctx.steps,
    }


def run_suite(name: str, args: argparse.Namespace, env: dict[str, str], info: dict[str, Any], visible: int,
              work: Path, packages: Path) -> bool:  # fmt: skip
    """Run (or with ``--dry-run`` print) one suite on at most ``visible`` GPUs and write its results under
    ``--out``; whether it failed (too few GPUs, or a command that did not succeed)."""
    suite = SUITES[name]
    if suite.gpus > visible and not args.dry_run:
        why = "no GPU is visible to torch" if not info["gpus"] else f"{info['gpus']} GPU(s) are visible"
        print(f"suite {name} needs {suite.gpus} CUDA GPU(s), but {why} (or --gpus limits it); run it on a machine "
              f"with {suite.gpus} GPU(s), e.g. python bench/run.py {name} --out DIR there", file=sys.stderr)  # fmt: skip
        return True
    used = suite.gpus_used(max(visible, suite.gpus) if args.dry_run else visible)
    suite_env = dict(env)
    if used and used < info["gpus"]:  # only the first `used` GPUs
        ids = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(info["gpus"])))).split(",")
        suite_env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:used])
    memory = re.match(r"([\d.]+) MiB", info.get("gpu_memory") or "")
    ctx = Context(work=work / name, env=suite_env, gpus=used, quick=args.quick, dry_run=args.dry_run, repo=REPO,
                  gpu_gib=float(memory[1]) / 1024 if memory else None)  # fmt: skip
    print(f"== {name}: {suite.summary} ({used} GPU(s){', quick' if args.quick else ''})", flush=True)
    tables = suite.build(ctx)
    if args.dry_run:
        return False
    result = suite_result(name, args, info, used, tables, ctx, packages)
    hw = result["hardware"]
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{hw}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (out / f"{hw}.md").write_text(text)
    print(text, flush=True)
    print(f"results: {out / hw}.json and .md; logs under {ctx.work}", flush=True)
    return any(s["returncode"] != 0 for s in ctx.steps)


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if args.list or not args.suites:
        list_suites()
        return
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        ap.error(f"unknown suite {', '.join(unknown)}; known: {', '.join(SUITES)}")
    work = Path(tempfile.mkdtemp(prefix="mcore-bench-"))
    packages = Path(args.packages).resolve()
    env = child_env(packages, Path(args.wheels) if args.wheels else None, work)
    if args.dry_run:  # no probe: show the commands for --gpus GPUs (default: what each suite needs)
        info: dict[str, Any] = {"gpus": args.gpus or 0, "gpu": None}
        visible = args.gpus or 0
    else:
        info = probe(env)
        visible = info["gpus"] if args.gpus is None else min(args.gpus, info["gpus"])
    failed = False
    for name in args.suites:
        failed |= run_suite(name, args, env, info, visible, work, packages)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
