"""The grouping of ``benchmarks/memory_excess.py`` (what is live at a step's peak, and the routed-minus-
baseline table) on synthetic allocator traces: the measurement itself needs a GPU."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def me():
    return load_script("memory_excess")


def frame(path, line, name):
    return {"filename": f"/repo/mhar_ablate/{path}", "line": line, "name": name}


TORCH = {"filename": "/venv/torch/nn/functional.py", "line": 10, "name": "linear"}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr, size):
    return [{"action": "free_requested", "addr": addr, "size": size, "frames": []},
            {"action": "free_completed", "addr": addr, "size": size, "frames": []}]


def test_live_at_peak_groups_what_is_live_at_the_peak_only(me):
    buffer = frame("model/residual/fused.py", 110, "__init__")
    act = frame("model/transformer.py", 50, "forward")
    trace = [
        alloc(1, 100, TORCH, act),  # an activation, twice from the same line
        alloc(2, 100, TORCH, act),
        *free(900, 40),  # a block from before the step, freed before the peak
        alloc(3, 500, buffer),
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},  # requested, not completed: live
        alloc(4, 60),  # no Python frame: backward
        *free(3, 500),
        *free(1, 100),
        alloc(5, 300, act),  # after the peak: not live at it
    ]
    result = me.live_at_peak(trace, allocated_before=1000)
    assert result["peak"] == 1000 + 100 + 100 - 40 + 500 + 60
    groups = result["groups"]
    assert groups[me.BEFORE_STEP]["bytes"] == 960
    assert groups["model/transformer.py:50 forward"] == {"bytes": 200, "count": 2, "area": "model", "code": ""}
    assert groups["model/residual/fused.py:110 __init__"]["area"] == "routing"
    (backward,) = [g for k, g in groups.items() if k.startswith("no Python frame")]
    assert backward["bytes"] == 60 and backward["area"] == "backward (autograd)"
    assert sum(g["bytes"] for g in groups.values()) == result["peak"]


def test_autograd_nodes_and_compiled_code_are_named(me):
    assert me.group_of([{"filename": "", "line": 0, "name": "torch::autograd::generated::MmBackward0::apply"}])[0] \
        == "autograd MmBackward0"
    inductor = {"filename": "/tmp/torchinductor_root/ab/cabc.py", "line": 3, "name": "call"}
    assert me.group_of([inductor])[1] == "compiled code"
    # a package frame wins over both, and is the innermost one
    assert me.group_of([inductor, frame("training/step.py", 9, "_step"), frame("bench.py", 1, "step")])[0] \
        == "training/step.py:9 _step"


def test_code_after_a_graph_break_groups_with_its_function(me):
    # Dynamo's resume functions run the same source lines as an unbroken model's frame; grouped apart, a
    # routed model's logits would count as excess against a baseline whose logits are the same tensor.
    broken = frame("model/transformer.py", 222, "torch_dynamo_resume_in_forward_at_210")
    assert me.group_of([broken]) == me.group_of([frame("model/transformer.py", 222, "forward")])
    assert me.group_of([broken])[0] == "model/transformer.py:222 forward"


def test_excess_table_lists_the_largest_differences_first(me):
    base = {"peak": 1000, "groups": {
        me.BEFORE_STEP: {"bytes": 600, "count": None, "area": "before the step", "code": ""},
        "model/transformer.py:50 forward": {"bytes": 400, "count": 4, "area": "model", "code": "x = f(x)"}}}
    routed = {"peak": 1500, "groups": {
        me.BEFORE_STEP: {"bytes": 610, "count": None, "area": "before the step", "code": ""},
        "model/transformer.py:50 forward": {"bytes": 300, "count": 3, "area": "model", "code": "x = f(x)"},
        "model/residual/fused.py:110 __init__": {"bytes": 590, "count": 1, "area": "routing", "code": "buf"}}}
    rows = me.excess_rows(base, routed, top=2)
    assert [(r["group"], r["excess"]) for r in rows] == [
        ("model/residual/fused.py:110 __init__", 590), (me.BEFORE_STEP, 10)]
    text = me.render("paper350m", "eager", "mhar-full", base, routed, top=5)
    assert "excess +0.00 GB (1.500x)" in text
    assert text.index("fused.py:110") < text.index("transformer.py:50")
    assert "routing 0.00 -> 0.00" in text.splitlines()[-1]
