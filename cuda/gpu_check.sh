#!/usr/bin/env bash
# Everything the CUDA extension has to show on a GPU, in one go (a few minutes on an H200):
#
#   bash cuda/gpu_check.sh [LOG_DIR]        # logs go to LOG_DIR, else $OUT, else out/gpu_check
#
# 1. the GPU, driver, torch and nvcc versions
# 2. python -m cuda: build, validate every op and kernel version, time fused vs reference at
#    B = 1 and B = 32
# 3. the CUDA tests (kernels == references, end-to-end dflash with the kernels on)
# 4. bench.py on the GPU with the committed cpu weights (the gpu preset has none yet and would
#    train for ~15 min): ar and dflash with the kernels on and off (DFLASH_CUDA_EXT=1 / 0),
#    then bfloat16 with the kernels on
# Every step runs even if an earlier one fails; the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-out/gpu_check}}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME CMD...: run CMD, log its output to LOG/NAME.txt and to the terminal
  local name=$1
  shift
  echo "== $*" | tee "$LOG/$name.txt"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG/$name.txt"
  [ "$rc" -eq 0 ] || failed=1
}

step env bash -c 'nvidia-smi; python -c "import torch; print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; nvcc --version | tail -2'
step selfcheck python -m cuda
step tests python -m pytest -q -rs tests/test_cuda.py
B="python bench.py --device cuda --preset cpu --methods ar,dflash --repeats 3"
step bench_fused env DFLASH_CUDA_EXT=1 $B --json "$LOG/bench_fused.json"
step bench_ref env DFLASH_CUDA_EXT=0 $B --json "$LOG/bench_ref.json"
step bench_bf16 env DFLASH_CUDA_EXT=1 $B --dtype bfloat16 --temperatures 0
echo "gpu_check: logs in $LOG; $([ $failed -eq 0 ] && echo 'every step passed' || echo 'SOME STEP FAILED')"
exit $failed
