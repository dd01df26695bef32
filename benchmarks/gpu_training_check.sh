#!/usr/bin/env bash
# End-to-end check of the training stack on a GPU machine whose image lacks optuna and datasets:
# installs the wheels carried in .whl (see ../shared/tools/device-wheels.sh), then runs a wall-clock
# train on the `small` preset (fused path, bf16 autocast), a two-seed `heads` study under both budgets,
# and its export. Everything is written under $OUT (default: ./gpu-check).
set -euo pipefail
OUT=${OUT:-gpu-check}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'lightning', lightning.__version__)"
python3 -m mhar_ablate train --output "$OUT/o" --budget wallclock --time 20s --preset small 2>&1 | tail -4
python3 -m mhar_ablate train --output "$OUT/o" --budget wallclock --time 20s --preset small train.compile=true 2>&1 \
  | tail -4 || echo "the compiled run failed"
python3 -m mhar_ablate study heads --budget steps --steps 100 --preset small --output "$OUT/o" 2>&1 | tail -16
python3 -m mhar_ablate study heads --budget wallclock --time 6s --preset small --output "$OUT/o" 2>&1 | tail -16
python3 -m mhar_ablate export heads --output "$OUT/o" --format md > "$OUT/heads.md"
cat "$OUT/heads.md"
