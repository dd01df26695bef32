#!/usr/bin/env bash
# The GPU-step issue's compiled targets in one device call (nvidia-h200, ~9 minutes):
#  1. Inductor's cache is filled for every model the call times, side by side (benchmarks/warm_compile.py),
#     before anything is timed, so that no timed run shares the machine with a compile;
#  2. compiled `train` against compiled, graph-replayed `bench model` at $PRESETS (gpu_step_check.py speed);
#  3. with STUDY=1 (default) and 90 s left, `study budget --preset paper350m --budget wallclock --time 30s
#     train.compile=true train.batch_size=8` in the time left (it resumes on a later call: gpu_study.sh).
# Everything lands in $OUT: warm.log, step_check.json, bench-*.log, train-*.log, the study's table/runs/tgz.
#   OUT=$OUT bash benchmarks/gpu_compiled_check.sh        (LIMIT: seconds for the whole script, default 570)
set -uo pipefail
OUT=${OUT:-compiled-check}
mkdir -p "$OUT"
work=${WORK:-$PWD/.gpu-work}
mkdir -p "$work"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$work/inductor} PYTHONUNBUFFERED=1
presets=${PRESETS:-small,paper100m,paper350m}
limit=${LIMIT:-570}
study=(--preset paper350m --time 30s train.compile=true train.batch_size=8)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
V=baseline-compiled,mhar-full-fused-compiled,mhar-block4-fused-compiled
warm=()
for p in ${presets//,/ }; do warm+=(--bench "$p:$V"); done
if [ "${STUDY:-1}" = 1 ]; then warm+=(--study budget --preset paper350m); fi
if [ "${#warm[@]}" -gt 0 ]; then
  timeout --signal=INT "${WARM_LIMIT:-240}" python3 benchmarks/warm_compile.py --jobs "${JOBS:-6}" --log-dir "$OUT" "${warm[@]}" train.compile=true train.batch_size=8
fi
echo "[warm done at ${SECONDS}s]"
if [ -n "$presets" ]; then
  STEP_CHECK_WORK=$work/step-check timeout --signal=INT $(( limit - SECONDS - 20 )) \
    python3 benchmarks/gpu_step_check.py --out "$OUT" --stages speed --compile --presets "$presets"
fi
echo "[speed done at ${SECONDS}s]"
if [ "${STUDY:-1}" = 1 ] && [ $(( limit - SECONDS )) -gt 90 ]; then
  STUDY_DIR=$work/study bash benchmarks/gpu_study.sh budget wallclock $(( limit - SECONDS - 15 )) "${study[@]}"
fi
echo "[done at ${SECONDS}s]"
