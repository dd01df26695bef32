"""``bench model``: refuses without a GPU, its CPU smoke mode runs end to end (tiny preset, 2 steps), and the
bookkeeping of CUDA-graph rows (ratios, table, routing split) holds on hand-made rows."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mhar_ablate.bench.step import _copy_split
from mhar_ablate.bench.model import _ratios, render_table
from mhar_ablate.bench.cli import add_bench_parser, cmd_bench
from mhar_ablate.bench.variants import all_variants, select_variants
from mhar_ablate.errors import UsageError


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "model", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu():
    with pytest.raises(UsageError, match="--device cpu"):
        cmd_bench(_args("--preset", "tiny"))


def test_cpu_smoke_run_writes_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = cmd_bench(_args("--device", "cpu", "--preset", "tiny", "--steps", "2", "--warmup", "1",
                           "--variants", "mhar-full-ref-eager", "--json", str(out)))
    assert code == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["baseline-eager", "mhar-full-ref-eager"]  # the baseline is added
    for r in rows:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and not r["compiled"]
        assert {"preset", "routing", "grouping", "path", "compiled", "tokens_per_s", "ratio_to_baseline",
                "peak_gb"} <= set(r)
        assert r["cuda_graph"] is False and r["compile_mode"] is None and r["split_from"] is None
    assert rows[0]["ratio_to_baseline"] == 1.0 and rows[1]["routing_ms"] is not None
    assert rows[0]["ratio_to_fastest_baseline"] == 1.0
    assert "| mhar-full-ref-eager |" in capsys.readouterr().out.splitlines()[-1]


def test_variant_selection():
    variants = all_variants([None])
    names = [v.name for v in select_variants("mhar-*-fused-compiled", variants)]
    assert names == ["baseline-compiled", "mhar-full-fused-compiled", "mhar-block4-fused-compiled"]
    with pytest.raises(UsageError, match="matches no variant"):
        select_variants("hyper-*", variants)
    with pytest.raises(UsageError, match="--device cpu runs eager variants only"):
        cmd_bench(_args("--device", "cpu", "--preset", "tiny", "--variants", "*-compiled"))


def test_fold_norms_gives_one_fused_row_per_value_where_the_kind_folds():
    """``--fold-norms off,on``: mhar's and AttnRes's fused rows twice (the model built with the sublayers'
    pre-norms in its routing kernels, or not), delta's and the reference path's once; the table says which."""
    from mhar_ablate.bench.options import fold_norms_option as _fold_norms
    from mhar_ablate.bench.step import build_model

    variants = select_variants("*-fused-compiled,mhar-full-ref-compiled", all_variants([None], _fold_norms("off,on")))
    seen = [(v.name, v.fold_norms) for v in variants]
    for kind in ("mhar", "attnres"):
        assert (f"{kind}-full-fused-compiled", False) in seen and (f"{kind}-full-fused-compiled", True) in seen
    assert [f for name, f in seen if name.startswith("delta-")] == [None, None]  # full and block4, once each
    assert ("mhar-full-ref-compiled", None) in seen
    folded = next(v for v in variants if v.name == "mhar-block4-fused-compiled" and v.fold_norms)
    unfolded = next(v for v in variants if v.name == "mhar-block4-fused-compiled" and v.fold_norms is False)
    assert build_model(folded, "tiny", 4, 64, torch.device("cpu")).residual.fold_norms is True
    assert build_model(unfolded, "tiny", 4, 64, torch.device("cpu")).residual.fold_norms is False
    rows = [{**_row("mhar-block4-fused-compiled", "mhar", True, False, 90.0, 3.0), "fold_norms": f}
            for f in (False, True)]
    rows = [_row("baseline-compiled", "baseline", True, False, 100.0, 3.0), *rows]
    _ratios(rows)
    table = render_table(rows).splitlines()
    assert [line.split("|")[3].strip() for line in table[2:]] == ["–", "sublayers", "folded"]
    assert "norms" not in render_table(rows[:2]).splitlines()[0]  # no row folded: no column
    for bad in ("yes", "", "on,maybe"):
        with pytest.raises(UsageError, match="--fold-norms takes on, off"):
            _fold_norms(bad)


def test_stacked_config_gives_one_fused_row_per_form_and_launches_it(tmp_path, monkeypatch, capsys):
    """``--stacked-config off;T,W,S,R``: one fused row per form, each row's shared passes launched in its own
    form (the package's switch set while its model steps, then restored), the form in the row and the table."""
    from mhar_ablate.bench import options
    from mhar_ablate.kernels import history

    assert options.stacked_configs("off; 32,1,3,16;off") == ["off", "32,1,3,16"]
    for bad in ("on", "32,1,3", "32,1,3,8", "0,1,3,16", "a,b,c,d", ""):
        with pytest.raises(UsageError, match="--stacked-config takes off or"):
            options.stacked_configs(bad)
    variants = select_variants("mhar-block4-fused-eager", all_variants([None], [None], ["off", "4,1,1,16"]))
    assert [(v.name, v.stacked) for v in variants] == [
        ("baseline-eager", None), ("mhar-block4-fused-eager", "off"), ("mhar-block4-fused-eager", "4,1,1,16")]

    launched = []
    stacked_forward = history.shared._history_stacked_forward

    def spy(*a, **k):
        launched.append(history.HISTORY_STACKED_CONFIG)
        return stacked_forward(*a, **k)

    monkeypatch.setattr(history.shared, "_history_stacked_forward", spy)  # where history_forward calls it
    monkeypatch.setattr(history, "HISTORY_STACKED_CONFIG", None)
    out = tmp_path / "rows.json"
    # two heads of 32 channels: wide enough for the products; block:4 at tiny: shared passes over 1-2 sources
    assert cmd_bench(_args("--device", "cpu", "--preset", "tiny", "--heads", "2", "--steps", "1", "--warmup", "1",
                           "--no-split", "--variants", "mhar-block4-fused-eager", "--stacked-config", "off;4,1,1,16",
                           "--json", str(out))) == 0
    assert history.HISTORY_STACKED_CONFIG is None  # restored after each row
    assert launched and set(launched) == {(4, 1, 1, 16)}  # the second row's steps only
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["stacked_config"], r["status"]) for r in rows] == [
        ("baseline-eager", None, "ok"), ("mhar-block4-fused-eager", "off", "ok"),
        ("mhar-block4-fused-eager", "4,1,1,16", "ok")]
    table = [[c.strip() for c in line.split("|")] for line in capsys.readouterr().out.splitlines()[-5:]]
    column = table[0].index("stacked")
    assert [line[column] for line in table[2:]] == ["–", "off", "4,1,1,16"]


