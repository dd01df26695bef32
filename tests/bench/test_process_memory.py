"""``benchmarks/process_memory.py``'s summary of its samples (the sampling itself needs a GPU)."""

from __future__ import annotations

from benchmark_scripts import load_script


def row(t, phase, step, process, reserved):
    return {"t": t, "phase": phase, "step": step, "process_mib": process, "reserved_mib": reserved, "allocated_mib": 0.0}


def test_the_summary_names_the_phase_and_step_where_the_process_outgrows_the_allocator():
    pm = load_script("process_memory")
    rows = [row(0.5, "prepare and capture", 0, 1024.0, 900.0),
            row(1.0, "training", 5, 4096.0, 3072.0),          # 1 GiB apart: the context, not worth a line
            row(1.5, "periodic evaluation", 9, 10240.0, 4096.0),  # 6 GiB beyond the reserve
            row(2.0, "training", 12, None, 4096.0)]             # nvidia-smi did not list the process
    lines = pm.summarize(rows)
    table = {l.split(" | ")[0].strip("| "): l for l in lines if l.startswith("| ") and "---" not in l}
    assert table["training"].split(" | ")[1] == "1"  # the unlisted sample is left out
    assert table["periodic evaluation"].split(" | ")[4:6] == ["6.44", "9 |"]
    assert lines[-1] == ("gap first over 2 GB: 1.5 s, phase periodic evaluation, step 9 "
                         "(process 10.0 GiB, reserved 4.0 GiB)")
    assert pm.summarize(rows[:2])[-1] == "gap first over 2 GB: never"
