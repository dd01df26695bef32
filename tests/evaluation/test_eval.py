"""``mhar-ablate eval``: lm-evaluation-harness on trained runs through ``RunLM``, with a task built from a few
local examples. The adapter's log-likelihoods are checked against the decoder's own forward, the harness's
accuracy against choices scored directly, and a study's export against its runs' results."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mhar_ablate.cli import main

from cli_helpers import one_error

if os.environ.get("CI") == "true":
    import lm_eval  # noqa: F401  (CI installs the test extra, which has it: a missing one is a failure)
else:
    pytest.importorskip("lm_eval")

SEQ = 32
FAST = {"model.seq_len": str(SEQ), "train.batch_size": "4", "train.eval_every": "2", "train.eval_batches": "1",
        "data.val_sequences": "4", "residual.backend": "reference", "train.threads": "2"}
# Multiple choice over Python: the right continuation is what the code says next.
EXAMPLES = [
    {"question": "def add(a, b):\n    return a +", "choices": ["b", "class", "]"], "label": 0},
    {"question": "import", "choices": ["os", ")", "=="], "label": 0},
    {"question": "for i in range(10):\n    print(", "choices": ["i)", "def", "}"], "label": 0},
    {"question": "if x is None:\n    return", "choices": ["None", "import", "(("], "label": 0},
]


def corpus(tmp_path: Path) -> Path:
    root = Path(__file__).resolve().parents[2] / "mhar_ablate"
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(p.read_text() for p in sorted(root.rglob("*.py"))))
    return path


STUDY = ("description: one routed arm\nfixed: {model.preset: tiny}\narms:\n  mhar-h2: {residual.kind: mhar, residual.heads: 2}\n"
         "seeds: 2\nbudgets: {steps: 2}\n")


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, Path, object]:
    """(output folder, study file, StudyRun) of a tiny MHAR study, 2 seeds trained 2 steps each on this
    package's source, run as a user runs it: finished trials keep their weights, not their checkpoints."""
    from mhar_ablate.sweep.definition import StudyDefinition, StudyRun
    from mhar_ablate.sweep.driver import run_study

    tmp = tmp_path_factory.mktemp("eval")
    path = tmp / "pair.yaml"
    path.write_text(STUDY)
    out = tmp / "out"
    sr = StudyRun(StudyDefinition.load(str(path)), "steps", out, {**FAST, "data.source": str(corpus(tmp))}, seeds=2)
    assert run_study(sr, log=lambda s: None)["done"] == 2
    return out, path, sr


@pytest.fixture
def trained(study) -> tuple[Path, Path]:
    """(output folder, run folder) of one trained run."""
    out, _, sr = study
    return out, sr.run_dir("mhar-h2", 0)