def test_check_runs_in_each_stacked_form_and_stops_at_a_failure(monkeypatch):
    from mhar_ablate.bench import check as bench
    from mhar_ablate.kernels import history

    seen = []

    def check(device, label=""):
        seen.append((history.HISTORY_STACKED_CONFIG, label))
        return history.HISTORY_STACKED_CONFIG != (32, 1, 3, 16)

    monkeypatch.setattr(bench, "check_fused", check)
    monkeypatch.setattr(history, "HISTORY_STACKED_CONFIG", (64, 1, 2, 16))
    variants = all_variants([None], [None], ["off", "32,1,3,16", "4,1,1,32"])
    assert not bench.check_forms(torch.device("cpu"), variants)
    assert seen == [(None, ", stacked off"), ((32, 1, 3, 16), ", stacked 32,1,3,16")]  # stopped there
    assert history.HISTORY_STACKED_CONFIG == (64, 1, 2, 16)
    seen.clear()
    assert bench.check_forms(torch.device("cpu"), all_variants([None]))  # the package's form, once
    assert seen == [((64, 1, 2, 16), "")]


def test_cuda_graph_is_refused_on_cpu():
    with pytest.raises(UsageError, match="--cuda-graph"):
        cmd_bench(_args("--device", "cpu", "--preset", "tiny", "--variants", "mhar-full-ref-eager", "--cuda-graph"))


def _row(variant, routing, compiled, cuda_graph, tokens_per_s, peak_gb=None, status="ok"):
    return {"variant": variant, "routing": routing, "compiled": compiled, "cuda_graph": cuda_graph,
            "sites_per_pass": None, "tokens_per_s": tokens_per_s, "peak_gb": peak_gb, "step_ms": None,
            "routing_ms": None, "rest_ms": None, "kernel_ms": None, "status": status}


def _graph_run():
    return [
        _row("baseline-eager", "baseline", False, False, 100.0, 2.0),
        _row("baseline-eager-graph", "baseline", False, True, 200.0, 4.0),
        _row("mhar-full-fused-eager", "mhar", False, False, 50.0, 3.0),
        _row("mhar-full-fused-eager-graph", "mhar", False, True, 150.0, 5.0),
        _row("baseline-compiled", "baseline", True, False, 250.0, 2.0),
        _row("baseline-compiled-graph", "baseline", True, True, 400.0, 2.5),
        _row("mhar-full-fused-compiled", "mhar", True, False, 125.0, 3.0),
        _row("mhar-full-fused-compiled-graph", "mhar", True, True, 300.0, 5.0),
        _row("mhar-block4-fused-compiled-graph", "mhar", True, True, None, status="out of memory"),
    ]


