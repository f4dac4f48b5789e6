#!/usr/bin/env bash
# The GPU measurements of the open issues, grouped so that each group is one `device` call under 10 minutes.
# Run from the repository root on the device machine (torch preinstalled there; our packages come from the tree):
#
#   bash bench/device_calls.sh ladder       # nvidia-h200(-x2): issue 9, the one-GPU optimisation ladder (~8 min)
#   bash bench/device_calls.sh scaling      # nvidia-h200-x2: issue 5, dp2 / tp2+SP against one GPU (~8 min)
#   bash bench/device_calls.sh ckpt         # one GPU: issue 6, llama-1b checkpoint bench (~5 min)
#   bash bench/device_calls.sh serve        # one GPU: issue 7, serve bench eager and compiled (~6 min)
#   bash bench/device_calls.sh curves       # one GPU: issue 9, 200-step loss curves, eager vs optimised (~5 min)
#   bash bench/device_calls.sh matrix       # one GPU: issue 9, mb 1/2/4/8 x recompute for gpt2-124m and llama-1b
#   bash bench/device_calls.sh agree        # one GPU: issue 9, loop log vs train_step_bench at the same work
#   bash bench/device_calls.sh pending      # one GPU: what is left of issues 6, 7, 9 (carry .whl for the HTTP row)
#   bash bench/device_calls.sh profile-x2   # nvidia-h200-x2: where a step's GPU time goes (issues 5 and 9)
#   bash bench/device_calls.sh next         # one GPU: SwiGLU backward, attention layouts (issue 9); not run yet
#   bash bench/device_calls.sh next-serve   # one GPU: the decode fusions (issue 7); not run yet
#   bash bench/device_calls.sh next-x2      # nvidia-h200-x2: tp2 + SP through symmetric memory (issue 5), not run yet
#   bash bench/device_calls.sh s5-x2        # nvidia-h200-x2: idle-gap profiles, 1 GPU and tp2 + SP symmetric memory
#   bash bench/device_calls.sh s5-serve2    # one GPU: the one-pass norm_linear kernel (issue 7); not run yet
#   bash bench/device_calls.sh s6-table     # one GPU: issue 9's table, HF reference next to mcore; not run yet
#   bash bench/device_calls.sh s6-curves    # one GPU: issue 9, 200-step loss curves of the best path; not run yet
#   bash bench/device_calls.sh s6-autotune  # one GPU: issue 9, max-autotune compile of the layers (optional)
#   bash bench/device_calls.sh s6-x2        # nvidia-h200-x2: sync-free clipping, fused tp loss (issue 5); not run yet
#   bash bench/device_calls.sh s7-x2        # nvidia-h200-x2: the deferred loss read, 1 GPU and tp2 + SP; not run yet
#   bash bench/device_calls.sh s7-serve     # one GPU: norm_linear sweep, split-K / SwiGLU GEMVs, batch 1; not run yet
#   bash bench/device_calls.sh s8           # nvidia-h200-x2: row-kernel sweep + serve (GPU 1) next to training (GPU 0)
#   bash bench/device_calls.sh s9-serve     # one GPU: row-kernel sweep incl. QKV / fc1, serve with the winners
#   bash bench/device_calls.sh s10-x2       # nvidia-h200-x2: issues 5 and 9, profiles with the deferred read, clocks
#   bash bench/device_calls.sh s12-x2       # nvidia-h200-x2: issues 9 and 5 without the contiguous q/k/v copies
#   bash bench/device_calls.sh s14-table    # one GPU: issue 9's side-by-side table with the best case (next session)
#   bash bench/device_calls.sh s15-x2       # nvidia-h200-x2: issue 5, mcore's own sequence-parallel exchange (tp_comm=p2p)
#   bash bench/device_calls.sh s16-x2       # nvidia-h200-x2: issue 5, the exchange in two pieces and in one, twice
#   bash bench/device_calls.sh s17-x2       # nvidia-h200-x2: issue 5's closing table (1 GPU, dp2 +- overlap, tp2 p2p)
#   bash bench/device_calls.sh s18-x2       # nvidia-h200-x2: issue 5, dp2 peer to peer against NCCL, tp2, one GPU
#   bash bench/device_calls.sh s19-x2       # nvidia-h200-x2: all 2-GPU parity tests; issue 9 with coordinate descent
#   bash bench/device_calls.sh s20-x2       # nvidia-h200-x2: issue 10 at 2 GPUs, llama3-8b at tp2 + SP and pp2
#   bash bench/device_calls.sh s21-x2       # nvidia-h200-x2: issue 10 at 2 GPUs, llama-1b saved at pp2, resumed at tp2 + SP
#   bash bench/device_calls.sh s22          # one GPU: issue 9, kernel-time profile of the best case
#   bash bench/device_calls.sh s23          # one GPU: issue 9, the QKV split + RoPE kernel against PyTorch's ops
#   bash bench/device_calls.sh s24-curves   # one GPU: issue 9, 200-step curves of the best path against eager PyTorch
#   bash bench/device_calls.sh s13          # one GPU: issue 9, the best levers at global batch 64 and 256
#   bash bench/device_calls.sh s11          # one GPU: the HTTP row cold and warm, the matmul rate sustained
#   bash bench/device_calls.sh s10          # one GPU: issue 7, the whole serve table with the default engine (carry .whl)
#   bash bench/device_calls.sh pending-x2   # nvidia-h200-x2: issue 5, tp2 + SP with the overlapped backward
#   bash bench/device_calls.sh gpu-tests    # 2 GPUs: every test marked gpu (NCCL parity, kernels, CUDA graphs)
#   bash bench/device_calls.sh x8           # nvidia-h200-x8: issue 10 (parity, dp scaling, llama3-8b, reshard)
#
# Results go to $OUT (the device tool brings them back); copy them to bench/results/ with the date and hardware.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src | tr '\n' ':')${PYTHONPATH:-}"
OUT="${OUT:-/tmp/mcore-device-out}"
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u
  python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; } > "$OUT/env.txt" 2>&1
# the HTTP server's wheels when carried to the device (.whl; the device has no network)
server_wheels() {
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
}
scale() { python3 bench/train_scaling_bench.py --preset llama-1b --steps 10 --case-timeout 170 "$@"; }

