#!/usr/bin/env bash
# Everything a GPU has to show, in one go: the CUDA extension and the compiled (CUDA-graph) steps.
#
#   bash dev/gpu_check.sh [LOG_DIR]         # logs go to LOG_DIR, else $OUT, else out/gpu_check
#   DRY_RUN=1 bash dev/gpu_check.sh         # print the steps only (tests/test_dev.py parses them)
#
# LOG_DIR gets five files (the device tool brings back at most 8 from $OUT): gpu_check.txt,
# everything printed, step by step, and the JSON of the four bench runs.
#
# 1. the GPU, driver, torch and nvcc versions
# 2. python dev/kernels_check.py: build, validate every op and kernel version, time fused vs
#    reference at B = 1 and B = 32
# 3. the kernel tests (kernels == references, end-to-end dflash with the kernels on), without
#    the tests of the CPU emulation (dev/emu.h), which stand in for this step without a GPU;
#    and tests/test_static.py's GPU test: compiled steps (the target's verify pass and each
#    drafter's propose) replayed as CUDA graphs give eager's tokens
# 4. which attention kernel the target's masked grouped-query pass gets (dev/sdpa_probe.py)
# 5. bench.py on the GPU with the committed cpu weights, every method but `draft` (8 passes per 1.5
#    tokens) and `dflash-tree` (eager either way), eager (--no-compile) and then with every verify
#    pass a replayed CUDA graph (--compile, the GPU's default; each learned drafter's propose
#    compiled too): issue 49's table. A model this small is bound by per-op overhead (~450 aten ops
#    a step; one plain step on this project's slowest 2-core CPU: 11 ms, ~1.6 ms of it matmuls), and
#    on a GPU each op is a launch. Each row's time and tau are printed as it ends; the compiled run
#    first compiles each method's verify shape in its untimed warm-up (~25-35 s a shape on the
#    2-core CPU; on the GPU not yet measured).
# 6. a few steps of training on the GPU: a tiny target (with MTP heads, in bf16 autocast as on
#    cuda), then distillation and each learned drafter. No test trains on a GPU, so this is
#    where a device bug in training would show. ~40 s on a 2-core CPU, 8 s of it
#    building the token bins (out/ does not travel to the device).
# Every step runs even if an earlier one fails (each has a time limit, so a hang cannot eat a
# GPU lease); the exit status is non-zero if any failed. The limits add up to 580 s, so the
# whole script fits one device call (at most 600 s) even if every step hangs. Measured on an
# H200 (an earlier version, eager bench only): env 12 s, selfcheck 33 s (18 s of it the build),
# sdpa 8 s, the eager bench of these methods 74 s, train_smoke 47 s: the limits keep 20 % or
# more over those and give the rest to the compiled runs, never measured (a cut-off run's log
# still shows each method's compile time as its warm-up ends). The kernels off
# (DFLASH_CUDA_EXT=0) and bfloat16 runs of that version: docs/experiments.md.
set -uo pipefail
cd "$(dirname "$0")/.."
# the device image's interpreter with torch is python3 (a plain `python` may be missing there)
PY=${PYTHON:-$(command -v python3 || command -v python)}
LOG=${1:-${OUT:-out/gpu_check}}
DRY_RUN=${DRY_RUN:-0}
[ "$DRY_RUN" = 1 ] || mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
failed=0