def test_ratios_pair_rows_by_compile_mode_and_graph():
    rows = _graph_run()
    _ratios(rows)
    by = {r["variant"]: r for r in rows}
    assert by["mhar-full-fused-eager"]["ratio_to_baseline"] == 0.5  # over baseline-eager
    assert by["mhar-full-fused-eager-graph"]["ratio_to_baseline"] == 0.75  # over baseline-eager-graph
    assert by["mhar-full-fused-eager-graph"]["peak_ratio_to_baseline"] == 1.25
    assert by["mhar-full-fused-compiled"]["ratio_to_baseline"] == 0.5  # over baseline-compiled
    assert by["mhar-full-fused-compiled-graph"]["ratio_to_baseline"] == 0.75  # over baseline-compiled-graph
    assert by["mhar-full-fused-compiled-graph"]["peak_ratio_to_baseline"] == 2.0
    # The fastest baseline of the run, whatever its mode: baseline-compiled-graph at 400 tokens/s.
    assert [r["ratio_to_fastest_baseline"] for r in rows] == [0.25, 0.5, 0.125, 0.375, 0.625, 1.0, 0.3125, 0.75, None]
    assert by["mhar-block4-fused-compiled-graph"]["ratio_to_baseline"] is None


def test_fastest_baseline_is_an_ok_row():
    rows = _graph_run()
    rows[5]["status"] = "error: RuntimeError: the loss is nan"  # baseline-compiled-graph
    _ratios(rows)
    assert rows[7]["ratio_to_fastest_baseline"] == 1.2  # mhar-full-fused-compiled-graph over baseline-compiled


def test_table_shows_the_fastest_baseline_column():
    rows = _graph_run()
    _ratios(rows)
    lines = render_table(rows).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[3:5] == ["× baseline", "× fastest baseline"]
    assert lines[1].count("---") == len(head)
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in lines[2:]}
    assert cells["mhar-full-fused-compiled-graph"][3:5] == ["0.750", "0.750"]
    assert cells["mhar-block4-fused-compiled-graph"][4] == "–"
    assert all(len(c) == len(head) for c in cells.values())


def test_graph_row_takes_the_profiled_split():
    ordinary = _row("mhar-full-fused-compiled", "mhar", True, False, 125.0)
    ordinary.update(step_ms=160.0, routing_ms=30.0, rest_ms=130.0, kernel_ms=84.0, routing_top=[["k", 20.0]],
                    top_kernels=[["gemm", 40.0], ["k", 20.0]])
    graph = _row("mhar-full-fused-compiled-graph", "mhar", True, True, 240.0)
    graph.update(step_ms=85.0, split_from=None)
    _copy_split(ordinary, graph)
    assert (graph["routing_ms"], graph["kernel_ms"], graph["rest_ms"]) == (30.0, 84.0, 55.0)
    assert graph["routing_top"] == [["k", 20.0]] and graph["split_from"] == "profiled eager-launch step"
    assert graph["top_kernels"] == [["gemm", 40.0], ["k", 20.0]]
    unsplit = _row("baseline-compiled-graph", "baseline", True, True, 400.0)
    unsplit.update(split_from=None)
    _copy_split(_row("baseline-compiled", "baseline", True, False, 250.0), unsplit)
    assert unsplit["routing_ms"] is None and unsplit["split_from"] is None


def test_profiled_step_names_its_costliest_kernels():
    """routing_time on device events: routing is what ran under a routing range; every kernel counts in the
    step's kernel time and in its top kernels, routed or not (the family's rows have only those)."""
    from types import SimpleNamespace as E

    from mhar_ablate.bench.step import routing_time
    from mhar_ablate.variants.fused import ROUTING_RANGE

    def event(name, parent, *kernels):
        return E(name=name, cpu_parent=parent, sequence_nr=-1, thread=0, fwd_thread=0,
                 kernels=[E(name=k, duration=us) for k, us in kernels])

    rng = event(ROUTING_RANGE, None)
    events = [rng, event("aten::mm", None, ("gemm", 3000.0)), event("mix", rng, ("route_fwd", 500.0)),
              event("aten::sum", None, ("reduce", 1500.0), ("gemm", 1000.0))]
    got = routing_time(events, on_device=True)
    assert got["routing_ms"] == 0.5 and got["kernel_ms"] == 6.0
    assert got["routing_top"] == [["route_fwd", 0.5]]
    assert got["top_kernels"] == [["gemm", 4.0], ["reduce", 1.5], ["route_fwd", 0.5]]


