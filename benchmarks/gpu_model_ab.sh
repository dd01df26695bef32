#!/usr/bin/env bash
# Training steps of this tree's package against an earlier one's, in one call on one GPU: for each preset,
# `bench model` with each variant and its baseline timed in turn (--rounds), first with this tree's package,
# then with the one under $PREV (a folder holding an earlier commit's mhar_ablate/ and configs/, e.g.
# `git archive <commit> mhar_ablate configs | tar -x -C .gpu-prev/head`), so that the two verdicts come
# from the same card and hour. Logs and JSON rows under $OUT (new-PRESET.*, prev-PRESET.*).
#
#   OUT=$OUT PREV=.gpu-prev/head PRESETS="paper350m paper1b" ROUNDS=7 bash benchmarks/gpu_model_ab.sh
#
# CHECK=1 first checks the fused path against the reference (small model, fp32 and bf16, determinism).
# VARIANTS (default baseline-compiled,mhar-block4-fused-compiled), STEPS (5), WARMUP (2), SPP (4), FOLD
# (bench model's --fold-norms: off,on times both forms of each fused variant in one process; default: the
# package's; this tree's rows only), STACKED (--stacked-config: 'off;32,1,3,16' times the shared pass without
# and with its stacked products' form, in one process; with FOLD, every pair). Without PREV, only this tree
# is timed:
#
#   OUT=$OUT FOLD=off,on STACKED='off;32,1,3,16' PRESETS="paper1b paper350m" ROUNDS=11 bash benchmarks/gpu_model_ab.sh
set -uo pipefail
OUT=${OUT:-gpu-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
bench() {  # $1: the package's folder, $2: the output prefix, $3: the preset, then more options
  (cd "$1" && PYTHONPATH=$1 python3 "$HERE/benchmarks/bench_model.py" --preset "$3" --steps "${STEPS:-5}" \
    --warmup "${WARMUP:-2}" --cuda-graph --sites-per-pass "${SPP:-4}" --rounds "${ROUNDS:-7}" \
    --variants "${VARIANTS:-baseline-compiled,mhar-block4-fused-compiled}" "${@:4}" \
    --json "$OUT/$2-$3.json") \
    2>&1 | tee "$OUT/$2-$3.log"
}
HERE=$PWD
OUT=$(cd "$OUT" && pwd)
if [ "${CHECK:-0}" = 1 ]; then
  PYTHONPATH=$HERE python3 benchmarks/bench_model.py --check --preset tiny --variants baseline-eager,mhar-full-fused-eager \
    --steps 1 --warmup 1 --no-split ${STACKED:+--stacked-config "$STACKED"} 2>&1 | tee "$OUT/check.log"
fi
for preset in ${PRESETS:-paper350m}; do
  bench "$HERE" new "$preset" ${FOLD:+--fold-norms "$FOLD"} ${STACKED:+--stacked-config "$STACKED"}
  if [ -n "${PREV:-}" ]; then bench "$(cd "$PREV" && pwd)" prev "$preset"; fi
done
for f in "$OUT"/*.json; do  # the verdicts, last: variant, x baseline (the rounds' range), step ms
  python3 - "$f" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if r.get("round_ratios"):
        clocks = [c for pair in r.get("round_clocks_mhz", []) for c in pair if c is not None]
        fold = {None: "", True: " folded", False: " unfolded"}[r.get("fold_norms")]
        fold += f" stacked {r['stacked_config']}" if r.get("stacked_config") else ""
        print(f"{sys.argv[1].rsplit('/', 1)[-1]:>24} {r['variant'] + fold:<60} {r['ratio_to_baseline']:.4f} "
              f"({min(r['round_ratios']):.4f}-{max(r['round_ratios']):.4f}) {r['step_ms']:.2f} ms "
              f"against {r['baseline_step_ms']:.2f}, peak x {r.get('peak_ratio_to_baseline')}"
              + (f", SM clock {min(clocks)}-{max(clocks)} MHz" if clocks else ""))
PY
done
