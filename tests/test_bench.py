"""``bench model``: refuses without a GPU, and its CPU smoke mode runs end to end (tiny preset, 2 steps)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mhar_ablate.bench import add_bench_parser, all_variants, cmd_bench, select_variants
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
    assert rows[0]["ratio_to_baseline"] == 1.0 and rows[1]["routing_ms"] is not None
    assert "| mhar-full-ref-eager |" in capsys.readouterr().out.splitlines()[-1]


def test_variant_selection():
    variants = all_variants([None])
    names = [v.name for v in select_variants("mhar-*-fused-compiled", variants)]
    assert names == ["baseline-compiled", "mhar-full-fused-compiled", "mhar-block4-fused-compiled"]
    with pytest.raises(UsageError, match="matches no variant"):
        select_variants("hyper-*", variants)
    with pytest.raises(UsageError, match="--device cpu runs eager variants only"):
        cmd_bench(_args("--device", "cpu", "--preset", "tiny", "--variants", "*-compiled"))
