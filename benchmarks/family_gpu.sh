#!/usr/bin/env bash
# Issue 12 on a GPU machine, in one call (nvidia-h200; BUDGET caps it at 6 minutes): a correctness smoke of every
# residual kind (benchmarks/family_smoke.py: 40 bf16 steps at the `small` preset each, no NaN, the loss comes
# down, the pre-norm-at-init kinds' first loss matches the baseline's, each step captured in a CUDA graph as
# `train` does), then `bench model` rows of the comparison family, compiled and each also replayed from a
# CUDA graph, at paper350m and then paper100m.
# Everything under $OUT: smoke.{log,json}, model-PRESET.{log,json} (one JSON row per measurement, written
# as each is measured, so a run cut short keeps what it measured).
#
#   OUT=$OUT bash benchmarks/family_gpu.sh
#
# Knobs: PRESETS (default "paper350m paper100m"), VARIANTS (bench model names or patterns), STEPS (5),
# WARMUP (2), SMOKE=0 skips the smoke (SMOKE_TIME caps it, default 120 s), BUDGET (seconds for the whole script, default 360; up to ~560 fits
# one 600-s device call): each preset's bench gets what is left less RESERVE seconds (default 120) per
# preset after it, and is stopped there (SIGINT).
# Compilation is most of the time: each compiled row's `warmup_s` says how long its model took.
set -uo pipefail
OUT=${OUT:-family-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${SMOKE:-1}" = 1 ]; then
  timeout --signal=INT --kill-after=20 "${SMOKE_TIME:-120}" \
    python3 benchmarks/family_smoke.py --json "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.log"
fi
# The new kinds, compiled (bench model runs them in the registry's order, the baseline first).
VARIANTS=${VARIANTS:-baseline-compiled,hc-compiled,hc-static-compiled,denseformer-compiled,muddformer-compiled,delta-full-fused-compiled,mhc-compiled}
presets=(${PRESETS:-paper350m paper100m})
for i in "${!presets[@]}"; do
  preset=${presets[$i]}
  left=$(( ${BUDGET:-360} - SECONDS - (${#presets[@]} - 1 - i) * ${RESERVE:-120} ))
  if [ "$left" -lt 60 ]; then
    echo "skipping $preset: ${left}s left of the budget"
    continue
  fi
  echo "== bench model --preset $preset (up to ${left}s)"
  timeout --signal=INT --kill-after=20 "$left" \
    python3 -m mhar_ablate bench model --preset "$preset" --steps "${STEPS:-5}" --warmup "${WARMUP:-2}" --no-split \
      --cuda-graph --variants "$VARIANTS" --json "$OUT/model-$preset.json" 2>&1 | tee "$OUT/model-$preset.log"
done
echo "done in ${SECONDS}s"
