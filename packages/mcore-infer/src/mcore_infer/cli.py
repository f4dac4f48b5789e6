"""``mcore-infer``: ``serve`` (OpenAI-compatible HTTP server) and ``generate`` (one-off completions).

A LLaVA checkpoint (``mcore_models.multimodal``) is served as a vision-language model at any ``--tp``: chat requests
may carry ``image_url`` data URLs (``--max-images``, ``--image-mean`` / ``--image-std``, ``--max-tiles``,
``--tile-thumbnail`` / ``--tile-tags``; the normalisation and tiling default to the checkpoint's training run's).

Tensor parallel serving: ``torchrun --nproc-per-node N -m mcore_infer.cli serve --tp N ...``; rank 0 runs the
scheduler (the engine loop) and starts the HTTP front-end processes, the other ranks follow its steps.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType
from typing import get_args

from mcore_infer.config import MAMBA_SSM_DTYPES, EngineConfig
from mcore_infer.decode import DecodeKernels, parse_decode_kernels
from mcore_infer.errors import InvalidRequestError, MissingDependencyError
from mcore_infer.sampling import SamplingParams

__all__ = ["main"]

log = logging.getLogger(__name__)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="mcore checkpoint (or run directory with a 'latest')")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size (launch with torchrun --nproc-per-node N, one process per rank)")  # fmt: skip
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--memory-fraction", type=float, default=0.85)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each layer (fused elementwise ops); default: on for a CUDA device")  # fmt: skip
    p.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each decode step before reading the last one (default on; one TP rank)")  # fmt: skip
    p.add_argument("--side-stream-copies", action=argparse.BooleanOptionalAction, default=True,
                   help="with --lookahead and CUDA graphs: two decode input buffers, the copies off the steps' stream "
                   "(EngineConfig.side_stream_copies; default on)")  # fmt: skip
    p.add_argument("--l2-prefetch", action="store_true",
                   help="small steps: each attention kernel also pulls its layer's output-projection weight into L2 "
                   "(EngineConfig.l2_prefetch; Hopper; not yet timed)")  # fmt: skip
    p.add_argument("--l2-prefetch-up-mb", type=float, default=0.0,
                   help="with --l2-prefetch: also the first this many MB of the up projection's weight")  # fmt: skip
    p.add_argument("--attention", default="auto", choices=["auto", "plain", "triton"])
    p.add_argument("--mamba-ssm-dtype", default="float32", choices=list(MAMBA_SSM_DTYPES),
                   help="Mamba and hybrid models: each request's SSM state in float32 (exact) or 16 bits (half its "
                   "memory and decode traffic, rounded every step)")  # fmt: skip
    p.add_argument(
        "--decode-kernels",
        default="auto",
        type=_decode_kernels,
        metavar="|".join(get_args(DecodeKernels)) + "|PLAN",
        help="the serving-only fusions of each step (EngineConfig.decode_kernels): auto (the fastest the device and "
        "model allow), none, attention (RoPE and KV write in the attention kernels, deferred residual adds), row "
        "(plus the one-row GEMV kernels), norm_linear (plus RMSNorm inside the projections), or a decode plan as JSON "
        'or a JSON file, e.g. \'{"preset": "row", "swiglu_down": false, "row_fc1": false, "fused_mlp": true}\' (docs/infer.md)',
    )
    _vision_args(p)


def _decode_kernels(text: str) -> object:
    try:
        return parse_decode_kernels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers, e.g. 0.5,0.5,0.5") from None


def _vision_args(p: argparse.ArgumentParser) -> None:
    """Vision-language (LLaVA) checkpoints: how requests' images are taken."""
    p.add_argument("--max-images", type=int, default=8, help="most images per request (VLM checkpoints)")
    p.add_argument("--image-mean", type=_floats, default=None, metavar="R,G,B",
                   help="with --image-std: normalise pixels in [0, 1] as (x - mean) / std per channel, as the model "
                   "was trained (CLIP: 0.4815,0.4578,0.4082 / 0.2686,0.2613,0.2758); default: pixels in [0, 1]")  # fmt: skip
    p.add_argument("--image-std", type=_floats, default=None, metavar="R,G,B")
    p.add_argument("--max-tiles", type=int, default=None, metavar="N",
                   help="cut each image into a grid of at most N tiles (1: no tiling), as the model was trained; "
                   "default: the checkpoint's multimodal.max_tiles, else no tiling")  # fmt: skip
    p.add_argument("--tile-thumbnail", action=argparse.BooleanOptionalAction, default=None,
                   help="with tiling, the whole image as one more tile (default: the checkpoint's, else on)")  # fmt: skip
    p.add_argument("--tile-tags", action=argparse.BooleanOptionalAction, default=None,
                   help="with tiling, a text tag (<tile_1>, ...) before each tile's image tokens (default: the "
                   "checkpoint's, else on)")  # fmt: skip


