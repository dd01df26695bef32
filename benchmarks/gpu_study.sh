#!/usr/bin/env bash
# A study on the GPU, as a user runs it, bounded in time: trains into $STUDY_DIR (default /tmp/gpu-study),
# exports its tables, and writes the per-run results (arm, seed, tokens/s, peak memory, step mode) to $OUT.
# usage: benchmarks/gpu_study.sh NAME BUDGET LIMIT_SECONDS [study options and key=value ...]
# A study cut off by the limit resumes from its database on the next call with the same STUDY_DIR. The
# folder with its exported tables and plots, less its checkpoints and weights, is also written to
# $OUT/study-NAME-BUDGET.tgz: carry that file into a later
# call as $RESTORE and a fresh machine goes on from there (an unfinished trial starts again from step 0).
# A stop at the limit lets the running trial checkpoint (SIGTERM), then kills the study 45 s later: give the
# call LIMIT + 45 s + the export's time (at paper350m, reserve about 90 s in all).
set -u
name=$1 budget=$2 limit=$3; shift 3
dir=${STUDY_DIR:-/tmp/gpu-study}
out=${OUT:-.}
if [ -n "${RESTORE:-}" ] && [ ! -e "$dir" ]; then
  mkdir -p "$dir" && tar -xzf "$RESTORE" -C "$dir" && echo "restored $dir from $RESTORE"
fi
timeout --signal=TERM --kill-after=45 "$limit" python3 -m mhar_ablate study "$name" --budget "$budget" --output "$dir" "$@" \
  > "$out/study-$name-$budget.log" 2>&1
echo "study $name $budget: exit $?"
python3 -m mhar_ablate export "$name" --budget "$budget" --output "$dir" --format md > "$out/table-$name-$budget.md" 2>&1
# Weights and checkpoints stay on the machine (a file back from a device call is at most 16 MiB).
tar -czf "$out/study-$name-$budget.tgz" --exclude='*.ckpt' --exclude='*.safetensors' --exclude='cache' -C "$dir" .
cat "$out/table-$name-$budget.md"
python3 benchmarks/collect_runs.py "$dir/studies/$name/$budget" > "$out/runs-$name-$budget.json"