def task_folder(tmp_path: Path, name: str = "tiny_mc", data: Path | None = None) -> Path:
    """A folder with one multiple-choice task YAML over a local JSON-lines file (the harness's own format)."""
    folder = tmp_path / "tasks"
    folder.mkdir(exist_ok=True)
    if data is None:
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {tmp_path / 'hf-datasets'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


def direct_loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log P(continuation | context) from one unpadded forward over the last seq_len tokens."""
    whole = (context + continuation)[-(SEQ + 1):]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), dim=-1)
    span = logp[len(whole) - 1 - len(continuation):]
    target = torch.tensor(continuation)
    return float(span.gather(-1, target[:, None]).sum()), bool((span.argmax(-1) == target).all())


def instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_adapter_scores_what_the_decoder_computes(trained):
    from mhar_ablate.evaluation.harness import RunLM
    from mhar_ablate.evaluation.trained import load_trained

    out, run_dir = trained
    run = load_trained(run_dir, out / "cache")
    assert run.step == 2 and run.status == "completed" and not run.model.training
    lm = RunLM(run, batch_size=3, progress=False)
    enc = run.tokenizer.encode
    long_context = "def f(x):\n    return x * 2\n" * 3  # 84 bytes: cut from the left to the last seq_len tokens
    pairs = [("import", " os"), ("x = ", "1"), (long_context, "print(f(2))"), ("", "def g():"), ("a, b", " = b, a")]
    got = lm.loglikelihood(instances("loglikelihood", pairs))
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        # The harness moves a context's trailing spaces into the continuation; an empty context is EOS.
        n = len(ctx) - len(ctx.rstrip())
        ctx, cont = ctx[:len(ctx) - n], ctx[len(ctx) - n:] + cont
        want_ll, want_greedy = direct_loglikelihood(run.model, enc(ctx) or [run.tokenizer.eos_id], enc(cont))
        assert ll == pytest.approx(want_ll, abs=1e-4) and greedy == want_greedy
    assert all(ll < 0 for ll, _ in got)

    # What greedy decoding produces is greedy by the adapter's account, and generate_until produces it.
    context = enc("def add(a, b):")
    ids = list(context)
    for _ in range(6):
        with torch.no_grad():
            ids.append(int(run.model(torch.tensor([ids[-SEQ:]]))[0, -1].argmax()))
    greedy_text = run.tokenizer.decode(ids[len(context):])
    [(_, is_greedy)] = lm.loglikelihood(instances("loglikelihood", [("def add(a, b):", greedy_text)]))
    assert is_greedy
    [generated] = lm.generate_until(instances("generate_until", [("def add(a, b):", {"max_gen_toks": 6})]))
    assert generated == greedy_text

    # A document longer than seq_len: each token once, over the harness's disjoint windows, the first after EOS.
    text = (long_context * 2)[:75]
    [rolling] = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]))
    tokens = enc(text)
    want = sum(direct_loglikelihood(run.model, ([run.tokenizer.eos_id] + tokens)[max(0, i + 1 - SEQ): i + 1], [tokens[i]])[0]
               for i in range(SEQ))  # the first window: every token with all of its context
    from lm_eval import utils as lm_utils

    windows = list(map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
        token_list=tokens, prefix_token=run.tokenizer.eos_id, max_seq_len=SEQ, context_len=1)))
    assert sum(len(c) for _, c in windows) == len(tokens) and len(windows) == 3
    want += sum(direct_loglikelihood(run.model, ctx, cont)[0] for ctx, cont in windows[1:])
    assert rolling == pytest.approx(want, abs=1e-3)


def test_cli_eval_writes_the_harness_results_and_reuses_them(trained, tmp_path, capsys):
    from mhar_ablate.evaluation.trained import load_trained

    out, run_dir = trained
    tasks = task_folder(tmp_path)
    argv = ["eval", str(run_dir), "--tasks", "tiny_mc", "--include", str(tasks), "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr()
    data = json.loads((run_dir / "eval" / "tiny_mc.json").read_text())
    acc = data["harness"]["results"]["tiny_mc"]["acc,none"]
    # The harness's accuracy is the share of examples whose label has the highest log-likelihood.
    run = load_trained(run_dir, out / "cache")
    enc = run.tokenizer.encode
    right = [max(range(3), key=lambda c: direct_loglikelihood(run.model, enc(e["question"]), enc(" " + e["choices"][c]))[0])
             == e["label"] for e in EXAMPLES]
    assert acc == pytest.approx(sum(right) / len(right))
    assert data["model"]["step"] == 2 and data["model"]["arm"] == "mhar-h2" and data["lm_eval_version"]
    assert data["harness"]["n-samples"]["tiny_mc"]["effective"] == 4 and "configs" in data["harness"]
    assert "| tiny_mc | acc |" in printed.out and "tiny_mc.json" in printed.err

    assert main(argv) == 0  # the same settings at the same step: read back, not evaluated again
    assert "already evaluated" in capsys.readouterr().err


def test_bad_input_is_one_line(trained, tmp_path, capsys, monkeypatch):
    out, run_dir = trained
    base = ["--output", str(out)]
    missing = task_folder(tmp_path, "tiny_gone", data=tmp_path / "nowhere.jsonl")
    err = one_error(capsys, ["eval", str(run_dir), "--tasks", "tiny_gone", "--include", str(missing), *base])
    assert "task data not on this machine" in err and "nowhere.jsonl" in err
    assert not (run_dir / "eval" / "tiny_gone.json").exists()
    assert "unknown task 'no_such_task'" in one_error(capsys, ["eval", str(run_dir), "--tasks", "no_such_task",
                                                               "--include", str(missing), *base])
    assert "no run 'nope'" in one_error(capsys, ["eval", "nope", "--tasks", "tiny_gone", *base])
    assert "one RUN or --study" in one_error(capsys, ["eval", "--tasks", "x", *base])
    assert "--include" in one_error(capsys, ["eval", str(run_dir), "--tasks", "t.yaml", *base])
    assert "--limit must be at least 1" in one_error(capsys, ["eval", str(run_dir), "--tasks", "x", "--limit", "0", *base])
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as if the extra were not installed
    assert "pip install 'mhar-ablate[eval]'" in one_error(capsys, ["eval", str(run_dir), "--tasks", "x", *base])


def test_a_finished_study_trial_keeps_the_weights_it_trained(study, tmp_path):
    """A study drops a finished trial's checkpoint but keeps its decoder weights, exactly, with their step."""
    from mhar_ablate.evaluation.trained import load_trained
    from mhar_ablate.sweep.trials import drop_checkpoints
    from mhar_ablate.training.checkpoint import CHECKPOINT
    from mhar_ablate.model.weights import read_checkpoint

    out, _, sr = study
    run_dir = sr.run_dir("mhar-h2", 0)
    assert not (run_dir / "checkpoints").exists() and (run_dir / "weights.safetensors").is_file()
    # readable by whoever reads the results (safetensors alone writes owner-only files)
    assert (run_dir / "weights.safetensors").stat().st_mode & 0o777 == (run_dir / "result.json").stat().st_mode & 0o777
    assert load_trained(run_dir, out / "cache").step == json.loads((run_dir / "result.json").read_text())["step"]

    assert main(["train", "--budget", "steps", "--steps", "3", "--preset", "tiny", "--output", str(tmp_path),
                 *(f"{k}={v}" for k, v in {**FAST, "data.source": str(corpus(tmp_path))}.items())]) == 0
    [one] = list((tmp_path / "runs").iterdir())
    ckpt = read_checkpoint(one / CHECKPOINT)
    drop_checkpoints(one)
    kept = load_trained(one, tmp_path / "cache")
    assert kept.step == ckpt["global_step"] == 3
    for name, value in kept.model.state_dict().items():
        assert torch.equal(value, ckpt["state_dict"][f"model.{name}"]), name


def test_a_run_without_weights_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    run_dir = out / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("seed: 0\n")
    err = one_error(capsys, ["eval", str(run_dir), "--tasks", "x", "--output", str(out)])
    assert "has no weights" in err and "--keep-checkpoints" in err


def test_study_eval_adds_mean_and_spread_over_seeds_to_the_export(study, tmp_path, capsys):
    import shutil
    import statistics

    out, path, sr = study
    tasks = task_folder(tmp_path)
    capsys.readouterr()
    assert main(["eval", "--study", str(path), "--tasks", "tiny_mc", "--include", str(tasks), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    accs = [json.loads((sr.run_dir("mhar-h2", seed) / "eval" / "tiny_mc.json").read_text())
            ["harness"]["results"]["tiny_mc"]["acc,none"] for seed in (0, 1)]
    assert "| tiny_mc acc |" in printed

    assert main(["export", str(path), "--format", "json", "--output", str(out)]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [c["header"] for c in table["extra_columns"]] == ["tiny_mc acc"]
    [row] = table["rows"]
    assert row["eval_tiny_mc_acc"] == pytest.approx([statistics.fmean(accs), statistics.stdev(accs), 2])

    # Without weights (a study of an earlier version, which kept none) nothing is evaluated, and one line says why.
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / sr.run_dir("mhar-h2", 1).relative_to(out) / "weights.safetensors").unlink()
    err = one_error(capsys, ["eval", "--study", str(path), "--tasks", "tiny_mc", "--include", str(tasks),
                             "--output", str(copy), "--force"])
    assert "1 of the 2 finished runs" in err and "--keep-checkpoints" in err


def test_export_columns_from_the_runs_eval_files(tmp_path):
    """Per arm and task metric: mean ± std over the seeds that have results, the latest evaluation of a
    run winning, other shot counts apart, bold where the harness says which end is better."""
    from mhar_ablate.reporting.eval_columns import add_eval_columns
    from mhar_ablate.reporting.table import StudyTable, TrialData
    from mhar_ablate.reporting.render import render

    def trial(arm, seed):
        return TrialData(arm, seed, "completed", [(0, 0, 0, 5.0), (10, 1, 100, 4.0)], 1.0, None, 10, 0.0, "cpu", "")

    def write(arm, seed, name, acc, at, shots=0):
        harness = {"results": {"mc": {"alias": "mc", "acc,none": acc, "acc_stderr,none": 0.1, "sample_len": 4}},
                   "n-shot": {"mc": shots}, "higher_is_better": {"mc": {"acc": True}}, "n-samples": {"mc": {"effective": 4}}}
        f = tmp_path / f"{arm}-s{seed}" / "eval" / f"{name}.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"harness": harness, "settings": {"limit": None}, "evaluated_at": at}))

    trials = {"base": [trial("base", 0), trial("base", 1)], "mhar-h4": [trial("mhar-h4", 0), trial("mhar-h4", 1)]}
    write("base", 0, "a", 0.50, 1.0)
    write("base", 1, "a", 0.10, 1.0)
    write("base", 1, "b", 0.70, 2.0)  # evaluated again later: this one counts
    write("mhar-h4", 0, "a", 0.90, 1.0)  # seed 1 not evaluated: n=1
    write("mhar-h4", 0, "five", 0.30, 1.0, shots=5)
    table = StudyTable("s", "steps", "", "base", 10, 1, [{"arm": a, "n": 2, "diverged": 0, "pruned": 0} for a in trials],
                       [], trials)
    add_eval_columns(table, tmp_path)
    assert [c.header for c in table.extra] == ["mc acc", "mc acc 5-shot"]
    acc = table.extra[0].values
    assert acc["base"] == pytest.approx((0.6, 0.1 * 2 ** 0.5, 2)) and acc["mhar-h4"] == (0.9, 0.0, 1)
    md = render(table, "md")
    assert "| **0.9000 ± 0.0000 (n=1)** |" in md and "| 0.6000 ± 0.1414 | – |" in md
    assert "mc acc 5-shot" in render(table, "latex")