def _build_llm(args: argparse.Namespace, name: str | None = None) -> object:
    from mcore_infer.api import LLM
    from mcore_parallel import ParallelConfig, ParallelState

    state = ParallelState.initialize(ParallelConfig(tp=args.tp))
    device = args.device
    if device is None:
        import torch

        device = f"cuda:{state.local_rank}" if torch.cuda.is_available() else "cpu"
    config = _engine_config(args, device)
    return LLM(args.checkpoint, config=config, tp=state.tp, device=device, dtype=args.dtype, name=name)


def _engine_config(args: argparse.Namespace, device: str) -> EngineConfig:
    """The engine's configuration from the flags; a bad value is a user error naming it."""
    options = dict(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        memory_fraction=args.memory_fraction,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graphs=not args.no_cuda_graphs,
        compile=args.compile if args.compile is not None else str(device).startswith("cuda"),
        lookahead=args.lookahead,
        side_stream_copies=args.side_stream_copies,
        l2_prefetch=args.l2_prefetch,
        l2_prefetch_up_mb=args.l2_prefetch_up_mb,
        attention_backend=args.attention,
        decode_kernels=args.decode_kernels,
        mamba_ssm_dtype=args.mamba_ssm_dtype,
        max_images=args.max_images,
        image_mean=args.image_mean,
        image_std=args.image_std,
        max_tiles=args.max_tiles,
        tile_thumbnail=args.tile_thumbnail,
        tile_tags=args.tile_tags,
    )
    try:
        return EngineConfig(**options)  # type: ignore[arg-type]
    except ValueError as e:
        raise InvalidRequestError(f"invalid engine options: {e}") from e


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors the mcore packages raise for a user's mistake (a bad checkpoint, option or environment)."""
    from mcore_data.errors import MCoreDataError
    from mcore_models.errors import MCoreModelsError
    from mcore_parallel.errors import MCoreParallelError

    return (MCoreParallelError, MCoreModelsError, MCoreDataError, InvalidRequestError, MissingDependencyError)


def main(argv: list[str] | None = None) -> int:
    """Run a command; a user's mistake is one message on stderr (from rank 0) and exit code 2, no traceback."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except _user_errors() as e:
        from mcore_parallel import LaunchEnvironmentError, read_launch_env

        try:
            rank = read_launch_env().rank
        except LaunchEnvironmentError:  # the environment itself is the mistake being reported
            rank = 0
        if rank == 0:
            sys.stderr.write(f"mcore-infer: error: {e}\n")
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model-name", default=None, help="name in /v1/models (default: the checkpoint folder's)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get at exit")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the HTTP front end (with the detokenization of streams) out of the engine loop's "
                   "process (the default, measured faster: docs/infer.md): at --tp 1 the engine runs in a process of "
                   "its own; at --tp > 1 rank 0 runs the engine loop and the front ends run in processes it starts. "
                   "--no-engine-process serves HTTP from the engine's process (rank 0's). If the engine process dies, "
                   "the front end answers 503 (also on /health) until it is restarted")  # fmt: skip
    s.add_argument("--api-workers", type=int, default=1, metavar="N",
                   help="HTTP front-end processes over the one engine (default 1; needs the engine process); on Linux "
                   "each listens on its own socket (SO_REUSEPORT) and the kernel spreads connections over them; "
                   "responses name the worker that answered (header x-mcore-worker)")  # fmt: skip
    g = sub.add_parser("generate", help="complete prompts and print the results")
    _engine_args(g)
    g.add_argument("prompts", nargs="+")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    return parser


def _run(args: argparse.Namespace) -> int:
    from mcore_infer.api import LLM

    if args.command == "serve":
        _check_serve(args)
        if args.engine_process:
            return _serve_engine_process(args)
    llm = _build_llm(args, getattr(args, "model_name", None))
    assert isinstance(llm, LLM)
    if not llm.is_driver:
        return _follow(llm)
    if args.command == "generate":
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
        for gen in llm.generate(args.prompts, params):
            sys.stdout.write(f"{gen.outputs[0].text!r}\n")
        llm.shutdown()
        _leave_process_group()
        return 0
    from mcore_infer.async_engine import AsyncEngine
    from mcore_infer.server import build_app, serve

    app = build_app(AsyncEngine(llm.engine), llm.tokenizer, llm.name, args.shutdown_timeout)
    serve(app, args.host, args.port)
    return 0


def _launch_rank() -> int:
    from mcore_parallel import read_launch_env

    return read_launch_env().rank


def _check_serve(args: argparse.Namespace) -> None:
    """``serve``'s flags that go together (a user error otherwise); the layout, logged when it is the default."""
    if args.engine_process is None:
        args.engine_process = True
        if args.tp == 1:
            log.info("serving with the engine in its own process (--no-engine-process to change)")
        elif _launch_rank() == 0:
            log.info("serving with the engine loop in rank 0's process and the HTTP front end in %s of its own "
                     "(--no-engine-process to change)",
                     "a process" if args.api_workers == 1 else f"{args.api_workers} processes")  # fmt: skip
    if args.api_workers < 1:
        raise InvalidRequestError(f"--api-workers {args.api_workers}: must be at least 1")
    if args.api_workers > 1 and not args.engine_process:
        raise InvalidRequestError("--api-workers > 1 needs the engine process: drop --no-engine-process")


