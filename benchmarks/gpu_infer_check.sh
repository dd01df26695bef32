#!/usr/bin/env bash
# `bench infer` on one GPU (inference issue), and optionally the kernels' GPU tests first, in one device call.
#   OUT=$OUT PRESETS=small,paper350m TESTS=1 bash benchmarks/gpu_infer_check.sh
# Per preset: `python3 -m mhar_ablate bench infer --preset P --cuda-graph --json $OUT/infer-P.json`, which
# writes its JSON after every row, so a preset cut by the limit keeps the rows it measured.
# TESTS=1: `pytest tests/test_kernels_gpu.py` (fp32/bf16/fp16 against the float64 oracle) before timing.
# LIMIT: seconds for the whole script (default 560); VARIANTS: bench infer's --variants (default all).
set -uo pipefail
OUT=${OUT:-infer-check}
mkdir -p "$OUT"
limit=${LIMIT:-560}
left() { echo $(( limit - SECONDS - ${1:-0} )); }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
if [ "${TESTS:-0}" = 1 ]; then
  timeout --signal=INT "${TESTS_LIMIT:-150}" python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_gpu.py \
    > "$OUT/kernel-tests.log" 2>&1
  echo "kernel GPU tests: exit $?"; tail -5 "$OUT/kernel-tests.log"
fi
IFS=, read -ra presets <<< "${PRESETS:-small,paper350m}"
for p in "${presets[@]}"; do
  [ "$(left)" -gt 30 ] || { echo "infer $p: no time left"; continue; }
  timeout --signal=INT --kill-after=15 "$(left 10)" python3 -m mhar_ablate bench infer --preset "$p" --cuda-graph \
    --variants "${VARIANTS:-all}" --json "$OUT/infer-$p.json" > "$OUT/infer-$p.log" 2>&1
  echo "infer $p: exit $? at ${SECONDS}s"; tail -30 "$OUT/infer-$p.log"
done
echo "[done at ${SECONDS}s]"
(cd "$OUT" && tar -czf infer-logs.tgz --remove-files *.log) 2>/dev/null
ls "$OUT"
