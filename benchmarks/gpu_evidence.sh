#!/usr/bin/env bash
# The evidence issue's studies in one device call, one after another, each as a user runs it
# (benchmarks/gpu_study.sh), bounded in time and resumable.
# usage: OUT=$OUT bash benchmarks/gpu_evidence.sh BUDGET LIMIT_SECONDS NAME:SEEDS[,NAME:SEEDS...] [study options ...]
#   OUT=$OUT bash benchmarks/gpu_evidence.sh steps 420 heads:3,budget:3,grouping:2 --preset small
# Each study trains into $WORK/evidence/NAME-BUDGET (default ./.gpu-work: a later call on a still-warm machine
# resumes there). On a fresh machine, RESTORE=FILE.tgz (an earlier call's state.tgz, such as the committed
# docs/results/small/state.tgz, or its evidence-BUDGET.tgz) restores every study folder first, when $WORK
# holds none; an unfinished trial then starts again from step 0.
# Under --budget steps, PACK trials share the GPU (--workers PACK --trials-per-gpu PACK, default 4): the
# studies' exports then mark their time and throughput columns as measured on a shared device. Under
# --budget wallclock every trial has the GPU to itself (the package refuses to pack it).
# Writes $OUT/evidence-BUDGET.tgz: per study its folder less checkpoints and weights, its log, its exported
# table and its runs (benchmarks/collect_runs.py); and $OUT/state.tgz (below). The tables are printed last.
set -u
budget=$1 limit=$2 list=$3; shift 3
out=${OUT:-.}
work=${WORK:-$PWD/.gpu-work}/evidence
pack=${PACK:-4}
mkdir -p "$work" "$out"
if [ -n "${RESTORE:-}" ] && [ -z "$(ls -A "$work")" ]; then  # never over a warm machine's newer state
  tar -xzf "$RESTORE" -C "$work" && echo "restored $(ls "$work" | tr '\n' ' ')from $RESTORE"
fi
extra=()
[ "$budget" = wallclock ] || extra=(--workers "$pack" --trials-per-gpu "$pack")
for spec in ${list//,/ }; do
  name=${spec%%:*} seeds=${spec#*:}
  left=$(( limit - SECONDS - 60 ))  # the export and the kill-after margin of gpu_study.sh
  [ "$left" -gt 30 ] || { echo "$name $budget: no time left"; continue; }
  dir=$work/$name-$budget
  mkdir -p "$dir/log"
  STUDY_DIR=$dir/study OUT=$dir/log bash benchmarks/gpu_study.sh "$name" "$budget" "$left" \
    --seeds "$seeds" "${extra[@]}" "$@" > "$dir/log/gpu_study.out"
  rm -f "$dir/log/study-$name-$budget.tgz"  # the folder itself goes into the one archive below
  runs=$(grep -c '"arm"' "$dir/log/runs-$name-$budget.json" 2>/dev/null)
  echo "$name $budget: ${runs:-0} runs, ${SECONDS}s, $(grep -m1 "^study $name $budget: exit" "$dir/log/gpu_study.out" | sed 's/.*: //')"
  grep -q "exit 0" "$dir/log/gpu_study.out" || tail -2 "$dir/log/study-$name-$budget.log"
done
tar -czf "$out/evidence-$budget.tgz" --exclude='*.ckpt' --exclude='*.safetensors' --exclude='cache' -C "$work" .
# What a later session needs to resume or grow the studies (the databases, every run's result.json and
# config; no TensorBoard events or images: publish_results.py draws a heatmap again from result.json),
# small enough to commit (docs/results/PRESET/state.tgz).
tar -czf "$out/state.tgz" --exclude='*.ckpt' --exclude='*.safetensors' --exclude='cache' --exclude=tb --exclude='events.out.tfevents.*' \
  --exclude='*.png' --exclude='*.lock' --exclude=log -C "$work" .
for spec in ${list//,/ }; do
  name=${spec%%:*}
  echo "== $name $budget"; cat "$work/$name-$budget/log/table-$name-$budget.md" 2>/dev/null
done
