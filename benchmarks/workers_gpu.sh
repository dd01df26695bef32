#!/usr/bin/env bash
# Scale-out check on one GPU (issue 13), about 2 minutes: two study workers sharing the GPU under a steps
# budget (--workers 2 --trials-per-gpu 2), each grid point trained exactly once, the export marking the
# time and throughput columns as measured on a shared device; the same two workers refused under a
# wall-clock budget; and a one-device train through the --devices path. Prints PASS or FAIL per check
# and exits non-zero on any FAIL. Needs the wheels of benchmarks/gpu_training_check.sh (.whl/) where the
# image lacks optuna and datasets. Everything is written under $OUT (default: ./workers-gpu).
set -uo pipefail
OUT=${OUT:-workers-gpu}
rm -rf "$OUT/o"; mkdir -p "$OUT"
if ! python3 -c "import optuna, datasets" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
fails=0
check() { if eval "$2"; then echo "PASS: $1"; else echo "FAIL: $1"; fails=$((fails + 1)); fi; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
FAST=(--preset tiny --seeds 1 data.max_tokens=2000000 train.eval_every=4)

time python3 -m mhar_ablate study heads --budget steps --steps 200 --workers 2 --trials-per-gpu 2 \
  --output "$OUT/o" "${FAST[@]}" > "$OUT/study.log" 2>&1
code=$?
tail -20 "$OUT/study.log"
check "study --workers 2 --trials-per-gpu 2 exits 0" "[ $code = 0 ]"
check "both workers pinned to GPU 0 and marked as sharing it" \
  "[ \$(grep -c 'on GPU 0.*(shares its GPU)' '$OUT/study.log') = 2 ]"
check "both workers trained trials" "grep -q '^w0: \[' '$OUT/study.log' && grep -q '^w1: \[' '$OUT/study.log'"
python3 - "$OUT/o" > "$OUT/grid.txt" 2>&1 <<'PY'
import sys, collections, optuna
from pathlib import Path
from mhar_ablate.sweep.catalog import open_storage
out = Path(sys.argv[1])
study = optuna.load_study(study_name="heads-steps", storage=open_storage(f"journal://{(out / 'studies.journal').resolve()}", create=False))
done = collections.Counter(t.user_attrs.get("grid_point") for t in study.trials if t.state.name == "COMPLETE")
print("complete per point:", dict(done))
print("OK" if len(done) == 6 and set(done.values()) == {1} else "BAD")
print("devices:", sorted({t.user_attrs.get("device") for t in study.trials if t.state.name == "COMPLETE"}))
PY
cat "$OUT/grid.txt"
check "all 6 grid points finished exactly once" "grep -qx OK '$OUT/grid.txt'"
python3 -m mhar_ablate export heads --output "$OUT/o" --format md > "$OUT/heads.md" 2>/dev/null
cat "$OUT/heads.md"
check "export marks the shared-device columns" "grep -q 'Measured on a shared device' '$OUT/heads.md' && grep -q 'throughput vs baseline †' '$OUT/heads.md'"

python3 -m mhar_ablate study heads --budget wallclock --time 5s --workers 2 --output "$OUT/o2" "${FAST[@]}" \
  > "$OUT/refused.log" 2>&1
code=$?
cat "$OUT/refused.log"
check "two wall-clock workers on one GPU are refused in one line (exit 2)" \
  "[ $code = 2 ] && [ \$(wc -l < '$OUT/refused.log') = 1 ] && grep -q 'needs 2 GPUs' '$OUT/refused.log'"

python3 -m mhar_ablate train --devices 1 --budget wallclock --time 10s --output "$OUT/o3" --preset tiny \
  data.max_tokens=2000000 > "$OUT/train.log" 2>&1
code=$?
tail -3 "$OUT/train.log"
check "train --devices 1 on the GPU completes" "[ $code = 0 ] && grep -q '^completed' '$OUT/train.log'"

if [ $fails = 0 ]; then echo "workers_gpu: PASS"; else echo "workers_gpu: FAIL ($fails checks)"; exit 1; fi