case "${1:-}" in
  ladder)
    scale --measure-peak --cases 1gpu 1gpu-compile 1gpu-fused-ce 1gpu-opt 1gpu-opt-mb8 --out "$OUT/ladder.json" 2>&1 \
      | tee "$OUT/ladder.log"
    ;;
  scaling)
    scale --cases 1gpu dp2 dp2-no-overlap tp2-sp dp2-opt --out "$OUT/scaling.json" 2>&1 | tee "$OUT/scaling.log"
    ;;
  ckpt)
    # issue 6: llama-1b training state (15.5 GB): mcore sync/async (first and later) vs torch.save vs DCP
    timeout 500 python3 bench/checkpoint_bench.py --preset llama-1b --dir /tmp/ckb --json "$OUT/ckpt.json" 2>&1 \
      | grep -v Warning | tail -20 | tee "$OUT/ckpt.log"
    ;;
  serve)
    # issue 7: concurrency 1 and 64 through the engine, eager layers and compiled layers (HF baseline: add --hf)
    timeout 200 python3 bench/serve_bench.py --concurrency 1,64 --http-concurrency 0 --out "$OUT/serve.json" 2>&1 \
      | grep -v Warning | tail -30 | tee "$OUT/serve.log"
    timeout 300 python3 bench/serve_bench.py --compile --lookahead --concurrency 1,64 --http-concurrency 0 \
      --out "$OUT/serve-compile.json" 2>&1 | grep -v Warning | tail -30 | tee "$OUT/serve-compile.log"
    ;;
  curves)
    # issue 9: the optimised path's loss curve against the eager one, 200 steps of llama-1b at seq 1024
    timeout 560 python3 bench/compare_runs.py --steps 200 --b training.compile=layers model.cross_entropy_fusion=true \
      --extra model.preset=llama-1b data.seq_length=1024 training.micro_batch_size=4 training.global_batch_size=8 \
      scheduler.warmup_iters=20 --out "$OUT/curves.json" 2>&1 | tail -30 | tee "$OUT/curves.log"
    ;;
  matrix)
    # issue 9's table: gpt2-124m (seq 1024) and llama-1b (seq 4096), micro-batch 1/2/4/8, with and without full
    # recompute, on the path mcore-train runs (fp32 master weights), all levers on
    step() { python3 bench/train_step_bench.py --optimizer mixed --compile --fused-ce --steps 6 --warmup 3 "$@"; }
    { step --preset gpt2-124m --seq 1024 --micro-batch 1 2 4 8 --json "$OUT/m-gpt2.json"
      step --preset gpt2-124m --seq 1024 --micro-batch 1 2 4 8 --recompute full --json "$OUT/m-gpt2-rc.json"
      step --preset llama-1b --micro-batch 1 2 4 8 --json "$OUT/m-llama.json"
      step --preset llama-1b --micro-batch 1 2 4 8 --recompute full --json "$OUT/m-llama-rc.json"; } 2>&1 \
      | grep -v Warning | tee "$OUT/matrix.log"
    ;;
  call1)
    # one call, both GPUs: the checkpoint bench on GPU 1 while the gpu tests run, then a serving diagnosis on GPU 0
    # (eager vs compiled+lookahead at concurrency 1 and 64, each with a profile of one batch-1 request)
    (CUDA_VISIBLE_DEVICES=1 timeout 520 python3 bench/checkpoint_bench.py --preset llama-1b --dir /tmp/ckb \
      --json "$OUT/ckpt.json" > "$OUT/ckpt.log" 2>&1) &
    timeout 200 python3 -m pytest -q -m gpu tests -p no:cacheprovider > "$OUT/tests.log" 2>&1
    for mode in eager compile; do
      flags=(); [ "$mode" = compile ] && flags=(--compile --lookahead)
      CUDA_VISIBLE_DEVICES=0 timeout 170 python3 bench/serve_bench.py "${flags[@]}" --concurrency 1,64 \
        --http-concurrency 0 --out "$OUT/serve-$mode.json" --profile "/tmp/prof-$mode.txt" 2>&1 | grep -v Warning \
        >> "$OUT/serve.log"
      { echo "=== $mode"; cat "/tmp/prof-$mode.txt"; } >> "$OUT/prof.txt"
    done
    wait
    ;;
  agree)
    # issue 9: the training log's TFLOP/s against this bench's, same work per optimizer step (mb 4, 4 micro-batches)
    scale --measure-peak --cases 1gpu-opt --out "$OUT/agree-loop.json" 2>&1 | tee "$OUT/agree-loop.log"
    python3 bench/train_step_bench.py --optimizer mixed --compile --fused-ce --micro-batch 4 --accum 4 --steps 6 \
      --warmup 3 --json "$OUT/agree-bench.json" 2>&1 | grep -v Warning | tee "$OUT/agree-bench.log"
    ;;
  pending)
    # what 2026-11-30's sessions left unmeasured on one GPU (~7 min): the first async save after reserve() in a fresh
    # process (issue 6), the loop log vs train_step_bench at the same work (issue 9), and the HTTP row of the serve
    # bench with the current engine (issue 7; needs the server wheels: carry .whl, see the device README)
    server_wheels
    timeout 150 python3 bench/checkpoint_bench.py --preset llama-1b --dir /tmp/ckf --first-save-only reserved \
      --json "$OUT/first-reserved.json" 2>&1 | grep -v Warning | tail -3 | tee "$OUT/pending.log"
    bash "$0" agree >> "$OUT/pending.log" 2>&1
    timeout 200 python3 bench/serve_bench.py --compile --lookahead --concurrency 1,64 --http-concurrency 64 \
      --out "$OUT/serve-http.json" 2>&1 | grep -v Warning | tail -8 | tee -a "$OUT/pending.log"
    # issue 7: decode GEMMs, cuBLAS against a weight-streaming Triton kernel (the table goes to pending.log)
    timeout 120 python3 bench/gemv_bench.py --rows 1 8 64 --no-inductor 2>&1 | grep -v Warning | tail -20 \
      | tee -a "$OUT/pending.log"
    ;;
  profile-x2)
    # nvidia-h200-x2 (~7 min): kernel-time profiles of the best one-GPU and tp2 + SP cases (issues 5 and 9) and the
    # attention-backend / micro-batch variants of the compiled one-GPU case
    scale --profile "$OUT/prof" --cases 1gpu-compile tp2-sp-compile 1gpu-compile-cudnn 1gpu-compile-flash \
      1gpu-compile-mb8 --out "$OUT/profile-x2.json" 2>&1 | tee "$OUT/profile-x2.log"
    ;;
  nccl-x2)
    # nvidia-h200-x2 (~6 min): tp2 + SP with NCCL's protocol forced (the profile showed the collectives exposed, at
    # ~155 GB/s), profiled; then the loop-vs-bench agreement (issue 9) after the bench stopped counting zeros
    for proto in Simple LL128; do
      NCCL_PROTO=$proto scale --profile "$OUT/prof-$proto" --cases tp2-sp-compile --out "$OUT/tp2-$proto.json" 2>&1 \
        | tail -3 >> "$OUT/nccl-x2.log"
    done
    scale --measure-peak --cases 1gpu-opt --out "$OUT/agree-loop.json" 2>&1 | tail -3 >> "$OUT/nccl-x2.log"
    python3 bench/train_step_bench.py --optimizer mixed --compile --fused-ce --micro-batch 4 --accum 4 --steps 6 \
      --warmup 3 --json "$OUT/agree-bench.json" 2>&1 | grep -v Warning | tail -4 >> "$OUT/nccl-x2.log"
    cat "$OUT/nccl-x2.log"
    ;;
  diag-x2)
    # nvidia-h200-x2 (~5 min): how the GPUs are linked, NCCL bandwidth alone and beside GEMMs, then profiles with the
    # GPU timeline (collectives hidden behind compute or not) of tp2 + SP and of one GPU with the compiled loss
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    timeout 120 torchrun --standalone --nproc-per-node=2 bench/nccl_bench.py --json "$OUT/nccl.json" 2>&1 \
      | grep -v Warning | tail -14 | tee "$OUT/diag.log"
    scale --profile "$OUT/prof" --cases tp2-sp-compile 1gpu-compile 1gpu-compile-mb8 --out "$OUT/diag.json" 2>&1 \
      | tail -6 | tee -a "$OUT/diag.log"
    ;;
  final)
    # one GPU (~6 min): issue 9's best cases after the compiled loss, at global batch 16 and 64, without and with
    # inductor's coordinate-descent tuning of its Triton kernels
    scale --measure-peak --steps 8 --cases 1gpu-compile-mb4-gbs64 1gpu-compile-mb8-gbs64 1gpu-compile \
      --out "$OUT/final.json" 2>&1 | tail -6 | tee "$OUT/final.log"
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 scale --measure-peak --steps 8 --case-timeout 240 \
      --cases 1gpu-compile-mb8-gbs64 1gpu-compile --out "$OUT/final-cdt.json" 2>&1 | tail -5 | tee -a "$OUT/final.log"
    ;;
  next)
    # one GPU (~8 min), prepared in the fourth session and not run yet (issue 9): the one-pass SwiGLU backward, the
    # gradient-accumulation fusion and contiguous SDPA inputs (tests, then the loop with each and with all three at
    # micro-batch 8 / global batch 64, and all three at micro-batch 4 for the memory target), and SDPA layouts
    timeout 120 python3 -m pytest -q tests/models/test_swiglu.py tests/parallel/test_gpu_wgrad.py -p no:cacheprovider \
      2>&1 | tail -3 | tee "$OUT/next.log"
    timeout 100 python3 bench/attention_bench.py --batch 4 --seq 4096 --json "$OUT/attention.json" 2>&1 \
      | grep -v Warning | tail -14 | tee -a "$OUT/next.log"
    scale --measure-peak --steps 8 --cases 1gpu-compile-mb8-gbs64 1gpu-compile-mb8-gbs64-swiglu \
      1gpu-compile-mb8-gbs64-gaf 1gpu-compile-mb8-gbs64-contig 1gpu-compile-mb8-gbs64-all 1gpu-compile-all \
      --out "$OUT/next.json" 2>&1 | tail -9 | tee -a "$OUT/next.log"
    ;;
  next-serve)
    # one GPU (~5 min), prepared in the fourth session and not run yet (issue 7): the decode fusions (GPU tests
    # first), then batch 1 and 64 with all of them (HF static-cache baseline in the same call)
    timeout 200 python3 -m pytest -q tests/infer/test_gpu.py tests/infer/test_fused_rope.py -p no:cacheprovider 2>&1 \
      | tail -3 | tee "$OUT/next-serve.log"
    timeout 300 python3 bench/serve_bench.py --compile --lookahead --fuse-rope --fuse-residual --fuse-kv-write --hf \
      --concurrency 1,64 --http-concurrency 0 --out "$OUT/serve-fused.json" 2>&1 | grep -v Warning | tail -6 \
      | tee -a "$OUT/next-serve.log"
    ;;
  next-x2)
    # nvidia-h200-x2 (~6 min), prepared in the fourth session and not run yet: the symmetric-memory sequence-parallel
    # linears (issue 5) against the float64 reference, then tp2 + SP with NCCL and with symmetric memory, profiled
    timeout 150 python3 -m pytest -q tests/parallel/test_tp_nccl.py -k symmetric -p no:cacheprovider 2>&1 | tail -5 \
      | tee "$OUT/next-x2.log"
    scale --measure-peak --profile "$OUT/prof" --cases 1gpu-compile tp2-sp-compile tp2-sp-compile-symm \
      --out "$OUT/next-x2.json" 2>&1 | tail -6 | tee -a "$OUT/next-x2.log"
    ;;
  s5-x2)
    # nvidia-h200-x2 (~5 min), fifth session: where the GPU idles (profiles with the idle-gap tables) for one GPU and
    # tp2 + SP through symmetric memory, both with every one-GPU lever (issues 5 and 9), and larger batches
    scale --measure-peak --profile "$OUT/prof" --cases 1gpu-compile-all tp2-sp-compile-symm-all \
      1gpu-compile-mb8-gbs64-all --out "$OUT/s5-x2.json" 2>&1 | tail -5 | tee "$OUT/s5-x2.log"
    scale --measure-peak --cases tp2-sp-compile-symm-all-gbs128 1gpu-compile-mb16-gbs64-all \
      --out "$OUT/s5-x2-big.json" 2>&1 | tail -4 | tee -a "$OUT/s5-x2.log"
    ;;
  s5-serve)
    # one GPU (~5 min), fifth session (issue 7): the norm fused into the decode GEMVs (tests, kernel timing), then
    # batch 1 and 64 with every decode fusion (HF static-cache baseline in the same call)
    timeout 150 python3 -m pytest -q tests/models/test_norm_linear.py tests/infer/test_gpu.py -k "norm" \
      -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/s5-serve.log"
    timeout 90 python3 bench/gemv_bench.py --norm-linear --rows 1 4 16 --json "$OUT/norm-linear.json" 2>&1 \
      | grep -v Warning | tail -9 | tee -a "$OUT/s5-serve.log"
    timeout 300 python3 bench/serve_bench.py --compile --lookahead --fuse-rope --fuse-residual --fuse-kv-write \
      --fuse-norm-linear --hf --concurrency 1,64 --http-concurrency 0 --out "$OUT/serve-norm.json" 2>&1 \
      | grep -v Warning | tail -4 | tee -a "$OUT/s5-serve.log"
    ;;
  s5-serve2)
    # one GPU (~5 min): the one-pass norm_linear kernel (kernel and engine tests, launch sweep), then batch 1 and 64
    # with it and without it
    timeout 120 python3 -m pytest -q tests/models/test_norm_linear.py tests/infer/test_gpu.py -k norm \
      -p no:cacheprovider 2>&1 | tail -1 | tee "$OUT/s5-serve2.log"
    timeout 90 python3 bench/gemv_bench.py --norm-linear --rows 1 --json "$OUT/norm-linear2.json" 2>&1 \
      | grep '^{' | tee -a "$OUT/s5-serve2.log"
    # the decode fusions are on by default now; with norm_linear (and the HF baseline), then without it
    timeout 200 python3 bench/serve_bench.py --compile --lookahead --fuse-norm-linear --hf --concurrency 1,64 \
      --http-concurrency 0 --out "$OUT/serve-norm2.json" 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/s5-serve2.log"
    timeout 100 python3 bench/serve_bench.py --compile --lookahead --concurrency 1,64 --http-concurrency 0 \
      --out "$OUT/serve-base2.json" 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/s5-serve2.log"
    ;;
  s6-table)
    # one GPU (~5 min), issue 9's acceptance table side by side in one call: Hugging Face LlamaForCausalLM of the
    # same shape (pure bf16 AdamW, eager and per-layer compiled) next to mcore's loop (best micro-batch, and mb 4)
    for c in "" "--compile"; do
      timeout 150 python3 bench/train_step_bench.py --reference hf --micro-batch 4 $c \
        --json "$OUT/table-hf${c:+-compile}.json" 2>&1 | grep '^|' | tail -1 | tee -a "$OUT/s6-table.log"
    done
    scale --measure-peak --cases 1gpu-compile-mb8-gbs64-all 1gpu-compile-all --out "$OUT/table-mcore.json" 2>&1 \
      | tail -4 | tee -a "$OUT/s6-table.log"
    ;;
  s6-curves)
    # one GPU (~6 min), issue 9: 200 steps of llama-1b at seq 1024, the path of the best number (compiled layers and
    # loss, SwiGLU kernel, weight-gradient fusion, contiguous attention) against eager PyTorch-only layers
    timeout 560 python3 bench/compare_runs.py --steps 200 --a model.swiglu_backward=torch \
      --b training.compile=layers parallel.gradient_accumulation_fusion=true model.attention_contiguous=true \
      --extra model.preset=llama-1b data.seq_length=1024 training.micro_batch_size=4 training.global_batch_size=8 \
      scheduler.warmup_iters=20 --out "$OUT/curves-s6.json" 2>&1 | tail -30 | tee "$OUT/curves-s6.log"
    ;;
  s6-autotune)
    # one GPU (~7 min, optional), issue 9: inductor's autotuned GEMM templates with fused epilogues
    scale --measure-peak --case-timeout 500 --cases 1gpu-compile-mb8-gbs64-autotune --out "$OUT/autotune.json" 2>&1 \
      | tail -3 | tee "$OUT/s6-autotune.log"
    ;;
  s6-x2)
    # nvidia-h200-x2 (~7 min), built in the fifth session after its device time was spent (issues 5 and 9): clipping
    # inside the fused AdamW (no host sync for the gradient norm) and, with compiled layers at tp > 1, the fused
    # vocabulary-parallel loss; tests first, then one GPU and tp2 + SP profiled
    timeout 200 python3 -m pytest -q tests/parallel/test_gpu_clip.py tests/parallel/test_tp_nccl.py \
      tests/train/test_compile.py -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/s6-x2.log"
    scale --measure-peak --profile "$OUT/prof" --cases 1gpu-compile-all tp2-sp-compile-symm-all \
      tp2-sp-compile-symm-ingraph --out "$OUT/s6-x2.json" 2>&1 | tail -5 | tee -a "$OUT/s6-x2.log"
    scale --measure-peak --cases 1gpu-compile-mb8-gbs64-all tp2-sp-compile-symm-all-mb16 --out "$OUT/s6-x2-mb16.json" \
      2>&1 | tail -4 | tee -a "$OUT/s6-x2.log"
    ;;
  s7-x2)
    # nvidia-h200-x2 (~8 min), built in the sixth session after its device time was spent (issues 9 and 5): the loop
    # that reads a step's loss after enqueuing the next one, each case next to the same case reading every loss
    timeout 60 python3 -m pytest -q -m gpu tests/train/test_deferred_sync.py -p no:cacheprovider 2>&1 | tail -1 \
      | tee "$OUT/s7-x2.log"
    scale --measure-peak --profile "$OUT/prof" --cases 1gpu-compile-mb8-gbs64-all 1gpu-compile-mb8-gbs64-all-sync \
      1gpu-compile-mb8-gbs64-swiglu-gaf --out "$OUT/s7-1gpu.json" 2>&1 | tail -4 | tee -a "$OUT/s7-x2.log"
    scale --measure-peak --profile "$OUT/prof" --cases 1gpu-compile-all tp2-sp-compile-symm-all 1gpu-compile-all-sync \
      tp2-sp-compile-symm-all-sync --out "$OUT/s7-tp2.json" 2>&1 | tail -5 | tee -a "$OUT/s7-x2.log"
    ;;
  s7-serve)
    # one GPU (~6 min), issue 7: the GPU tests of norm_linear and the split-K GEMV, the kernel benches (norm_linear
    # launch sweep, split-K GEMVs, SwiGLU folded into fc2), batch 1 and 64 profiled with HF static cache + compile in
    # the same call, then with fuse_swiglu_down, and with norm_linear if its sweep beat the unfused ops
    timeout 120 python3 -m pytest -q tests/models/test_norm_linear.py tests/models/test_small_gemv.py \
      tests/infer/test_gpu.py -k "norm or swiglu or partials" -p no:cacheprovider 2>&1 | tail -1 | tee "$OUT/s7-serve.log"
    timeout 75 python3 bench/gemv_bench.py --norm-linear --rows 1 --json "$OUT/norm-linear.json" \
      --best-env "$OUT/norm-linear.env" 2>&1 | grep '^{' | tee -a "$OUT/s7-serve.log"
    # split-K GEMVs for the narrow projections (64 programs at 2048 outputs), and SwiGLU folded into fc2's
    timeout 50 python3 bench/gemv_bench.py --rows 1 --no-inductor --json "$OUT/gemv-splitk.json" 2>&1 | grep '^{' \
      | tee -a "$OUT/s7-serve.log"
    timeout 45 python3 bench/gemv_bench.py --swiglu-fc2 --rows 1 4 --json "$OUT/swiglu-fc2.json" 2>&1 | grep '^{' \
      | tee -a "$OUT/s7-serve.log"
    # where batch 1's time goes (GPU kernel time against wall time, hottest kernels), with the HF baseline
    timeout 200 python3 bench/serve_bench.py --compile --lookahead --concurrency 1,64 --http-concurrency 0 --hf \
      --hf-batches 1,64 --profile "$OUT/serve-profile-batch1.txt" --out "$OUT/serve-base.json" 2>&1 \
      | grep -v Warning | tail -3 | tee -a "$OUT/s7-serve.log"
    timeout 80 python3 bench/serve_bench.py --compile --lookahead --fuse-swiglu-down --concurrency 1,64 \
      --http-concurrency 0 --out "$OUT/serve-swiglu-down.json" 2>&1 | grep -v Warning | tail -3 \
      | tee -a "$OUT/s7-serve.log"
    if python3 -c "import json,sys; s=json.load(open('$OUT/norm-linear.json'))['summary']; \
        sys.exit(min(s['best_total_us'], s['default_total_us']) >= s['unfused_total_us'])"; then
      # shellcheck disable=SC1091
      source "$OUT/norm-linear.env"
      timeout 80 python3 bench/serve_bench.py --compile --lookahead --fuse-norm-linear --concurrency 1,64 \
        --http-concurrency 0 --out "$OUT/serve-norm.json" 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/s7-serve.log"
    fi
    ;;
  s8)
    # nvidia-h200-x2 (~8 min), seventh session. GPU 1 (issue 7): GPU tests of the row kernel and the projection /
    # SwiGLU partials, its launch sweep against cuBLAS, batch 1 and 64 with HF static cache + compile, then with the
    # fusions whose best launch beat the baseline (profiled at batch 1). GPU 0 at the same time (issue 9): the loop
    # timed by CUDA events (the seventh session's fix) at micro-batch 8, 16 and 4. Then both GPUs (issue 5): tp2 + SP.
    (
      export CUDA_VISIBLE_DEVICES=1
      timeout 150 python3 -m pytest -q tests/models/test_small_gemv.py tests/infer/test_gpu.py \
        -k "swiglu or partials or gemv or linear" -p no:cacheprovider 2>&1 | tail -1 > "$OUT/s8-serve.log"
      timeout 170 python3 bench/gemv_bench.py --fma-sweep --json "$OUT/fma-sweep.json" --best-env "$OUT/fma.env" \
        2>&1 | grep -E '^[{]|sweep|Error' >> "$OUT/s8-serve.log"
      FUSE_FLAGS=""
      # shellcheck disable=SC1091
      [ -f "$OUT/fma.env" ] && source "$OUT/fma.env"
      timeout 200 python3 bench/serve_bench.py --compile --lookahead --concurrency 1,64 --http-concurrency 0 --hf \
        --hf-batches 1,64 --out "$OUT/serve-base.json" 2>&1 | grep -v Warning | tail -3 >> "$OUT/s8-serve.log"
      if [ -n "$FUSE_FLAGS" ]; then
        # shellcheck disable=SC2086
        timeout 130 python3 bench/serve_bench.py --compile --lookahead $FUSE_FLAGS --concurrency 1,64 \
          --http-concurrency 0 --profile "$OUT/serve-profile-fused.txt" --out "$OUT/serve-fused.json" 2>&1 \
          | grep -v Warning | tail -3 >> "$OUT/s8-serve.log"
      fi
    ) &
    serving=$!
    CUDA_VISIBLE_DEVICES=0 scale --measure-peak --cases 1gpu-compile-mb8-gbs64-all 1gpu-compile-mb16-gbs64-all \
      1gpu-compile-all --out "$OUT/s8-1gpu.json" 2>&1 | tail -5 | tee "$OUT/s8-train.log"
    wait "$serving"
    scale --measure-peak --cases tp2-sp-compile-symm-all --out "$OUT/s8-tp2.json" 2>&1 | tail -3 \
      | tee -a "$OUT/s8-train.log"
    cat "$OUT/s8-serve.log"
    ;;
  s9-serve)
    # one H200 (~6 min, at most 8 files back), seventh session, issue 7: GPU tests of the row kernels, the launch
    # sweep (output projection, fc2, SwiGLU + fc2, QKV, fc1), batch 1 and 64 with HF static cache + compile, then
    # with every row-kernel fusion whose launch beat cuBLAS (profiled), then the same without row_gemv
    summary() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['concurrency'], \
      round(r['output_tok_s']), round(r['tpot_ms_p50'], 4)) for r in d['engine']], d.get('hf_static_compile'))" "$@"; }
    timeout 150 python3 -m pytest -q tests/models/test_small_gemv.py tests/infer/test_gpu.py \
      -k "row or partials or gemv or swiglu" -p no:cacheprovider 2>&1 | tail -1 > "$OUT/s9-serve.log"
    timeout 170 python3 bench/gemv_bench.py --fma-sweep --json "$OUT/fma-sweep.json" --best-env "$OUT/fma.env" \
      2>&1 | grep -E '^[{]|sweep|Error' >> "$OUT/s9-serve.log"
    FUSE_FLAGS=""
    # shellcheck disable=SC1091
    [ -f "$OUT/fma.env" ] && source "$OUT/fma.env"
    timeout 200 python3 bench/serve_bench.py --compile --lookahead --concurrency 1,64 --http-concurrency 0 --hf \
      --hf-batches 1,64 --out /tmp/serve-base.json > /tmp/serve-base.log 2>&1
    cp /tmp/serve-base.json "$OUT/"; summary /tmp/serve-base.json base >> "$OUT/s9-serve.log"
    # shellcheck disable=SC2086
    timeout 130 python3 bench/serve_bench.py --compile --lookahead $FUSE_FLAGS --concurrency 1,64 \
      --http-concurrency 0 --profile "$OUT/serve-profile-fused.txt" --out "$OUT/serve-fused.json" > /tmp/f.log 2>&1
    summary "$OUT/serve-fused.json" "fused $FUSE_FLAGS" >> "$OUT/s9-serve.log"
    if [[ "$FUSE_FLAGS" == *--row-gemv* ]]; then
      # shellcheck disable=SC2086
      timeout 100 python3 bench/serve_bench.py --compile --lookahead ${FUSE_FLAGS/--row-gemv/} --concurrency 1,64 \
        --http-concurrency 0 --out /tmp/serve-partials.json > /tmp/p.log 2>&1
      summary /tmp/serve-partials.json "without row_gemv" >> "$OUT/s9-serve.log"
    fi
    tail -5 /tmp/f.log >> "$OUT/s9-serve.log"
    cat "$OUT/s9-serve.log"
    ;;
  s9-final)
    # one H200 (~2.5 min), seventh session, issue 7: batch 1 (and 64) with the row kernels at their default launches
    # (the s9-serve sweep's winners), HF static cache + compile at batch 1 in the same call; the argmax GPU test
    timeout 40 python3 -m pytest -q tests/infer/test_sampling.py -k "argmax or later" -p no:cacheprovider 2>&1 | tail -1 \
      > "$OUT/s9-final.log"
    timeout 150 python3 bench/serve_bench.py --compile --lookahead --fuse-swiglu-down --fuse-proj-partials --row-gemv \
      --concurrency 1,64 --http-concurrency 0 --hf --hf-batches 1 --out "$OUT/serve-final.json" \
      --profile "$OUT/s9-final-profile.txt" > /tmp/s.log 2>&1
    python3 -c "import json; d=json.load(open('$OUT/serve-final.json')); print([(r['concurrency'], \
      round(r['output_tok_s']), r['tpot_ms_p50'], r['runs_output_tok_s']) for r in d['engine']], \
      d.get('hf_static_compile'))" >> "$OUT/s9-final.log" 2>&1 || tail -20 /tmp/s.log >> "$OUT/s9-final.log"
    cat "$OUT/s9-final.log"
    ;;
  s10)
    # one H200 (~8 min), eighth session, issue 7: the whole serve table with the engine's defaults (row kernels auto)
    # after the lookahead copy fix: concurrency 1..256, HTTP at 64 (carry .whl), HF static + compile at 1..64; the
    # infer GPU tests first
    server_wheels
    timeout 200 python3 -m pytest -q tests/infer/test_gpu.py tests/infer/test_sampling.py -m gpu -p no:cacheprovider \
      2>&1 | tail -3 > "$OUT/s10.log"
    timeout 390 python3 bench/serve_bench.py --compile --lookahead --concurrency 1,8,32,64,256 --http-concurrency 64 \
      --hf --hf-batches 1,8,32,64 --hf-deadline 140 --out "$OUT/serve-table.json" > /tmp/s.log 2>&1
    python3 -c "import json; d=json.load(open('$OUT/serve-table.json')); print(d.get('row_kernels')); \
      [print(r['concurrency'], round(r['output_tok_s']), round(r['tpot_ms_p50'], 3), round(r['ttft_ms_p50'], 1)) \
      for r in d['engine']]; print('http', d.get('http')); print('hf', d.get('hf_static_compile'))" \
      >> "$OUT/s10.log" 2>&1 || tail -20 /tmp/s.log >> "$OUT/s10.log"
    cat "$OUT/s10.log"
    ;;
  s10-x2)
    # nvidia-h200-x2 (~6 min), eighth session, issues 5 and 9: profiles of the one-GPU and the tp2 + SP cases with the
    # deferred loss read (the last profiles predate it), and the GPUs' SM clock / power / throttle reasons meanwhile
    q=index,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu
    ( nvidia-smi --query-gpu=$q,clocks_event_reasons.active --format=csv,noheader,nounits -lms 1000 \
      || nvidia-smi --query-gpu=$q,clocks_throttle_reasons.active --format=csv,noheader,nounits -lms 1000 ) \
      > /tmp/smi.csv 2>&1 &
    scale --profile "$OUT/prof" --cases 1gpu-compile-all tp2-sp-compile-symm-all --out "$OUT/s10-x2.json" 2>&1 \
      | tail -4 | tee "$OUT/s10-x2.log"
    pkill -f "nvidia-smi --query-gpu" || true
    python3 bench/smi_summary.py /tmp/smi.csv >> "$OUT/s10-x2.log" 2>&1
    cat "$OUT/s10-x2.log"
    ;;
  s11)
    # one H200 (~3 min), eighth session: the HTTP row (issue 7) cold and warm (carry .whl; the call that ran here
    # swept the engine thread's GIL switch interval instead: no gain, removed), and the bf16 matmul rate burst vs
    # sustained at the power cap (issue 9's ceiling)
    server_wheels
    timeout 60 python3 bench/matmul_sustained.py --seconds 20 --json "$OUT/matmul-sustained.json" 2>&1 | tail -1 \
      > "$OUT/s11.log"
    timeout 300 python3 bench/serve_bench.py --compile --lookahead --concurrency 64 --http-concurrency 64 \
      --out "$OUT/serve-http.json" > /tmp/s.log 2>&1
    python3 -c "import json; d=json.load(open('$OUT/serve-http.json')); print([(r['concurrency'], \
      round(r['output_tok_s'])) for r in d['engine']]); [print(k, round(d[k].get('output_tok_s', 0)), \
      d[k].get('tpot_ms_p50'), d[k].get('ttft_ms_p50'), d[k].get('error')) for k in ('http_cold', 'http')]" \
      >> "$OUT/s11.log" 2>&1 || tail -20 /tmp/s.log >> "$OUT/s11.log"
    cat "$OUT/s11.log"
    ;;
  s12-x2)
    # nvidia-h200-x2 (~6 min), eighth session, issues 9 and 5: the levers without the contiguous q/k/v copies next to
    # the best cases of the same call (GPU 0 micro-batch 8, GPU 1 micro-batch 4 at the same time, then tp2 + SP). As
    # run, it also measured the weight-gradient GEMMs on a side stream (-side cases, since removed: no gain).
    CUDA_VISIBLE_DEVICES=1 scale --cases 1gpu-compile-all 1gpu-compile-swiglu-gaf --out "$OUT/s12-mb4.json" \
      > /tmp/s12-mb4.log 2>&1 &
    mb4=$!
    CUDA_VISIBLE_DEVICES=0 scale --cases 1gpu-compile-mb8-gbs64-all 1gpu-compile-mb8-gbs64-swiglu-gaf \
      --out "$OUT/s12-mb8.json" 2>&1 | tail -6 > "$OUT/s12-x2.log"
    wait "$mb4"
    tail -5 /tmp/s12-mb4.log >> "$OUT/s12-x2.log"
    scale --cases tp2-sp-compile-symm-all tp2-sp-compile-symm-swiglu-gaf --out "$OUT/s12-tp2.json" 2>&1 | tail -5 \
      >> "$OUT/s12-x2.log"
    cat "$OUT/s12-x2.log"
    ;;
  s13)
    # one H200 (~5 min), eighth session, issue 9: the best levers (no contiguous q/k/v copies) at global batch 64 and
    # at a pretraining-sized 256 (1M tokens a step), with the bf16 matmul rate measured in the same call (MFU)
    python3 bench/train_scaling_bench.py --preset llama-1b --steps 6 --case-timeout 200 --measure-peak \
      --cases 1gpu-compile-mb8-gbs64-swiglu-gaf 1gpu-compile-mb8-gbs256-swiglu-gaf --out "$OUT/s13.json" 2>&1 \
      | tail -5 | tee "$OUT/s13.log"
    ;;
  s15-x2)
    # nvidia-h200-x2 (~8 min), ninth session, issue 5: mcore's own sequence-parallel exchange (parallel.tp_comm=p2p)
    # next to PyTorch's fused ops and the one-GPU case of the same call; its GPU parity tests first; then a profile
    timeout 200 python3 -m pytest -q tests/parallel/test_tp_nccl.py -k "symmetric_memory or many_calls" \
      -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/s15-x2.log"
    scale --cases 1gpu-compile-swiglu-gaf tp2-sp-compile-symm-swiglu-gaf tp2-sp-compile-p2p-swiglu-gaf \
      --out "$OUT/s15-tp2.json" 2>&1 | tail -5 | tee -a "$OUT/s15-x2.log"
    scale --cases tp2-sp-compile-p2p-swiglu-gaf --profile "$OUT/profile" --out /tmp/s15-prof.json 2>&1 | tail -3 \
      | tee -a "$OUT/s15-x2.log"
    ;;
  s16-x2)
    # nvidia-h200-x2 (~7 min), ninth session, issue 5: mcore's exchange with each peer's rows in two pieces (the new
    # default) and in one (s15-x2), each against the one-GPU case of the same call, twice; GPU parity tests first
    timeout 200 python3 -m pytest -q tests/parallel/test_tp_nccl.py -k "symmetric_memory or many_calls" \
      -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/s16-x2.log"
    scale --cases 1gpu-compile-swiglu-gaf tp2-sp-compile-p2p-swiglu-gaf tp2-sp-compile-p2p-c1-swiglu-gaf \
      --out "$OUT/s16-a.json" 2>&1 | tail -5 | tee -a "$OUT/s16-x2.log"
    scale --cases 1gpu-compile-swiglu-gaf tp2-sp-compile-p2p-swiglu-gaf --out "$OUT/s16-b.json" 2>&1 | tail -4 \
      | tee -a "$OUT/s16-x2.log"
    ;;
  s17-x2)
    # nvidia-h200-x2 (~5 min), ninth session, issue 5's closing table: one GPU, dp2 with and without the overlapped
    # reduce-scatter, tp2 + SP through mcore's exchange, all with the same levers in one call; GPU parity tests first
    timeout 200 python3 -m pytest -q tests/parallel/test_tp_nccl.py tests/parallel/test_pipeline_nccl.py \
      -k "symmetric_memory or many_calls or pipeline" -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/s17-x2.log"
    scale --cases 1gpu-compile-swiglu-gaf dp2-compile-swiglu-gaf dp2-compile-swiglu-gaf-no-overlap \
      tp2-sp-compile-p2p-swiglu-gaf --out "$OUT/s17.json" 2>&1 | tail -6 | tee -a "$OUT/s17-x2.log"
    ;;
  s18-x2)
    # nvidia-h200-x2 (~6 min), ninth session, issue 5: dp2 with the peer-to-peer gradient / parameter exchange
    # (parallel.dp_comm=auto) against NCCL, with and without overlap, next to one GPU and tp2 + SP in the same call
    timeout 200 python3 -m pytest -q tests/parallel/test_pipeline_nccl.py tests/parallel/test_tp_nccl.py \
      -k "dp2 or many_calls" -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/s18-x2.log"
    scale --cases 1gpu-compile-swiglu-gaf dp2-compile-swiglu-gaf dp2-compile-swiglu-gaf-no-overlap \
      dp2-compile-swiglu-gaf-nccl tp2-sp-compile-p2p-swiglu-gaf --out "$OUT/s18.json" 2>&1 | tail -7 \
      | tee -a "$OUT/s18-x2.log"
    ;;
  s19-x2)
    # nvidia-h200-x2 (~3 min), ninth session: every 2-GPU parity test after the p2p exchanges' last change (the
    # barrier at the end of finish_grad_sync), then issue 9's best global-batch-64 case with and without inductor's
    # coordinate-descent tuning, one after the other on GPU 0
    timeout 150 python3 -m pytest -q tests/parallel/test_tp_nccl.py tests/parallel/test_pipeline_nccl.py \
      -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/s19-x2.log"
    CUDA_VISIBLE_DEVICES=0 scale --steps 6 --cases 1gpu-compile-mb8-gbs64-swiglu-gaf --out "$OUT/s19-base.json" 2>&1 \
      | tail -1 | tee -a "$OUT/s19-x2.log"
    CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 scale --steps 6 \
      --cases 1gpu-compile-mb8-gbs64-swiglu-gaf --out "$OUT/s19-cdt.json" 2>&1 | tail -1 | tee -a "$OUT/s19-x2.log"
    ;;
  s20-x2)
    # nvidia-h200-x2 (~8 min), tenth session: issue 10's large model on the two GPUs that are lent (llama3-8b, seq
    # 8192, tp2 + SP and pp2), MFU against the matmul rate measured first
    python3 bench/train_scaling_bench.py --preset llama3-8b --recipe llama3-8b --seq 8192 --steps 6 --case-timeout 270 \
      --measure-peak --cases 2gpu-8b-tp2 2gpu-8b-pp2 --out "$OUT/s20-8b.json" 2>&1 | tee "$OUT/s20-8b.log"
    ;;
  s21-x2)
    # nvidia-h200-x2 (~5 min), tenth session: issue 10's resharding on real GPUs at the size that is lent: llama-1b
    # trained at pp2, resumed at tp2 + SP, against the run that never stopped
    timeout 560 python3 bench/reshard_continue.py --world 2 --first parallel.pp=2 \
      --second parallel.tp=2 parallel.sequence_parallel=true --steps 30 \
      --extra training.micro_batch_size=4 training.global_batch_size=16 --out "$OUT/s21-reshard.json" 2>&1 \
      | tail -40 | tee "$OUT/s21-reshard.log"
    ;;
  s22)
    # one H200 (~3 min), tenth session: where the step of issue 9's best case goes now (kernel-time profile of steps
    # 4-5, global batch 64, micro-batch 8, no contiguous q/k/v copies)
    scale --steps 6 --profile "$OUT" --cases 1gpu-compile-mb8-gbs64-swiglu-gaf --out "$OUT/s22.json" 2>&1 \
      | tail -3 | tee "$OUT/s22.log"
    ;;
  s23)
    # one H200 (~8 min), tenth session: the QKV split + RoPE kernel (model.rope_kernel=triton, the default) on the GPU:
    # its tests, then issue 9's best case with PyTorch's RoPE and with the kernel, twice each, alternating; then a
    # profile of the kernel case
    timeout 120 python3 -m pytest -q -m gpu tests/models/test_qkv_rope.py -p no:cacheprovider 2>&1 | tail -3 \
      | tee "$OUT/s23.log"
    scale --measure-peak --steps 8 --cases 1gpu-compile-mb8-gbs64-swiglu-gaf-rope-torch 1gpu-compile-mb8-gbs64-swiglu-gaf \
      1gpu-compile-mb8-gbs64-swiglu-gaf-rope-torch 1gpu-compile-mb8-gbs64-swiglu-gaf --out "$OUT/s23.json" 2>&1 \
      | tail -7 | tee -a "$OUT/s23.log"
    scale --steps 6 --profile "$OUT" --cases 1gpu-compile-mb8-gbs64-swiglu-gaf --out "$OUT/s23-profile.json" 2>&1 \
      | tail -1 | tee -a "$OUT/s23.log"
    ;;
  s24-curves)
    # one GPU (~6 min), tenth session, issue 9: 200 steps of llama-1b at seq 1024, the path of the best number (compiled
    # layers and loss, Triton SwiGLU backward and QKV/RoPE kernels, weight-gradient fusion) against eager
    # PyTorch-only layers
    timeout 470 python3 bench/compare_runs.py --steps 200 --a model.swiglu_backward=torch model.rope_kernel=torch \
      --b training.compile=layers parallel.gradient_accumulation_fusion=true \
      --extra model.preset=llama-1b data.seq_length=1024 training.micro_batch_size=4 training.global_batch_size=8 \
      scheduler.warmup_iters=20 --out "$OUT/curves-s24.json" 2>&1 | tail -30 | tee "$OUT/curves-s24.log"
    ;;
  s14-table)
    # one H200 (~6 min), next session, issue 9's acceptance table in one call with the eighth session's best case:
    # Hugging Face LlamaForCausalLM (pure bf16 AdamW, eager and per-layer compiled) next to mcore's loop at global
    # batch 256 and 64 (no contiguous q/k/v copies) and micro-batch 4 (memory), the matmul rate measured in the call
    for c in "" "--compile"; do
      timeout 150 python3 bench/train_step_bench.py --reference hf --micro-batch 4 $c \
        --json "$OUT/table-hf${c:+-compile}.json" 2>&1 | grep '^|' | tail -1 | tee -a "$OUT/s14-table.log"
    done
    python3 bench/train_scaling_bench.py --preset llama-1b --steps 6 --case-timeout 200 --measure-peak \
      --cases 1gpu-compile-mb8-gbs256-swiglu-gaf 1gpu-compile-mb8-gbs64-swiglu-gaf 1gpu-compile-swiglu-gaf \
      --out "$OUT/table-mcore.json" 2>&1 | tail -5 | tee -a "$OUT/s14-table.log"
    ;;
  pending-x2)
    # nvidia-h200-x2 (~5 min): tp2 + SP after the backward reduce-scatter overlap (issue 5), NCCL layer parity first
    timeout 120 python3 -m pytest -q tests/parallel/test_tp_nccl.py -p no:cacheprovider 2>&1 | tail -3 \
      | tee "$OUT/pending-x2.log"
    scale --measure-peak --cases 1gpu tp2-sp 1gpu-opt tp2-sp-opt --out "$OUT/tp2-overlap.json" 2>&1 \
      | tee -a "$OUT/pending-x2.log"
    ;;
  gpu-tests)
    timeout 500 python3 -m pytest -q -m gpu tests -p no:cacheprovider --continue-on-collection-errors 2>&1 | tail -40 | tee "$OUT/gpu-tests.log"
    ;;
  x8)
    # parity on 8 GPUs: the runtime layouts, and the tp layers / mcore's tp exchange at tp 2, 4 and 8
    timeout 240 python3 -m pytest -q tests/parallel/test_pipeline_nccl.py tests/parallel/test_tp_nccl.py \
      -p no:cacheprovider 2>&1 | tail -20 | tee "$OUT/x8-parity.log"
    scale --steps 8 --case-timeout 100 --cases dp1-distopt dp2-distopt-p2p dp4-distopt-p2p dp8-distopt-p2p \
      dp8-distopt --out "$OUT/x8-dp-scaling.json" 2>&1 | tee "$OUT/x8-dp-scaling.log"
    ;;
  x8-large)
    python3 bench/train_scaling_bench.py --preset llama3-8b --recipe llama3-8b --seq 4096 --steps 6 --case-timeout 170 \
      --cases 8gpu-tp2-dp4 8gpu-tp4-dp2 8gpu-tp2-pp2-dp2 --out "$OUT/x8-llama3-8b.json" 2>&1 | tee "$OUT/x8-8b.log"
    timeout 300 python3 bench/reshard_continue.py --world 8 --steps 30 --out "$OUT/x8-reshard.json" 2>&1 \
      | tail -40 | tee "$OUT/x8-reshard.log"
    ;;
  *)
    echo "usage: bash bench/device_calls.sh ladder|scaling|ckpt|serve|curves|matrix|call1|agree|pending|profile-x2|nccl-x2|diag-x2|final|next|next-serve|next-x2|s5-x2|s5-serve|s5-serve2|s6-table|s6-curves|s6-autotune|s6-x2|s7-x2|s7-serve|s8|s9-serve|s9-final|s10|s10-x2|s11|s12-x2|s13|s14-table|s15-x2|s16-x2|s17-x2|s18-x2|s19-x2|s20-x2|s21-x2|s22|s23|s24-curves|pending-x2|gpu-tests|x8|x8-large" >&2
    exit 2
    ;;
esac
