"""``mcore-export``: Hugging Face export/import and TensorRT-LLM checkpoint export from the command line.

mcore-export hf --checkpoint runs/llama/step_001000 --out exports/llama-hf [--dtype bf16]
mcore-export import-hf --model exports/llama-hf --out ckpts/llama-imported [--tp 2 --pp 2]
mcore-export trtllm --checkpoint runs/llama --out exports/llama-trt --tp 2 --pp 1 [--dtype fp16]
mcore-export trtllm-build --checkpoint exports/llama-trt --out engines/llama   (needs tensorrt_llm)
mcore-export import-megatron --checkpoint megatron/checkpoints --out ckpts/llama [--iteration N] [--optimizer]
                             [-- --num-layers 32 ...   (Megatron flags, for checkpoints without saved args)]
mcore-export megatron --checkpoint runs/llama --out megatron/checkpoints --tp 2 --pp 1
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from mcore_export.errors import ExportError
from mcore_export.hf import DEFAULT_MAX_SHARD_SIZE, export_hf, import_hf
from mcore_export.megatron import export_megatron, import_megatron
from mcore_export.trtllm import build_engine, export_trtllm
from mcore_models import MCoreModelsError
from mcore_parallel.checkpoint import CheckpointFormatError

__all__ = ["main", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a plain number of bytes."""
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    unit = t[len(digits) :]
    if unit not in _UNITS or not digits:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number of bytes or e.g. 500MB, 5GB, 2GiB")
    try:
        return int(float(digits) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcore-export", description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    dtypes = ["bf16", "fp16", "fp32"]

    hf = sub.add_parser("hf", help="export an mcore checkpoint as a Hugging Face transformers directory")
    hf.add_argument("--checkpoint", required=True, help="checkpoint directory, or run directory with 'latest'")
    hf.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    hf.add_argument("--dtype", choices=dtypes, help="weight dtype (default: the checkpoint's params_dtype)")
    hf.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest safetensors shard, e.g. 5GB (default), 500MB",
    )
    hf.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")

    imp = sub.add_parser("import-hf", help="convert a Hugging Face model directory into an mcore checkpoint")
    imp.add_argument("--model", required=True, help="directory with config.json and *.safetensors")
    imp.add_argument("--out", required=True, help="checkpoint directory to write")
    imp.add_argument("--tp", type=int, default=1, help="chunk the arrays for this tensor-parallel size")
    imp.add_argument("--pp", type=int, default=1, help="pipeline size to check the layer count against")
    imp.add_argument("--dtype", choices=dtypes, help="params_dtype (default: the model's torch_dtype)")
    imp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")

    trt = sub.add_parser("trtllm", help="export a TensorRT-LLM checkpoint (config.json + rank*.safetensors)")
    trt.add_argument("--checkpoint", required=True, help="checkpoint directory, or run directory with 'latest'")
    trt.add_argument("--out", required=True, help="output directory")
    trt.add_argument("--tp", type=int, default=1, help="output tensor-parallel size")
    trt.add_argument("--pp", type=int, default=1, help="output pipeline-parallel size")
    trt.add_argument("--dtype", choices=dtypes, help="weight dtype (default: the checkpoint's params_dtype)")
    trt.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")

    meg = sub.add_parser("import-megatron", help="convert a Megatron-LM checkpoint (torch_dist or legacy) to mcore")
    meg.add_argument("--checkpoint", required=True, help="Megatron --save directory, or one iter_NNNNNNN in it")
    meg.add_argument("--out", required=True, help="checkpoint directory to write")
    meg.add_argument("--iteration", type=int, help="which iter_NNNNNNN (default: latest_checkpointed_iteration.txt)")
    meg.add_argument("--optimizer", action="store_true", help="also import Adam's state (torch_dist) to resume")
    meg.add_argument("--vocab-size", type=int, help="true vocabulary size: drop Megatron's padding rows beyond it")
    meg.add_argument("--tp", type=int, default=1, help="chunk the arrays for this tensor-parallel size")
    meg.add_argument("--pp", type=int, default=1, help="pipeline size to check the layer count against")
    meg.add_argument("--dtype", choices=dtypes, help="params_dtype (default: the run's --bf16/--fp16)")
    meg.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    meg.add_argument("flags", nargs=argparse.REMAINDER, help="Megatron flags after -- (checkpoints without args)")

    mex = sub.add_parser("megatron", help="export an mcore checkpoint as a Megatron-Core torch_dist checkpoint")
    mex.add_argument("--checkpoint", required=True, help="checkpoint directory, or run directory with 'latest'")
    mex.add_argument("--out", required=True, help="Megatron save directory to write (iter_NNNNNNN inside)")
    mex.add_argument("--tp", type=int, default=1, help="the Megatron run's --tensor-model-parallel-size")
    mex.add_argument("--pp", type=int, default=1, help="the Megatron run's --pipeline-model-parallel-size")
    mex.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="Megatron's vocabulary padding")
    mex.add_argument("--dtype", choices=dtypes, help="weight dtype (default: the checkpoint's params_dtype)")
    mex.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")

    eng = sub.add_parser("trtllm-build", help="build a TensorRT engine from an export (needs tensorrt_llm)")
    eng.add_argument("--checkpoint", required=True, help="a directory written by 'mcore-export trtllm'")
    eng.add_argument("--out", required=True, help="engine directory")
    eng.add_argument("extra", nargs=argparse.REMAINDER, help="further trtllm-build arguments after --")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "hf":
            out = export_hf(
                args.checkpoint,
                args.out,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                overwrite=args.overwrite,
            )
        elif args.command == "import-hf":
            out = import_hf(args.model, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, overwrite=args.overwrite)
        elif args.command == "trtllm":
            out = export_trtllm(
                args.checkpoint, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, overwrite=args.overwrite
            )
        elif args.command == "import-megatron":
            out = import_megatron(
                args.checkpoint,
                args.out,
                iteration=args.iteration,
                optimizer=args.optimizer,
                flags=[a for a in args.flags if a != "--"],
                vocab_size=args.vocab_size,
                tp=args.tp,
                pp=args.pp,
                dtype=args.dtype,
                overwrite=args.overwrite,
            )
        elif args.command == "megatron":
            out = export_megatron(
                args.checkpoint,
                args.out,
                tp=args.tp,
                pp=args.pp,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                dtype=args.dtype,
                overwrite=args.overwrite,
            )
        else:
            extra = [a for a in args.extra if a != "--"]
            out = build_engine(args.checkpoint, args.out, *extra)
    except (ExportError, MCoreModelsError, CheckpointFormatError, ValueError) as e:
        print(f"mcore-export {args.command}: error: {e}", file=sys.stderr)  # noqa: T201
        return 2
    print(out)  # noqa: T201 (the CLI reports the output path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
