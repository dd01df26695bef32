#!/usr/bin/env bash
# Issue 6 on a GPU machine, in one call: the routing stack alone (benchmarks/bench_stack.py: the fused
# path's configurations checked against the reference, then timed from CUDA graphs), then training steps
# of whole models (mhar-ablate bench model) with and without CUDA-graph replay. Logs and JSON under $OUT.
#
#   OUT=$OUT STACK_CONFIGS='full:4:fwd=1,1,4,2:col=1,4,0' PRESETS=paper350m bash benchmarks/gpu_model_speed.sh
#
# CHECK=0 skips the check, STACK=0 the stack sweep, MODEL=0 the models. VARIANTS and SPP select bench model's rows.
set -uo pipefail
OUT=${OUT:-gpu-speed}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${CHECK:-1}" = 1 ]; then  # the fused path against the reference on a small model, in fp32 and bf16
  python3 benchmarks/bench_model.py --check --preset tiny --variants baseline-eager --steps 1 --warmup 1 \
    --no-split 2>&1 | tee "$OUT/check.log"
fi
if [ "${STACK:-1}" = 1 ]; then
  python3 benchmarks/bench_stack.py --out "$OUT" --d "${STACK_D:-1024}" --layers "${STACK_LAYERS:-24}" \
    --groupings "${STACK_GROUPINGS:-full,block:4}" --sites-per-pass "${STACK_SPP:-1,2,4,8}" \
    --configs "${STACK_CONFIGS:-}" --budget "${STACK_BUDGET:-200}" 2>&1 | tee "$OUT/stack.log"
fi
if [ "${MODEL:-1}" = 1 ]; then
  for preset in ${PRESETS:-paper350m}; do
    python3 benchmarks/bench_model.py --preset "$preset" --steps "${STEPS:-6}" --warmup "${WARMUP:-2}" --cuda-graph \
      --variants "${VARIANTS:-baseline-*,mhar-*-fused-*}" --sites-per-pass "${SPP:-1,4}" \
      --json "$OUT/model-$preset.json" 2>&1 | tee "$OUT/model-$preset.log"
  done
fi