def _follow(llm: object) -> int:
    """A TP rank other than the first: run rank 0's steps until rank 0 releases it. A launcher signals every rank
    (torchrun: each rank's process group), and rank 0 still steps while its front ends drain, then releases the
    others: so the first SIGINT/SIGTERM here is logged and waited out; a second one ends this rank at once."""
    from mcore_infer.api import LLM

    assert isinstance(llm, LLM)

    def wait_for_rank0(signum: int, frame: FrameType | None) -> None:
        log.info("got %s: following rank 0 until it stops (again to stop at once)", signal.Signals(signum).name)
        signal.signal(signum, signal.SIG_DFL)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, wait_for_rank0)
    llm.follow()
    _leave_process_group()
    return 0


_LEFT_GROUP = False  # set once this process destroyed its process group: entry() then ends it without finalizing


def _leave_process_group() -> None:
    """Destroy the process groups once this rank is done with them (:func:`mcore_parallel.leave_process_group`:
    a gloo group left for the interpreter's exit aborted about one run in five of ``generate --tp 2`` on the CPU)."""
    from mcore_parallel import leave_process_group

    global _LEFT_GROUP
    _LEFT_GROUP = leave_process_group() or _LEFT_GROUP


def entry() -> None:
    """The ``mcore-infer`` command (and ``python -m mcore_infer.cli``): :func:`main`'s exit code; a process that ran
    a tensor-parallel group exits without the interpreter's finalization (its logs and output flushed first)."""
    from mcore_parallel import exit_process

    exit_process(main(), _LEFT_GROUP)


def _serve_engine_process(args: argparse.Namespace) -> int:
    """``serve`` with the engine loop out of the HTTP front end's process: at ``--tp 1`` an engine process builds the
    LLM with :func:`_build_llm` from these arguments; at ``--tp`` > 1 every rank builds its shard here, rank 0 serves
    the front ends it starts from its engine loop (:func:`~mcore_infer.engine_process.serve_workers`)."""
    from mcore_infer.engine_process import EngineClient, EngineSpec, WorkerHeader, serve_workers
    from mcore_infer.server import build_app, serve

    if args.tp > 1:
        return _serve_tp(args)
    spec = EngineSpec(_build_llm, (args, args.model_name))
    if args.api_workers > 1:
        return serve_workers(spec, args.api_workers, args.host, args.port, args.shutdown_timeout, args.model_name)
    client = EngineClient(spec).launch()
    try:
        app = build_app(client, client.tokenizer, client.model_name, args.shutdown_timeout)  # type: ignore[arg-type]
        serve(WorkerHeader(app, 0), args.host, args.port)
    finally:
        client.shutdown(0.0)  # a no-op after the app's own shutdown; stops the engine process on any error
    return 0


def _serve_tp(args: argparse.Namespace) -> int:
    """``serve --tp N`` under torchrun: rank 0 binds the front ends' sockets first (a port in use fails before any
    model is loaded; the launcher then stops the other ranks), every rank builds its shard, rank 0 serves."""
    from mcore_infer.api import LLM
    from mcore_infer.engine_process import bind_worker_sockets, serve_workers
    from mcore_parallel import read_launch_env

    env = read_launch_env()
    if env.world_size != args.tp:
        raise InvalidRequestError(
            f"serve --tp {args.tp} runs one process per tensor-parallel rank: launch it with torchrun "
            f"--nproc-per-node {args.tp} (this launch has {env.world_size} process{'es' * (env.world_size > 1)})"
        )
    socks = bind_worker_sockets(args.host, args.port, args.api_workers) if env.rank == 0 else []
    try:
        llm = _build_llm(args, args.model_name)
    except BaseException:
        for s in socks:
            s.close()
        raise
    assert isinstance(llm, LLM)
    if not llm.is_driver:
        return _follow(llm)
    code = serve_workers(llm, args.api_workers, args.host, args.port, args.shutdown_timeout, args.model_name, socks)
    _leave_process_group()
    return code


if __name__ == "__main__":
    entry()
