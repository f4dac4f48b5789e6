"""``mcore-train``: the pretraining entry point.

mcore-train pretrain --recipe tiny data.path=data/demo_text checkpoint.dir=runs/demo
torchrun --nproc-per-node 8 -m mcore_train.cli pretrain --config examples/llama_1b.yaml parallel.tp=2
mcore-train show-config --recipe llama-1b optimizer.lr=1e-4
mcore-train prepare-demo --out data/demo        # the built-in demo corpus, tokenized

exit codes: 0 done; 2 a user mistake (the configuration, the data files, a checkpoint, the parallel layout),
printed as one message by rank 0; 3 the loss diverged; 1 an internal fault (with its traceback)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mcore_train.config import TrainConfig

__all__ = ["main"]

logger = logging.getLogger("mcore_train")


def _configure_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[%(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout)  # fmt: skip


def _load(args: argparse.Namespace, world_size: int | None = None) -> TrainConfig:
    from mcore_train.config import load_config

    return load_config(recipe=args.recipe, path=args.config, overrides=args.overrides, world_size=world_size)


def user_errors() -> tuple[type[Exception], ...]:
    """The base classes of the errors the mcore packages raise for a user's mistake (not an internal fault)."""
    from mcore_data.errors import MCoreDataError
    from mcore_models.errors import MCoreModelsError
    from mcore_parallel.errors import MCoreParallelError
    from mcore_train.errors import MCoreTrainError

    return (MCoreTrainError, MCoreParallelError, MCoreDataError, MCoreModelsError)


def _report(rank: int, message: str) -> None:
    """One message on stderr, from rank 0 only (every rank of a torchrun job fails the same way)."""
    if rank == 0:
        sys.stderr.write(f"mcore-train: error: {message}\n")
        sys.stderr.flush()


def prepare_demo(out: str, max_files: int | None = None, workers: int = 1) -> str:
    """Export the Python standard library as JSONL and tokenize it with the byte tokenizer; returns the prefix."""
    from mcore_data.demo_corpus import write_demo_corpus
    from mcore_data.preprocess import PreprocessConfig, preprocess
    from mcore_data.tokenizer import TokenizerSpec

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    prefix = root / "stdlib_text"
    if (root / "stdlib_text.idx").exists():
        logger.info("demo corpus already prepared at %s", prefix)
        return str(prefix)
    jsonl = root / "stdlib.jsonl"
    docs, nbytes = write_demo_corpus(jsonl, max_files=max_files, overwrite=True)
    logger.info("demo corpus: %d files of the Python standard library, %.1f MB", docs, nbytes / 1e6)
    summary = preprocess(PreprocessConfig(inputs=[str(jsonl)], output_prefix=str(prefix),
                                          tokenizer=TokenizerSpec("byte"), workers=workers))  # fmt: skip
    logger.info("tokenized: %s", summary)
    return str(prefix)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcore-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("pretrain", "train a model"), ("show-config", "print the resolved configuration")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--recipe", default=None, help="named recipe: tiny, gpt2-124m, llama-1b, llama3-8b")
        p.add_argument("--config", default=None, help="YAML file (merged over the recipe)")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. optimizer.lr=3e-4")
    demo = sub.add_parser("prepare-demo", help="tokenize the built-in demo corpus (Python's standard library)")
    demo.add_argument("--out", default="data/demo")
    demo.add_argument("--max-files", type=int, default=None)
    demo.add_argument("--workers", type=int, default=1)
    from mcore_train.checkpoint_cli import add_checkpoint_parser, run_checkpoint_command

    add_checkpoint_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "checkpoint":
        return run_checkpoint_command(args)

    from mcore_parallel import read_launch_env
    from mcore_train.errors import TrainingDiverged

    errors = user_errors()  # anything else is an internal fault: its traceback, exit code 1
    try:
        rank = read_launch_env().rank
    except errors as e:
        _report(0, str(e))
        return 2
    _configure_logging(rank)
    try:
        if args.command == "prepare-demo":
            sys.stdout.write(prepare_demo(args.out, args.max_files, args.workers) + "\n")
            return 0
        if args.command == "show-config":
            sys.stdout.write(_load(args).to_yaml())
            return 0
        from mcore_train.api import launch_world_size, pretrain

        try:
            pretrain(_load(args, world_size=launch_world_size()))
        finally:
            _leave_process_group()
    except TrainingDiverged as e:
        _report(rank, f"training stopped: {e}")
        return 3
    except errors as e:
        _report(rank, str(e))
        return 2
    return 0


_LEFT_GROUP = False  # set once this process destroyed its process groups: entry() then ends it without finalizing


def _leave_process_group() -> None:
    """Destroy the process groups once this rank is done with them (:func:`mcore_parallel.leave_process_group`: a
    gloo group left for the interpreter's exit aborted finished torchrun ranks now and then)."""
    from mcore_parallel import leave_process_group

    global _LEFT_GROUP
    _LEFT_GROUP = leave_process_group() or _LEFT_GROUP


def entry() -> None:
    """The ``mcore-train`` command (and ``python -m mcore_train.cli``, as torchrun runs it): :func:`main`'s exit code;
    a process that ran a process group exits without the interpreter's finalization (logs and output flushed)."""
    from mcore_parallel import exit_process

    exit_process(main(), _LEFT_GROUP)


if __name__ == "__main__":
    entry()
