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
from mhar_ablate.config import build_config
from mhar_ablate.training.run import train_run

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
    root = Path(__file__).resolve().parents[1] / "mhar_ablate"
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(p.read_text() for p in sorted(root.rglob("*.py"))))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(output folder, run folder) of a tiny MHAR run trained a few steps on this package's source."""
    tmp = tmp_path_factory.mktemp("eval")
    out = tmp / "out"
    cfg = build_config(overrides={**FAST, "data.source": str(corpus(tmp)), "residual.kind": "mhar",
                                  "residual.heads": "2", "train.steps": "4"})
    assert train_run(cfg, out / "runs" / "mhar", out / "cache", log=lambda s: None)["status"] == "completed"
    return out, out / "runs" / "mhar"


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
    assert run.step == 4 and run.status == "completed" and not run.model.training
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
    assert data["model"]["step"] == 4 and data["model"]["arm"] == "mhar-h2" and data["lm_eval_version"]
    assert data["harness"]["n-samples"]["tiny_mc"]["effective"] == 4 and "configs" in data["harness"]
    assert "| tiny_mc | acc |" in printed.out and "tiny_mc.json" in printed.err

    assert main(argv) == 0  # the same settings at the same step: read back, not evaluated again
    assert "already evaluated" in capsys.readouterr().err


def one_error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


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
    assert "--limit must be at least 1" in one_error(capsys, ["eval", str(run_dir), "--tasks", "x", "--limit", "0", *base])
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as if the extra were not installed
    assert "pip install 'mhar-ablate[eval]'" in one_error(capsys, ["eval", str(run_dir), "--tasks", "x", *base])


def test_a_run_without_weights_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    run_dir = out / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("seed: 0\n")
    err = one_error(capsys, ["eval", str(run_dir), "--tasks", "x", "--output", str(out)])
    assert "has no weights" in err and "--keep-checkpoints" in err
