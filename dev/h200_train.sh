#!/usr/bin/env bash
# Issue 52, item 2, in one device call (at most 600 s): the broad corpus built on the H200
# machine, the reference target trained there (the `ref` preset, 12.6M params, to replace
# weights/cpu), the draft model, the MTP, EAGLE and DFlash drafters distilled from it and their
# bf16 export; bench.py on the GPU in a second session (FROM_WEIGHTS), as dev/gpu_check.sh.
#
#   bash dev/h200_train.sh [LOG_DIR]     # logs go to LOG_DIR, else $OUT, else out/h200_train
#   TINY=1 DEVICE=cpu WORK=/tmp/h200 bash dev/h200_train.sh /tmp/h200_log  # every step, tiny
#   DRY_RUN=1 bash dev/h200_train.sh     # print the commands only (tests/test_dev.py parses them)
#   FROM_WEIGHTS=weights/cpu DRAFTER_MINUTES=4.3 bash dev/h200_train.sh   # a second session
#   FROM_WEIGHTS=weights/cpu N_SEQS=65536 DRAFTER_MINUTES=2.8 bash dev/h200_train.sh  # more data
#
# A second session, once a first one's target is committed: FROM_WEIGHTS names a folder whose
# target.pt and draft.pt are used as they are (no target or draft-model training), so the
# drafters get DRAFTER_MINUTES each (default 1.3; 4.3 fits the call). A drafter needs more
# distinct continuations once it would see each one more than ~5 times (on the CPU, 31 passes
# stalled while 5.2 and 1.3 passes gave one curve; docs/experiments.md, "Drafters against the
# interim target"): at the guessed rate 4.3 minutes on 16,384 are ~20 passes, 2.8 minutes on
# 65,536 ~3 (by held-out loss: on the CPU 8x the continuations lowered it 0.28 and left tau as
# it was, docs/experiments.md). N_SEQS (default 16,384) sets how many; the distill step's limit
# grows with it (30 s per 16,384: size it by the first session's measured rate, the
# `distill (train)` lines of h200_train.txt).
#
# The device session runs, with timeout_s 600:  bash dev/h200_train.sh
# With the machine's start that is most of a session's 15 minutes: there is no second try in it.
# LOG_DIR gets at most 7 files (the tool brings back 8, 16 MiB each): h200_train.txt (all that
# was printed, step by step), corpus_meta.json (the corpus's files, bytes and tokens, copied
# once it is built), bench_h200.json (FROM_WEIGHTS only), and the bf16 checkpoints as tars in
# 15 MiB parts: target.tar.part-aa, -ab (the target, ~25 MB, as soon as it is trained: the
# device tool may cut a call short of timeout_s when the machine's start was slow, and what is
# under $OUT by then still comes back) and weights.tar.part-* (the draft model and drafters at
# the end; with FROM_WEIGHTS the target too). Check the files against the sha256 sums the log
# printed. Back home, after the CPU bench has been checked (under 5 minutes), with
# weights/interim removed (weights/ holds 60 MB at most):
#   for t in target weights; do cat $t.tar.part-* | tar -x -C weights/cpu; done
# If only the target came back, commit it alone (e.g. weights/next/target.pt) and give the next
# session FROM_WEIGHTS=weights/next: a folder without draft.pt gets the draft model trained.
# Rehearsed with the TINY set in place: 7 tests read the committed weights' values and fail
# until re-measured: tests/test_checkpoint.py's CASES (each tau and a floor ~0.7x it; the
# failure message prints the tau) and its test that the committed DFlash names the layers it
# was trained on (1, 2, 4, 5, 6; the new one reads (1, 2, 3, 4, 5)), as does the line on it in
# draft_diffusion.feature_layers' docstring; tests/test_bench.py's default target
# (preset "ref"); the README drafter's `greedy tau` (tests/test_speculate.py prints it). Then
# the README's table, its reading and its weights/ line (no interim).
# The full checkpoints (with their optimizers) and the distilled data stay in WORK (default
# out/h200) on the machine, which is given back: a later session starts again from the bf16 files.
#
# The steps, their limits (at most 580 s; a step that outlives its SIGINT is killed 10 s later)
# and what each should take. NOTHING HERE HAS RUN ON A GPU: the times are guesses from the
# sizes, except where a measurement is named.
# 1. env 10 s: the GPU, torch, disk.
# 2. data 85 s: `data.py --corpus all`. Measured on this project's 2-core CPU machine: 204 MB of
#    source, 63.3M train tokens (data.OOD_PACKAGES left out), in 21-38 s, 1.6 cores busy:
#    tiktoken's batch encoding runs in threads (3.99 MB/s on one, 7.48 on two). The H200 image
#    holds more packages (jax, flax, pandas, scikit-learn, statsmodels, numba, ...): guess
#    300-400 MB, 95-125M tokens, 20-60 s on its 16 cores.
# 3. target 280 s: the `ref` preset (384 wide, 6 blocks; ~20 tokens a parameter at 250M tokens,
#    and 1.5x the `cpu` preset's pass on the CPU: docs/experiments.md, "The GPU target's size")
#    on the broad corpus, batch 256 x 384 tokens (98k a step), lr 3e-3 (the CPU run: 8 x 384 at
#    1.5e-3), bf16 autocast, 4.2 minutes on the clock (the schedule follows it). Guess: 0.8-1.6M
#    tokens/s (a model this narrow is bound by memory traffic and launches, far from the
#    790 TFLOP/s of big matrix products; ~1.85x the `cpu` preset's FLOPs), so 2,000-4,100 steps
#    and 200-400M tokens; under 0.8M tokens/s it falls short of the issue's 200M, and
#    torch.compile is the next thing to try. A save every minute: cut off, it still has weights.
# 4. distill 70 s, two runs side by side: the distillation (16,384 + 256 windows of 64 tokens
#    from the broad corpus, each continued by 192 tokens of the target, in batches of 2,048,
#    greedy and T = 1 in turn; guess 5-10 ms a decode step, 15-30 s), and the draft model
#    (`cpu-draft`, 1.44M params, 0.8 minutes). N_SEQS=65,536 gives it 160 s.
# 5. drafters 110 s (DRAFTER_MINUTES x 60 + 32), three runs side by side, 1.3 minutes of
#    training each after a few seconds of start-up. Each step (the target's pass over the
#    batch for its features, then the drafter's) is bound by launches and ends in a host sync:
#    guess 15-30 ms a step for DFlash (batch 32), 30-50 for EAGLE (16, 7 test steps), 15-25 for
#    MTP (16), so ~3,000 / ~2,000 / ~4,000 steps. Batch and lr are the CPU recipe's
#    (train_drafter.RECIPE) scaled up: DFlash 8 -> 32 at 6e-4 -> 2.4e-3 (on the CPU that learns
#    as much per sequence as batch 8: docs/experiments.md, "Batch 32") with 16 anchors a
#    sequence instead of 8 (0.16 lower held-out loss at equal steps on the CPU, where a step
#    costs 1.4x; on a GPU bound by launches nearly nothing: "Anchors"), EAGLE 2 -> 16 at
#    2e-3 -> 6e-3 (6e-3 led 3e-3 over ~490 CPU steps: "EAGLE at batch 16"), MTP 2 -> 16 at
#    2e-3 -> 6e-3 (ahead of 3e-3 over ~720 CPU steps: "MTP at batch 16"). The target's
#    features are computed per step (--features step): all of them at once would take 59 GB in
#    fp32 for the three runs (33 for DFlash's 5 layers, 20 for EAGLE's 3, 7 for MTP), too near
#    an H100's 80.
# 6. export 12 s: dev/export_weights.py's export_checkpoint on each, in one interpreter (3 s on
#    the CPU machine), a summary (steps, tokens seen, held-out loss), the tar. The target's own,
#    12 s, runs as soon as it is trained (step 3), in a first session.
# 7. bench 95 s, with FROM_WEIGHTS only (the first session gives its time to the target):
#    bench.py --device cuda on the new weights, ar, ngram, mtp, eagle, dflash at T = 0 and 1
#    (`draft` is left to the CPU: 8 passes a step on a GPU), the CUDA extension built beside the
#    drafters in step 5 (~18 s on an H200, dev/gpu_check.sh). gpu_check's same rows took 74 s
#    there, the extension already built.
#    Eager (--no-compile): compiling each method's shapes (the GPU's default) takes ~30 s a
#    shape on a CPU and would not fit; dev/gpu_check.sh measures the compiled path.
# Every step runs even if an earlier one failed (each has its limit, so a hang cannot eat the
# lease); the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# the device image's interpreter with torch is python3 (a plain `python` may be missing there)
PY=${PYTHON:-$(command -v python3 || command -v python)}
LOG=${1:-${OUT:-out/h200_train}}
W=${WORK:-out/h200}  # the fp32 checkpoints, the distilled data, the bf16 copies
DEV=${DEVICE:-cuda}
DRY_RUN=${DRY_RUN:-0}
[ "$DRY_RUN" = 1 ] || { mkdir -p "$LOG" "$W" && rm -rf "$W"/*.run.pt "$W/weights"; }  # ours only
export PYTHONUNBUFFERED=1 PY LOG W
failed=0
TXT=$LOG/h200_train.txt
[ "$DRY_RUN" = 1 ] && TXT=/dev/null
: >"$TXT"

# the sizes; TINY=1 appends flags that shrink every step (argparse: the last flag wins)
TARGET="--preset ref --corpus all --device $DEV --batch-size 256 --lr 3e-3 --warmup-steps 100"
TARGET="$TARGET --eval-every 250 --eval-batches 8 --save-minutes 1"
DRAFT="--preset cpu-draft --corpus all --device $DEV --batch-size 256 --lr 3e-3 --minutes 0.8"
DRAFT="$DRAFT --eval-every 250 --eval-batches 4 --save-minutes 0 --threads 4"
# the distillation's settings name its cached file: every drafter run below reuses it
NS=${N_SEQS:-16384}
D="--target $W/target.pt --out-dir $W --device $DEV --corpus all --n-seqs $NS"
D="$D --n-val-seqs 256 --prompt-len 64 --gen-len 192 --distill-batch 2048 --threads 4"
D="$D --features step"  # the target's, per batch: all at once would not fit (step 5)
DISTILL_S=$((40 + 30 * NS / 16384))  # 70 s at 16,384: a guess, see step 4 above
DM=${DRAFTER_MINUTES:-1.3}  # each drafter's training; its step's limit adds ~32 s of start-up
FROM=${FROM_WEIGHTS:-}
R="--minutes $DM --eval-every 500 --save-minutes 0"
T_TRAIN="" T_DISTILL="" T_RUN="" T_BENCH=""
if [ "${TINY:-0}" = 1 ]; then  # 30-40 s on a 2-core CPU once out/data-all is built
  T_TRAIN="--max-steps 3 --batch-size 4 --seq-len 64 --eval-every 2 --eval-batches 1 --threads 1"
  T_DISTILL="--n-seqs 8 --n-val-seqs 4 --prompt-len 16 --gen-len 16 --distill-batch 4 --threads 1"
  T_RUN="--max-steps 2 --eval-every 1 --batch-size 4"
  T_BENCH="--n-prompts 2 --max-new-tokens 8 --temperatures 0 --threads 1"
fi

# A step's limit ends it with SIGINT, as Ctrl-C would: a training run then saves its steps to its
# .run.pt, which export_all takes when the finished checkpoint is missing (-k 10: then SIGKILL).
step() {  # step NAME SECONDS CMD...: run CMD for at most SECONDS, log to the terminal and $TXT
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most $limit s): $*" | tee -a "$TXT"
  [ "$DRY_RUN" = 1 ] && return
  local t0=$SECONDS
  timeout -s INT -k 10 "$limit" "$@" 2>&1 | tee -a "$TXT"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$TXT"
  [ "$rc" -eq 0 ] || failed=1
}

tagged() {  # tagged TAG SECONDS CMD: the shell command CMD for at most SECONDS, lines as [TAG]
  local t0=$SECONDS
  timeout -s INT -k 10 "$2" bash -c "$3" 2>&1 | sed -u "s/^/[$1] /" | tee -a "$TXT"
  local rc=${PIPESTATUS[0]}
  echo "== $1: exit $rc after $((SECONDS - t0)) s" | tee -a "$TXT"
  return "$rc"
}

par() {  # par NAME SECONDS TAG CMD [TAG CMD ...]: the CMDs side by side, each as tagged runs it
  local name=$1 limit=$2 pids=()
  shift 2
  while [ $# -gt 0 ]; do
    echo "== $name/$1 (at most $limit s): $2" | tee -a "$TXT"
    [ "$DRY_RUN" = 1 ] || { tagged "$1" "$limit" "$2" & pids+=($!); }
    shift 2
  done
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
}

export_all() {  # export_all TAR MODEL...: their bf16 copies, a summary of each, TAR in parts
  local tar=$1
  shift
  mkdir -p "$W/weights"  # emptied at the start: only this run's copies are there
  # one interpreter for all: torch's import alone takes seconds
  $PY - "$W" "$@" <<'EOF'
import os, sys, torch
from dev.export_weights import export_checkpoint  # run from the repository's root
w, failed = sys.argv[1], 0
for m in sys.argv[2:]:
    src = f"{w}/{m}.pt" if os.path.exists(f"{w}/{m}.pt") else f"{w}/{m}.run.pt"  # cut off
    try:
        ck = torch.load(src, map_location="cpu", weights_only=True)
        export_checkpoint(src, f"{w}/weights/{m}.pt")
    except Exception as e:  # one missing or broken, the others still go
        print(f"NOT EXPORTED: {m} ({type(e).__name__}: {e})")
        failed = 1
        continue
    a, run = ck["args"], f"{ck['step']} steps in {ck.get('elapsed', 0) / 60:.2f} min"
    run += " (CUT OFF: its last save)" if src.endswith(".run.pt") else ""
    mb = os.path.getsize(f"{w}/weights/{m}.pt") / 1e6
    if ck["kind"] == "target":  # tokens seen: steps x batch x sequence length
        T = a["seq_len"] or ck["config"]["max_seq_len"]
        print(f"{m} ({mb:.1f} MB bf16): {run}, {ck['step'] * a['batch_size'] * T / 1e6:.1f}M "
              f"tokens ({a['batch_size']} x {T} a step), val {ck['val_loss']:.3f} nats/token, "
              f"{ck['bpb']:.3f} bits/byte")
    else:
        agree = " ".join(f"{x:.2f}" for x in (ck.get("val_agreement") or [])[:16])
        print(f"{m} ({mb:.1f} MB bf16): {run}, batch {a['batch_size']}, held-out top-1 "
              f"agreement per position {agree}")
sys.exit(failed)
EOF
  local rc=$? files=()
  for m in "$@"; do [ -e "$W/weights/$m.pt" ] && files+=("$m.pt"); done
  [ ${#files[@]} -gt 0 ] || return 1
  (cd "$W/weights" && sha256sum "${files[@]}")
  # 15 MiB parts: the tool brings back files of at most 16 MiB
  tar -cf - -C "$W/weights" "${files[@]}" | split -b 15m - "$LOG/$tar.tar.part-" || rc=1
  ls -l "$LOG"
  return "$rc"
}
export -f export_all

ENV_REPORT="nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$PY -c 'import os, torch; print(\"torch\", torch.__version__, \"CUDA\", torch.version.cuda,
  torch.cuda.is_available() and torch.cuda.get_device_name(), \"|\", os.cpu_count(), \"cores\")'
df -h . | tail -1"
step env 10 bash -c "$ENV_REPORT"
step data 85 $PY data.py --corpus all
[ "$DRY_RUN" = 1 ] || cp out/data-all/meta.json "$LOG/corpus_meta.json"
# a FROM folder's target and (if it has one) draft model, as they are
OLD_DRAFT=$([ -n "$FROM" ] && [ -e "$FROM/draft.pt" ] && echo "$FROM/draft.pt")
if [ -n "$FROM" ]; then
  step target 10 cp "$FROM/target.pt" $OLD_DRAFT "$W/"
else
  step target 280 $PY train.py $TARGET --minutes 4.2 --out-path $W/target.pt $T_TRAIN
  step target-out 12 bash -c "export_all target target"  # under $OUT, whatever happens next
fi
# cut off by its limit, the target has its last minute's save: train the drafters for that
[ "$DRY_RUN" = 1 ] || [ -e "$W/target.pt" ] || { cp "$W/target.run.pt" "$W/target.pt" &&
  echo "NOTE: the target run did not finish; the drafters use its last save" | tee -a "$TXT"; }
# a 1-step mtp run builds the distilled data (its mtp.pt goes: only the run below's is exported);
# the CUDA extension's accept scan would be built first, for a loop with no drafts
DISTILL=("distill" "DFLASH_CUDA_EXT=0 $PY train_drafter.py --method mtp $D --max-steps 1 \
--save-minutes 0 $T_DISTILL && rm $W/mtp.pt")
[ -n "$OLD_DRAFT" ] || DISTILL+=("draft" "$PY train.py $DRAFT --out-path $W/draft.pt $T_TRAIN")
par distill "$DISTILL_S" "${DISTILL[@]}"
# with a bench to come, the CUDA extension is built beside them (~18 s of nvcc on the host's
# cores): nothing before bench builds it, and bench's 95 s hold its rows' 74 with little to spare
KERNELS=()
[ -z "$FROM" ] || KERNELS=("kernels" "$PY -c \"import dflash_kernels as k; k.available('$DEV')\"")
par drafters "$(awk "BEGIN { print int($DM * 60 + 32) }")" \
  dflash "$PY train_drafter.py --method dflash $D $R --batch-size 32 --lr 2.4e-3 --anchors 16 \
--continuation-only $T_DISTILL $T_RUN" \
  eagle "$PY train_drafter.py --method eagle $D $R --batch-size 16 --lr 6e-3 $T_DISTILL $T_RUN" \
  mtp "$PY train_drafter.py --method mtp $D $R --batch-size 16 --lr 6e-3 $T_DISTILL $T_RUN" \
  "${KERNELS[@]}"
rm -f out/cuda_build/*/lock  # a build cut off by the limit leaves it, and bench would wait on it
OUTS="draft mtp eagle dflash"
[ -z "$FROM" ] || OUTS="target $OUTS"  # bench reads the target from $W/weights too
step export 12 bash -c "export_all weights $OUTS"
[ -z "$FROM" ] || step bench 95 $PY bench.py --device $DEV --target $W/weights/target.pt \
  --weights $W/weights --methods ar,ngram,mtp,eagle,dflash --no-compile \
  --json $LOG/bench_h200.json $T_BENCH
verdict=$([ $failed -eq 0 ] && echo 'every step passed' || echo 'SOME STEP FAILED')
echo "h200_train: logs in $LOG; $verdict" | tee -a "$TXT"
exit $failed
