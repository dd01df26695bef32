"""A short table of what Nsight Compute measured per kernel launch: the raw page of a report, as CSV
(``ncu --import R.ncu-rep --page raw --csv``), reduced to time, DRAM and L2 throughput, cache hit rates,
occupancy, issue activity and the largest stall reasons per issued instruction.

    ncu --import $OUT/prof.ncu-rep --page raw --csv > $OUT/raw.csv
    python3 benchmarks/ncu_summary.py $OUT/raw.csv
"""

from __future__ import annotations

import sys

import pandas as pd

TO_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
COLUMNS = {
    "gpu__time_duration.sum": "us",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2 %",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "L1 %",
    "l1tex__t_sector_hit_rate.pct": "L1 hit %",
    "lts__t_sector_hit_rate.pct": "L2 hit %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "launch__registers_per_thread": "regs",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue %",
    # ComputeWorkloadAnalysis: the tensor pipe's share of its peak (its name differs between ncu releases)
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor %",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor %",
    "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active": "tensor inst %",
    "launch__shared_mem_per_block_dynamic": "smem B",
    "launch__occupancy_limit_shared_mem": "blocks (smem)",
    "launch__occupancy_limit_registers": "blocks (regs)",
}
STALL = "smsp__average_warps_issue_stalled_"


def main(path: str) -> int:
    raw = pd.read_csv(path, low_memory=False)
    units, raw = raw.iloc[0], raw.iloc[1:]  # the first row holds the units
    rows = []
    for _, r in raw.iterrows():
        row = {"kernel": str(r.get("Kernel Name", ""))[:28]}
        for col, label in COLUMNS.items():
            if col in raw.columns:
                v = pd.to_numeric(str(r[col]).replace(",", ""), errors="coerce")
                row[label] = round(v * TO_US.get(str(units[col]), float("nan")), 1) if label == "us" else v
        stalls = {c[len(STALL):].removesuffix("_per_issue_active.ratio"): pd.to_numeric(r[c], errors="coerce")
                  for c in raw.columns if c.startswith(STALL) and c.endswith("_per_issue_active.ratio")}
        top = sorted(((v, k) for k, v in stalls.items() if v == v), reverse=True)[:4]
        row["top stalls (warps per issue)"] = ", ".join(f"{k} {v:.1f}" for v, k in top)
        rows.append(row)
    print(pd.DataFrame(rows).to_markdown(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
