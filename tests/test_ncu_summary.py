"""benchmarks/ncu_summary.py: Nsight Compute's raw CSV page reduced to one row per launch."""

from __future__ import annotations

from benchmark_scripts import load_script

RAW = '''"ID","Kernel Name","gpu__time_duration.sum","lts__throughput.avg.pct_of_peak_sustained_elapsed",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
"","","msecond","%","ratio","ratio","ratio"
"0","_column_bwd_prefetch_kernel","0.3125","82.4","3.0","4.1","0.2"
"1","_history_fwd_kernel","512.0","44.2","0.1","0.5","0.6"
'''


def test_times_in_microseconds_whatever_the_unit_and_stalls_largest_first(tmp_path, capsys):
    path = tmp_path / "raw.csv"
    path.write_text(RAW)
    assert load_script("ncu_summary").main(str(path)) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    assert [r["kernel"] for r in rows] == ["_column_bwd_prefetch_kernel", "_history_fwd_kernel"]
    assert float(rows[0]["us"]) == 312.5 and float(rows[1]["us"]) == 512000.0  # the units row was msecond
    assert float(rows[0]["L2 %"]) == 82.4
    assert rows[0]["top stalls (warps per issue)"] == "long_scoreboard 4.1, barrier 3.0, wait 0.2"
    assert rows[1]["top stalls (warps per issue)"] == "wait 0.6, long_scoreboard 0.5, barrier 0.1"
