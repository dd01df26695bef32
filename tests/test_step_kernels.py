"""benchmarks/step_kernels.py's summary of a replayed step: kernels, their time, and the idle time the GPU
spent before each (overlapping kernels count no idle time)."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script


def test_idle_time_is_the_gaps_between_kernels_in_start_order():
    kernels = [("gemm", 0, 1_000), ("_route", 3_000, 1_000), ("gemm", 3_500, 2_000), ("copy", 9_000, 500)]
    s = load_script("step_kernels").summarise(kernels)
    assert s["kernels"] == 4
    assert s["kernel_ms"] == pytest.approx(4.5e-3)
    assert s["span_ms"] == pytest.approx(9.5e-3)
    # 2 us before _route; the second gemm overlaps it (no gap); 3.5 us before the copy
    assert s["idle_ms"] == pytest.approx(5.5e-3)
    assert s["by_name"]["gemm"] == [2, 3.0, 0.0]
    assert s["by_name"]["_route"] == [1, 1.0, 2.0]
    assert s["by_name"]["copy"] == [1, 0.5, 3.5]


def test_an_empty_replay_has_nothing_to_count():
    s = load_script("step_kernels").summarise([])
    assert (s["kernels"], s["kernel_ms"], s["span_ms"], s["idle_ms"]) == (0, 0, 0.0, 0.0)


def test_the_difference_lists_the_largest_change_first_with_kernels_only_one_side_has(capsys):
    """``--eager`` and the variant comparison print the kernel names whose time moved most, kernels that
    only one summary has included (counted against zero)."""
    rows = {"gemm": [2, 30.0, 1.0], "_route": [3, 12.0, 4.0]}
    base = {"gemm": [2, 25.0, 1.0], "add_norm": [3, 9.0, 2.0]}
    load_script("step_kernels").print_diff("routed against baseline", rows, base, top=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert lines == ["| `_route` | +3 | +12 | +4 |", "| `add_norm` | -3 | -9 | -2 |"]
