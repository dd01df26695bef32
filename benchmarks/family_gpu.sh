#!/usr/bin/env bash
# Issue 12 on a GPU machine, in one call (nvidia-h200, about 6 minutes): first a correctness smoke of every
# residual kind (benchmarks/family_smoke.py: 40 bf16 steps at the `small` preset each, no NaN, the loss comes
# down, the pre-norm-at-init kinds' first loss matches the baseline's), then `bench model` rows of the
# comparison family, compiled and each also replayed from a CUDA graph, at paper350m and then paper100m.
# Everything under $OUT: smoke.{log,json}, model-PRESET.{log,json} (one JSON row per measurement, written
# as each is measured, so a run cut short keeps what it measured).
#
#   OUT=$OUT bash benchmarks/family_gpu.sh
#
# Knobs: PRESETS (default "paper350m paper100m"), VARIANTS (bench model names or patterns), STEPS (5),
# WARMUP (2), SMOKE=0 skips the smoke, BUDGET (seconds for the whole script, default 540: each preset's
# bench gets what is left less RESERVE seconds (default 150) per preset after it, and is stopped there).
# Compilation is most of the time: each compiled row's `warmup_s` says how long its model took.
set -uo pipefail
OUT=${OUT:-family-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${SMOKE:-1}" = 1 ]; then
  python3 benchmarks/family_smoke.py --json "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.log"
fi
# The new kinds, compiled (bench model runs them in the registry's order, the baseline first).
VARIANTS=${VARIANTS:-baseline-compiled,hc-compiled,hc-static-compiled,denseformer-compiled,muddformer-compiled,delta-full-fused-compiled,mhc-compiled}
presets=(${PRESETS:-paper350m paper100m})
for i in "${!presets[@]}"; do
  preset=${presets[$i]}
  left=$(( ${BUDGET:-540} - SECONDS - (${#presets[@]} - 1 - i) * ${RESERVE:-150} ))
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