def test_rounds_time_variant_and_baseline_in_turn(monkeypatch):
    """--rounds: the pair's order alternates each round, a round's ratio is the baseline's median step over
    the variant's of that round, and the row reports the rounds' medians."""
    from mhar_ablate.bench import model as bench

    order = []
    clock = {"base": iter([10.0, 10.0, 12.0, 12.0, 11.0, 11.0]), "ours": iter([12.5, 12.5, 15.0, 15.0, 11.0, 11.0])}

    class Fake:
        def __init__(self, name):
            self.name = name

        def step(self, i):
            return torch.tensor([2.0, 1.0])

    def timed(step, first, n, device):
        name = step.__self__.name
        if first == 0:  # the untimed warm-up of each
            order.append(f"warm {name}")
            return [0.0] * n, step(first)
        order.append(name)
        return [next(clock[name]) for _ in range(n)], step(first)

    monkeypatch.setattr(bench, "timed_steps", timed)
    readings = iter([1755, 1980, 1980, 1965, 1980, 1980])  # the clock after each side's steps, in order
    monkeypatch.setattr(bench, "sm_clock_mhz", lambda device: next(readings))
    row = _row("mhar-full-fused-compiled-graph", "mhar", True, True, None)
    row["routing_ms"] = 2.0
    args = argparse.Namespace(rounds=3, steps=2, warmup=1)
    bench.interleave(Fake("base"), {"variant": "baseline-compiled-graph"}, Fake("ours"), row, args, 1000,
                     torch.device("cpu"))
    assert order == ["warm base", "warm ours", "ours", "base", "base", "ours", "ours", "base"]
    # [variant's, baseline's] a round, whichever side ran first
    assert row["round_clocks_mhz"] == [[1755, 1980], [1965, 1980], [1980, 1980]]
    assert row["round_ratios"] == [0.8, 0.8, 1.0] and row["rounds"] == 3
    assert row["step_ms"] == 12.5 and row["baseline_step_ms"] == 11.0 and row["rest_ms"] == 10.5
    base = _row("baseline-compiled-graph", "baseline", True, True, 80_000.0)
    rows = [base, row]
    _ratios(rows)
    assert row["ratio_to_baseline"] == 0.8  # the rounds' median, not the rows' tokens/s
    assert row["ratio_to_fastest_baseline"] == 0.8  # through its baseline, the fastest here
    assert "0.800 (0.800–1.000, 3 rounds)" in render_table(rows)


def test_cpu_smoke_run_with_rounds(tmp_path):
    out = tmp_path / "rows.json"
    assert cmd_bench(_args("--device", "cpu", "--preset", "tiny", "--steps", "1", "--warmup", "1", "--rounds", "2",
                           "--no-split", "--variants", "mhar-full-ref-eager", "--json", str(out))) == 0
    base, routed = json.loads(out.read_text())
    assert "rounds" not in base and routed["rounds"] == 2 and len(routed["round_ratios"]) == 2
    assert routed["baseline_variant"] == "baseline-eager" and routed["status"] == "ok"
    assert "round_clocks_mhz" not in routed  # no clocks to read off a GPU
    with pytest.raises(UsageError, match="--rounds"):
        cmd_bench(_args("--device", "cpu", "--preset", "tiny", "--rounds", "0"))


def test_failed_rounds_keep_the_row(tmp_path, monkeypatch):
    """Rounds that fail leave the variant's own measurement in place, the reason beside it."""
    from mhar_ablate.bench import model as bench

    def broken(*a):
        raise RuntimeError("the card went away")

    monkeypatch.setattr(bench, "interleave", broken)
    out = tmp_path / "rows.json"
    assert cmd_bench(_args("--device", "cpu", "--preset", "tiny", "--steps", "1", "--warmup", "1", "--rounds", "2",
                           "--no-split", "--variants", "mhar-full-ref-eager", "--json", str(out))) == 0
    routed = json.loads(out.read_text())[1]
    assert routed["status"] == "ok" and routed["tokens_per_s"] > 0
    assert routed["rounds_status"] == "error: RuntimeError: the card went away" and "round_ratios" not in routed
