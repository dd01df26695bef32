#!/usr/bin/env bash
# The GPU-step and comparison-family issues' compiled measurements in one device call (nvidia-h200):
#  1. Inductor's cache is filled for every model the call times, side by side (benchmarks/warm_compile.py),
#     before anything is timed, so that no timed run shares the machine with a compile; with WORKERS_CHECK=1
#     benchmarks/workers_gpu.sh (a correctness check that times nothing) runs beside it;
#  2. compiled `train` against compiled, graph-replayed `bench model` at $PRESETS, then the eager pair at
#     $EAGER_PRESETS (gpu_step_check.py speed);
#  3. with STUDY=1 and 90 s left, `study budget --preset paper350m --budget wallclock --time 30s
#     train.compile=true train.batch_size=8 $STUDY_ARGS` (it resumes on a later call: gpu_study.sh, with
#     RESTORE=study-budget-wallclock.tgz on a fresh machine); a run checkpoints at every evaluation (2.1-6.4 GB
#     at paper350m), so STUDY_ARGS=train.eval_every=4 keeps a trial near a minute;
#  4. `bench model` rows of the comparison family ($FAMILY_VARIANTS: bench model names, default every kind
#     without a fused path and delta), compiled and graph-replayed, at $FAMILY_PRESETS.
# The cache is $WORK/inductor (default ./.gpu-work): a later call on a still-warm machine reuses it.
# In $OUT: step_check.json, the study's table/runs/tgz, family-*.json, and every log in logs.tgz.
#   OUT=$OUT PRESETS=small,paper350m STUDY=1 FAMILY_PRESETS=paper350m bash benchmarks/gpu_compiled_check.sh
# LIMIT: seconds for the whole script (default 570). WARM=0 skips step 1 (a warm machine's cache is full).
set -uo pipefail
OUT=${OUT:-compiled-check}
mkdir -p "$OUT"
work=${WORK:-$PWD/.gpu-work}
mkdir -p "$work"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$work/inductor} PYTHONUNBUFFERED=1
presets=${PRESETS-small,paper100m,paper350m}
eager=${EAGER_PRESETS-}
family=${FAMILY_PRESETS-}
study=${STUDY:-1}
limit=${LIMIT:-570}
left() { echo $(( limit - SECONDS - ${1:-0} )); }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
SV=${SPEED_VARIANTS:-baseline,mhar-full-fused,mhar-block4-fused}  # gpu_step_check.py's names
V=$(echo "$SV" | sed 's/\([^,]*\)/\1-compiled/g')
F=${FAMILY_VARIANTS:-baseline-compiled,hc-compiled,hc-static-compiled,mhc-compiled,denseformer-compiled,muddformer-compiled,delta-full-fused-compiled}
warm=()
for p in ${presets//,/ }; do warm+=(--bench "$p:$V"); done
[ "$study" = 1 ] && warm+=(--study budget --preset paper350m)
for p in ${family//,/ }; do warm+=(--bench "$p:$F"); done
bg=
if [ "${WORKERS_CHECK:-0}" = 1 ]; then
  OUT=$work/workers bash benchmarks/workers_gpu.sh > "$OUT/workers.log" 2>&1 & bg=$!
fi
if [ "${WARM:-1}" = 1 ] && [ "${#warm[@]}" -gt 0 ]; then  # WARM=0: the cache was filled by an earlier call
  timeout --signal=INT "${WARM_LIMIT:-240}" python3 benchmarks/warm_compile.py --jobs "${JOBS:-6}" --threads "${THREADS:-2}" \
    --log-dir "$OUT" "${warm[@]}" train.compile=true train.batch_size=8
fi
if [ -n "$bg" ]; then wait "$bg"; echo "workers check: exit $?"; grep -E "^(PASS|FAIL|workers_gpu)" "$OUT/workers.log"; fi
echo "[warm done at ${SECONDS}s]"
if [ -n "$presets" ]; then
  STEP_CHECK_WORK=$work/step-check timeout --signal=INT "$(left 20)" \
    python3 benchmarks/gpu_step_check.py --out "$OUT" --stages speed --compile --presets "$presets" --variants "$SV"
fi
if [ -n "$eager" ]; then
  STEP_CHECK_WORK=$work/step-check timeout --signal=INT "$(left 20)" \
    python3 benchmarks/gpu_step_check.py --out "$OUT" --stages speed --presets "$eager" --variants "${EAGER_VARIANTS:-$SV}"
fi
echo "[speed done at ${SECONDS}s]"
if [ "$study" = 1 ] && [ "$(left)" -gt 90 ]; then
  STUDY_DIR=$work/study bash benchmarks/gpu_study.sh budget wallclock "$(left "${STUDY_RESERVE:-90}")" \
    --preset paper350m --time 30s train.compile=true train.batch_size=8 ${STUDY_ARGS:-}
fi
for p in ${family//,/ }; do
  [ "$(left)" -gt 60 ] || { echo "family $p: no time left"; continue; }
  split=--no-split; [ "${FAMILY_SPLIT:-0}" = 1 ] && split=  # FAMILY_SPLIT=1: profile a step (kernel ms)
  timeout --signal=INT --kill-after=20 "$(left 15)" python3 -m mhar_ablate bench model --preset "$p" --steps 5 \
    --warmup 2 $split --cuda-graph --variants "$F" --json "$OUT/family-$p.json" > "$OUT/family-$p.log" 2>&1
  tail -25 "$OUT/family-$p.log"
done
echo "[done at ${SECONDS}s]"
# At most 8 files come back from a device call: the logs travel as one archive.
(cd "$OUT" && tar -czf logs.tgz --remove-files *.log) 2>/dev/null
ls "$OUT"