TXT=$LOG/gpu_check.txt
[ "$DRY_RUN" = 1 ] && TXT=/dev/null
: >"$TXT"
step() {  # step NAME SECONDS CMD...: run CMD for at most SECONDS, log to the terminal and $TXT
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most $limit s): $*" | tee -a "$TXT"
  [ "$DRY_RUN" = 1 ] && return
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$TXT"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$TXT"
  [ "$rc" -eq 0 ] || failed=1
  # a step cut off by its limit mid-build leaves torch's build lock behind, and each later step
  # would wait on it forever (torch's cpp_extension.load); no build runs between steps
  rm -f out/cuda_build/*/lock
}

# the GPU, the versions, and where the build will find the CUDA runtime (kernels._cudart_flags)
ENV_REPORT="nvidia-smi
$PY -c 'import torch; print(\"torch\", torch.__version__, torch.version.cuda,
                           torch.cuda.get_device_name())'
nvcc --version | tail -2
command -v nvcc
$PY -c 'from torch.utils import cpp_extension as c; import dflash_kernels as kernels
h = c.CUDA_HOME; print(\"CUDA_HOME\", h, \"| link flags\", h and kernels._cudart_flags(h))'"
step env 16 bash -c "$ENV_REPORT"
step selfcheck 60 $PY dev/kernels_check.py
# -v: a step cut off by its limit still shows which test ran last. Left out: every test of the
# CPU emulation (CI's stand-in for this GPU, and the only tests that feed the extension bad
# arguments: on the H200 image (torch 2.11.0+cu130) a failing TORCH_CHECK whose message formats
# an integer segfaulted the interpreter, in a minimal load_inline extension too; docs/
# troubleshooting.md, "The CUDA extension"). -n 4 where pytest-xdist is installed (the GPU image
# has it): a test that kills the interpreter costs one worker, not the rest of the step.
XDIST=$($PY -c 'import xdist' 2>/dev/null && echo "-n 4")
EMULATED="emu or self_check_covers or self_check_fails or self_check_counts or ops_take"
EMULATED="$EMULATED or dispatches"
# test_static's CPU tests (inductor) ran in CI; here only its CUDA-graph ones
step tests 100 $PY -m pytest $XDIST -v -rs tests/test_kernels.py \
  tests/test_static.py::test_cuda_graphs_give_the_greedy_tokens_of_eager_decoding \
  -k "not ($EMULATED)"
step sdpa 12 $PY dev/sdpa_probe.py
B="$PY bench.py --device cuda"  # the committed weights/cpu
ALL="--methods ar,dflash,eagle,mtp,ngram"
step bench_eager 90 $B $ALL --no-compile --json "$LOG/bench_eager.json"
# A compiled run times nothing until its warm-up has compiled every method's verify shape and
# propose (the latter per temperature; ~8 graphs at T = 0, never timed on a GPU): one run cut
# off by its limit there would bring back no row at all. So issue 49's headline pair (plain
# decoding and DFlash at T = 0) runs first and alone, then the other methods at T = 0, then all
# at T = 1; each run its own ar beside it (the verify graphs come from inductor's cache there).
# perf_hints: a "skipping cudagraphs" line says why a compiled step ran without its graph (the
# card counts them)
G="env TORCH_LOGS=recompiles,perf_hints $B --compile"
step bench_graphs_dflash 100 $G --methods ar,dflash --temperatures 0 \
  --json "$LOG/bench_graphs_dflash.json"
step bench_graphs_t0 80 $G --methods ar,ngram,eagle,mtp --temperatures 0 \
  --json "$LOG/bench_graphs_t0.json"
step bench_graphs_t1 65 $G $ALL --temperatures 1 --json "$LOG/bench_graphs_t1.json"
TRAIN_SMOKE='W=$(mktemp -d); trap "rm -rf $W" EXIT
$PY train.py --preset tiny --device cuda --max-steps 20 --batch-size 4 --seq-len 128 \
  --mtp-depth 2 --eval-every 10 --eval-batches 2 --out-path "$W/target.pt" &&
for m in mtp eagle dflash; do
  $PY train_drafter.py --method $m --target "$W/target.pt" --out-dir "$W" --device cuda \
    --n-seqs 8 --n-val-seqs 2 --gen-len 16 --max-steps 5 --eval-every 5 || exit 1
done'
step train_smoke 57 env PY="$PY" bash -c "$TRAIN_SMOKE"
verdict=$([ $failed -eq 0 ] && echo 'every step passed' || echo 'SOME STEP FAILED')
echo "gpu_check: logs in $LOG; $verdict" | tee -a "$TXT"
exit $failed
