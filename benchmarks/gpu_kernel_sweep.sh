#!/usr/bin/env bash
# Issue 16 on a GPU machine, in one call: the fused path's kernels against the float64 oracle
# (tests/test_kernels_gpu.py, the history, column and fused-path tests; their whole log in tests-full.log),
# then every routing kernel of a training step timed alone with its bytes and share of the copy bandwidth
# (benchmarks/bench_kernels.py), launch configurations swept. Logs and JSON under $OUT.
#
#   OUT=$OUT PRESETS=paper350m,paper1b PREV=.gpu-prev COL='1,4,2;1,4,4' HIST='4:1,1,6,2' QUERY='64,32,4,3,4' \
#       bash benchmarks/gpu_kernel_sweep.sh
#
# PREV: a folder with a package prev_kernels (earlier history.py, column.py, launch.py) to time beside the
# current kernels; PROFILE='PRESET:COLUMN_CONFIGS ...' runs Nsight Compute on one call per version first
# (PROFILE_KINDS='column_groups,...': which kinds' largest calls; NCU_ARGS: more ncu options);
# WRITE='TOKENS,WARPS;...' sweeps write_slot, ROWS='W;...' the row kernels' warps, TWO='TOKENS,WARPS,STAGES;...'
# the column kernel's passes over two slots; ROWSTAGES='S[,CAP];...' the backward row kernel's pipeline depth;
# DOT='TOKENS,WARPS,STAGES,MAX_S;...' the head-tiled forward's matrix-product form, STACKED='TOKENS,WARPS,
# STAGES,ROWS;...' its stacked products' form (several tokens' sources in a tile, few sources); ONE=1 times the
# column passes one slot a pass too; GROUPSLOTS='K;...' plans the column passes with group passes of at most K
# slots (0: none), GROUPWEIGHTS='W;...' with a group pass's bytes counted W times,
# GROUP='TOKENS,WARPS,STAGES,MAX_S[,HOLD];...' sweeps the group pass; OTHER=1 times the output gradients kept
# the other way (copied or in place, against the width's table); MERGE='WARPS,STAGES;...' sweeps the merges'
# kernel, TILES='T;...' the token tiles a program of the head-tiled forward walks; TESTS=0 skips the tests,
# KINDS='column,...' the kinds timed at their defaults (all when unset), BENCH=0 no timings; NORMS=1 times
# them again with the sublayers' pre-norms folded in (--norms; logs and JSON under $OUT/norms);
# BYSOURCE='1,2,4,...' times the shared pass alone by source count in its forms, DOT's and STACKED's
# configurations among them (benchmarks/bench_history.py, under $OUT/by-source).
set -uo pipefail
OUT=${OUT:-gpu-kernels}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -rf -p no:cacheprovider tests/test_kernels_gpu.py \
    -k "${TEST_SELECT:-history or column or sites or fused or write_slot}" 2>&1 | tee "$OUT/tests-full.log" \
    | tail -8 | tee "$OUT/tests.log"
fi
if [ -n "${PROFILE:-}" ]; then  # PROFILE='PRESET:COLUMN_CONFIGS PRESET:...': Nsight Compute on one call per version
  for item in $PROFILE; do
    preset=${item%%:*} cols=${item#*:}
    timeout "${PROFILE_LIMIT:-150}" ncu --clock-control none --nvtx --nvtx-include "profile/" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats --section ComputeWorkloadAnalysis --section SchedulerStats ${NCU_ARGS:-} \
      -f -o "$OUT/prof-$preset" python3 benchmarks/bench_kernels.py --profile \
      --presets "$preset" --column-configs "$cols" --group-configs "${GROUP:-}" \
      ${PROFILE_KINDS:+--profile-kinds "$PROFILE_KINDS"} --out "$OUT" > "$OUT/ncu-$preset.log" 2>&1
    grep profiled "$OUT/ncu-$preset.log"
    ncu --import "$OUT/prof-$preset.ncu-rep" --page raw --csv > "$OUT/raw-$preset.csv" 2>/dev/null
    python3 benchmarks/ncu_summary.py "$OUT/raw-$preset.csv" | tee "$OUT/ncu-$preset.md"
  done
fi
bench() {  # $1: where its log and JSON go, then more options
  mkdir -p "$1"
  python3 benchmarks/bench_kernels.py --presets "${PRESETS:-paper350m}" --out "$1" ${PREV:+--prev "$PREV"} \
    --column-configs "${COL:-}" --history-configs "${HIST:-}" --history-dot "${DOT:-}" --stacked "${STACKED:-}" \
    --query-configs "${QUERY:-}" --write-configs "${WRITE:-}" --row-warps "${ROWS:-}" --two-slot-configs "${TWO:-}" \
    --row-stages "${ROWSTAGES:-}" \
    --group-slots "${GROUPSLOTS:-}" --group-weights "${GROUPWEIGHTS:-}" --group-configs "${GROUP:-}" \
    --merge-configs "${MERGE:-}" --history-tiles "${TILES:-}" ${ONE:+--one-slot} ${OTHER:+--other-grads} \
    ${KINDS:+--kinds "$KINDS"} "${@:2}" 2>&1 | tee "$1/bench_kernels.log"
}
if [ -n "${BYSOURCE:-}" ]; then
  mkdir -p "$OUT/by-source"
  python3 benchmarks/bench_history.py --presets "${PRESETS:-paper350m}" --sources "$BYSOURCE" --dot "${DOT:-}" \
    --stacked "${STACKED:-}" --out "$OUT/by-source" 2>&1 | tee "$OUT/by-source/bench_history.log"
fi
if [ "${BENCH:-1}" = 1 ]; then
  bench "$OUT"
  if [ "${NORMS:-0}" = 1 ]; then bench "$OUT/norms" --norms; fi
fi
