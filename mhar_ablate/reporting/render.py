"""The ablation table as text: Markdown, LaTeX, CSV or JSON, with the notes a reader needs under it (the
schedule caveat, shared devices, the target of the time-to-target columns).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from typing import Any

from ..config import format_flops
from ..errors import UsageError
from .table import fmt_time, SHARED_COLUMNS, StudyTable


FORMATS = ("md", "latex", "csv", "json")
EXT = {"md": "md", "latex": "tex", "csv": "csv", "json": "json"}

# --------------------------------------------------------------------------- rendering

HEADERS = ["arm", "n", "val loss @ {steps} steps", "Δ vs baseline", "val loss @ {time}", "Δ vs baseline",
           "val loss @ {flops}", "Δ vs baseline", "throughput vs baseline", "peak mem (GB)", "params Δ"]


def _cells(table: StudyTable, row: dict[str, Any], bold) -> list[str]:
    def loss(col):
        if col not in row:
            return "–"
        m, s = row[col]
        text = f"{m:.4f} ± {s:.4f}"
        return bold(text) if row.get(f"best_{col}") else text

    def delta(col):
        d = row.get(col)
        if d is None:
            if row.get("start"):
                return "(start)"
            return "–" if row["arm"] != table.baseline else "(baseline)"
        m, half, n = d
        return f"{m:+.4f}" + (f" [{m - half:+.4f}, {m + half:+.4f}]" if not math.isnan(half) else " (n=1)")

    tvb = row.get("throughput_vs_baseline")
    mem = row.get("peak_mem_gb")
    pct = row.get("param_overhead_pct")
    n = f"{row['n']}" + (f" (+{row['diverged']} diverged)" if row["diverged"] else "") + (
        f" (+{row['pruned']} pruned)" if row["pruned"] else "")
    return [row["arm"], n, loss("loss_at_steps"), delta("delta_at_steps"), loss("loss_at_time"), delta("delta_at_time"),
            loss("loss_at_flops"), delta("delta_at_flops"), f"{tvb:.2f}×" if tvb else "–", f"{mem:.1f}" if mem else "–",
            f"{pct:+.3f} %" if pct is not None else "–"]


FINAL_HEADERS = ["arm", "n", "final-set loss", "eval SE", "Δ vs baseline", "eval SE of Δ", "steps to target",
                 "time to target", "speed-up (steps)", "speed-up (time)"]


def _final_cells(table: StudyTable, row: dict[str, Any], bold) -> list[str]:
    """The cells of the final-evaluation and time-to-target table (``FINAL_HEADERS``); – where a run
    has no final evaluation (recorded before it existed) or an arm has no such value."""
    baseline = row["arm"] == table.baseline

    def loss():
        if "final_loss" not in row:
            return "–"
        m, s = row["final_loss"]
        text = f"{m:.4f} ± {s:.4f}"
        return bold(text) if row.get("best_final_loss") else text

    def se(key):
        v = row.get(key)
        if v is not None:
            return f"{v:.4f}"
        return "(baseline)" if baseline and key == "delta_final_se" and "final_loss" in row else "–"

    def delta():
        d = row.get("delta_final")
        if d is None:
            return "(baseline)" if baseline and "final_loss" in row else "–"
        m, half, _ = d
        return f"{m:+.4f}" + (f" [{m - half:+.4f}, {m + half:+.4f}]" if not math.isnan(half) else " (n=1)")

    def reached(value, fmt):
        runs, hit = row.get("target_runs", 0), row.get("target_reached", 0)
        if not runs:
            return "–"
        if not hit:
            return "not reached"
        return fmt(value) + (f" ({hit}/{runs} reached)" if hit < runs else "")

    def speed(key):
        v = row.get(key)
        if v is None:
            return "(baseline)" if baseline and row.get("target_runs") else "–"
        m, lo, hi, _ = v
        return f"{m:.2f}×" + (f" [{lo:.2f}, {hi:.2f}]" if not math.isnan(lo) else " (n=1)")

    n = row.get("final_n", 0)
    return [row["arm"], f"{n}" if n else "–", loss(), se("final_se"), delta(), se("delta_final_se"),
            reached(row.get("steps_to_target"), lambda v: f"{v:.0f}"),
            reached(row.get("seconds_to_target"), fmt_time), speed("speedup_steps"), speed("speedup_time")]


def target_text(table: StudyTable) -> str:
    """What the time-to-target columns aim at, in words."""
    t = table.target
    if not t or t.get("loss") is None:
        return "Time to target: no baseline arm to take a target from (name one with --target-loss)."
    if t["kind"] == "loss":
        return f"Target: validation loss {t['loss']:.4f} (--target-loss), for every run."
    return (f"Target: each seed's baseline final validation loss (mean {t['loss']:.4f}), so the baseline's own time to "
            "target is its budget.")


FINAL_NOTE = ("Final-set loss: one evaluation at each run's end on {sequences} held-out sequences, the same for every "
              "arm and seed; mean ± std over seeds. eval SE: a run's standard error from its per-sequence losses "
              "(root mean square over seeds), to set beside the std over seeds; eval SE of Δ: the same for the "
              "per-sequence differences to the baseline run of the seed (the evaluation's share of Δ's noise). "
              "Steps and time to target: first reached on the validation curve, linear between evaluations, mean "
              "over the runs that reached it (never extrapolated). Speed-up: baseline's steps (time) to target / "
              "the arm's, paired by seed; geometric mean with a 95 % t-interval on the logarithms.")


def _final_note(table: StudyTable) -> str:
    counts = sorted({r["final_sequences"] for r in table.rows if r.get("final_sequences")})
    what = "/".join(f"{c:,}" for c in counts) if counts else "the"
    return FINAL_NOTE.format(sequences=what)


class _Bold(str):
    """A cell to set in bold; each format escapes it first and then marks it."""


def _extra_cells(table: StudyTable, row: dict[str, Any], bold) -> list[str]:
    cells = []
    for col in table.extra:
        v = col.values.get(row["arm"])
        if v is None:
            cells.append("–")
            continue
        text = f"{v[0]:.4f} ± {v[1]:.4f}" + (f" (n={v[2]})" if v[2] != row["n"] else "")
        means = [m for m, _, _ in col.values.values()]
        best = None if col.higher_is_better is None or len(means) < 2 else (max if col.higher_is_better else min)(means)
        cells.append(bold(text) if best is not None and v[0] == best else text)
    return cells


# LaTeX's special characters, and the table's non-ASCII symbols in their math forms, in one pass.
_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
          "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "×": r"$\times$",
          "Δ": r"$\Delta$", "–": "--", "†": r"$^\dagger$"}
_LATEX_RE = re.compile("|".join(re.escape(c) for c in _LATEX))


def latex_escape(text: str) -> str:
    return _LATEX_RE.sub(lambda m: _LATEX[m.group(0)], text)


def _flops_label(table: StudyTable) -> str:
    return format_flops(table.at_flops) if table.at_flops is not None else "equal FLOPs"


def _headers(table: StudyTable) -> list[str]:
    heads = [h.format(steps=int(table.at_step), time=fmt_time(table.at_seconds), flops=_flops_label(table))
             for h in HEADERS]
    heads = [h + " †" if table.shared_device and i in SHARED_COLUMNS else h for i, h in enumerate(heads)]
    return heads + [c.header for c in table.extra]


def schedule_note(table: StudyTable) -> str | None:
    """Under a time or FLOPs budget every run's learning-rate schedule spans its own budget, so at equal
    steps the arms are at different points of their schedules: say so beside the equal-steps column."""
    if table.budget == "steps":
        return None
    columns = "equal-steps column favours" if table.budget == "flops" else "equal-steps and equal-FLOPs columns favour"
    return (f"Equal steps under the {table.budget} budget: every run's learning-rate schedule spans its own "
            f"budget, so at {int(table.at_step)} steps an arm that trains more steps in the budget is earlier in "
            f"its schedule (its learning rate not yet annealed) than one that trains fewer; the {columns} the "
            "slower arms. The same study under --budget steps compares arms at equal steps on equal schedules.")


def render(table: StudyTable, fmt: str) -> str:
    if fmt == "md":
        head = _headers(table)
        lines = [f"### {table.name} ({table.budget} budget)", "", table.description, "",
                 "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        md = lambda c: (f"**{c}**" if isinstance(c, _Bold) else c).replace("|", r"\|")
        lines += ["| " + " | ".join(md(c) for c in _cells(table, r, _Bold) + _extra_cells(table, r, _Bold)) + " |"
                  for r in table.rows]
        lines += ["", "Mean ± std over seeds; Δ is the paired difference to the baseline arm with its 95 % "
                  "t-interval over seeds; bold marks the lowest loss in a column."]
        note = schedule_note(table)
        if note:
            lines.append(note)
        if table.at_flops is not None:
            lines.append("FLOPs are the theoretical training count per token (matrix multiplies, attention and the "
                         "routing's own term; README, \"Training FLOPs\") times the tokens trained.")
        if any(r.get("start") for r in table.rows):
            lines.append(f"Continued pretraining: Δ is the gain over plain continued training (the {table.baseline} arm: "
                         "same start, data order, schedule and batches), not over the start; the start row is the "
                         "source checkpoint's validation loss before either continuation.")
        if table.extra:
            lines.append("Task columns (`mhar-ablate eval`): mean ± std over each arm's evaluated seeds (n= where fewer "
                         "seeds have results); bold marks the better end.")
        if table.backend_note:
            lines.append(table.backend_note)
        if table.missing:
            lines.append(f"Missing trials: {', '.join(table.missing)}.")
        lines += ["", "#### Final evaluation and time to target", "", target_text(table), "",
                  "| " + " | ".join(FINAL_HEADERS) + " |", "|" + "|".join("---" for _ in FINAL_HEADERS) + "|"]
        lines += ["| " + " | ".join(md(c) for c in _final_cells(table, r, _Bold)) + " |" for r in table.rows
                  if not r.get("start")]
        lines += ["", _final_note(table)]
        lines += _warning_lines(table)
        return "\n".join(lines) + "\n"
    if fmt == "latex":
        esc = latex_escape
        cell = lambda c: r"\textbf{" + esc(c) + "}" if isinstance(c, _Bold) else esc(c)
        head = [esc(h) for h in _headers(table)]
        lines = [r"\begin{table}[t]", r"\centering", r"\small", r"\begin{tabular}{l" + "r" * (len(head) - 1) + "}",
                 r"\toprule", " & ".join(head) + r" \\", r"\midrule"]
        lines += [" & ".join(cell(c) for c in _cells(table, r, _Bold) + _extra_cells(table, r, _Bold)) + r" \\"
                  for r in table.rows]
        lines += [r"\bottomrule", r"\end{tabular}",
                  r"\caption{" + esc(f"{table.name}, {table.budget} budget. Mean ± std over seeds; Δ: paired difference "
                                     "to the baseline with a 95 % t-interval; bold: lowest loss. "
                                     + (schedule_note(table) or "")).rstrip() + "}", r"\end{table}"]
        fhead = [esc(h) for h in FINAL_HEADERS]
        lines += ["", r"\begin{table}[t]", r"\centering", r"\small", r"\begin{tabular}{l" + "r" * (len(fhead) - 1) + "}",
                  r"\toprule", " & ".join(fhead) + r" \\", r"\midrule"]
        lines += [" & ".join(cell(c) for c in _final_cells(table, r, _Bold)) + r" \\" for r in table.rows
                  if not r.get("start")]
        lines += [r"\bottomrule", r"\end{tabular}",
                  r"\caption{" + esc(f"{table.name}, {table.budget} budget: final evaluation and time to target. "
                                     f"{target_text(table)} {_final_note(table)}") + "}", r"\end{table}"]
        if table.warnings:  # visible under the tables, not a comment
            lines += ["", r"\noindent\textbf{Timing warning} (the time and throughput columns may not measure the "
                      "arms): " + "; ".join(latex_escape(w) for w in table.warnings) + "."]
        return "\n".join(lines) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["arm", "n", "diverged", "loss_at_steps_mean", "loss_at_steps_std", "delta_at_steps", "delta_at_steps_ci95",
                    "loss_at_time_mean", "loss_at_time_std", "delta_at_time", "delta_at_time_ci95", "throughput_vs_baseline",
                    "tokens_per_s", "peak_mem_gb", "param_overhead_pct", "best_at_steps", "best_at_time", "at_step", "at_seconds",
                    "shared_device", "loss_at_flops_mean", "loss_at_flops_std", "delta_at_flops", "delta_at_flops_ci95",
                    "best_at_flops", "at_flops", *(f"{c.key}_{part}" for c in table.extra for part in ("mean", "std", "n")),
                    *FINAL_CSV, "timing_warning"])
        for r in table.rows:
            ls, lt = r.get("loss_at_steps", (None, None)), r.get("loss_at_time", (None, None))
            ds, dt = r.get("delta_at_steps") or (None, None, 0), r.get("delta_at_time") or (None, None, 0)
            lf, df = r.get("loss_at_flops", (None, None)), r.get("delta_at_flops") or (None, None, 0)
            w.writerow([r["arm"], r["n"], r["diverged"], *ls, ds[0], ds[1], *lt, dt[0], dt[1], r.get("throughput_vs_baseline"),
                        r.get("tokens_per_s"), r.get("peak_mem_gb"), r.get("param_overhead_pct"),
                        r.get("best_loss_at_steps", False), r.get("best_loss_at_time", False), table.at_step, table.at_seconds,
                        table.shared_device, *lf, df[0], df[1], r.get("best_loss_at_flops", False), table.at_flops,
                        *(x for c in table.extra for x in c.values.get(r["arm"], (None, None, 0))), *_final_csv(table, r),
                        r.get("timing_warning", "")])
        return buf.getvalue()
    if fmt == "json":
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, (list, tuple)):
                return [clean(x) for x in v]
            return v
        return json.dumps({"study": table.name, "budget": table.budget, "description": table.description,
                           "baseline": table.baseline, "at_step": table.at_step, "at_seconds": table.at_seconds,
                           "at_flops": table.at_flops,
                           "missing": table.missing, "note": table.backend_note, "shared_device": table.shared_device,
                           "timing_warnings": table.warnings,
                           "extra_columns": [{"header": c.header, "key": c.key, "higher_is_better": c.higher_is_better}
                                             for c in table.extra],
                           "target": {k: clean(v) if not isinstance(v, dict) else {str(s): x for s, x in v.items()}
                                      for k, v in table.target.items()},
                           "rows": [{**{k: clean(v) for k, v in r.items()},
                                     **{c.key: clean(c.values.get(r["arm"])) for c in table.extra}}
                                    for r in table.rows]}, indent=2) + "\n"
    raise UsageError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")


def _warning_lines(table: StudyTable) -> list[str]:
    """The timing warnings under a table (table.timing_warnings), after a blank line; none: nothing."""
    if not table.warnings:
        return []
    return ["", "**Timing warning** (the time and throughput columns may not measure the arms):",
            *(f"- {w}." for w in table.warnings)]


FINAL_CSV = ["final_n", "final_loss_mean", "final_loss_std", "final_se", "final_sequences", "delta_final",
             "delta_final_ci95", "delta_final_se", "target_loss", "target_runs", "target_reached", "steps_to_target",
             "seconds_to_target", "speedup_steps", "speedup_steps_lo", "speedup_steps_hi", "speedup_time",
             "speedup_time_lo", "speedup_time_hi"]


def _final_csv(table: StudyTable, r: dict[str, Any]) -> list[Any]:
    """The ``FINAL_CSV`` columns of a row (empty where there is no value)."""
    fl = r.get("final_loss", (None, None))
    df = r.get("delta_final") or (None, None, 0)
    ss, st = r.get("speedup_steps") or (None,) * 4, r.get("speedup_time") or (None,) * 4
    return [r.get("final_n"), *fl, r.get("final_se"), r.get("final_sequences"), df[0], df[1], r.get("delta_final_se"),
            (table.target or {}).get("loss"), r.get("target_runs"), r.get("target_reached"), r.get("steps_to_target"),
            r.get("seconds_to_target"), *ss[:3], *st[:3]]


