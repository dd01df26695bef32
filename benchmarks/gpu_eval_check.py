"""GPU check of `mhar-ablate eval`'s adapter (evaluation/harness.py): on CUDA the decoder runs under the run's
bf16 autocast with the fused routing path; do its log-likelihoods agree with the float32 CPU reference, how
fast does it score, and does the harness run end to end on the GPU?

Stages:
1. Train one MHAR run (``--preset``, ``--steps``, default corpus) into ``$OUT/run`` with its checkpoint.
2. The same 256 (context, continuation) requests from the corpus's validation text through ``RunLM`` on
   ``--device`` and on the CPU in float32: max |diff| of the summed log-likelihoods, relative to their
   size, and agreement of the greedy flags.
3. Scoring speed on ``--device`` at batch sizes 8, 32, 128 (requests/s and scored tokens/s).
4. ``simple_evaluate`` on a local multiple-choice task built from the validation text (which of 4
   snippets follows a context: chance is 0.25), on ``--device``.

Needs lm-eval on the machine (the package's ``eval`` extra). Usage (the package on PYTHONPATH):
    python benchmarks/gpu_eval_check.py --out $OUT                 # small preset, 200 steps: about 2 min on an H200
    python benchmarks/gpu_eval_check.py --out /tmp/x --device cpu --preset tiny --steps 4 --requests 16   # CPU smoke
The table is printed last; everything is also in $OUT/eval_check.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--requests", type=int, default=256)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from lm_eval.api.instance import Instance

    from mhar_ablate.config import build_config
    from mhar_ablate.data import load_corpus
    from mhar_ablate.evaluation.harness import RunLM
    from mhar_ablate.evaluation.tasks import evaluate_run, metric_rows, task_manager
    from mhar_ablate.evaluation.trained import load_trained
    from mhar_ablate.training.run import autocast_for, train_run

    rows: dict[str, object] = {"device": args.device, "preset": args.preset, "steps": args.steps}
    cfg = build_config(overrides={"model.preset": args.preset, "residual.kind": "mhar", "residual.heads": "4",
                                  "train.steps": str(args.steps)})
    run_dir, cache = out / "run", out / "cache"
    t = time.time()
    result = train_run(cfg, run_dir, cache, resume=True, log=lambda s: None)
    rows["train_seconds"] = round(time.time() - t, 1)
    rows["final_val_loss"] = result["final_val_loss"]

    corpus = load_corpus(cfg.data, cache)
    text = corpus.tokenizer.decode(corpus.val[: 400_000].tolist())
    rng = random.Random(0)
    seq = cfg.model.seq_len

    def snippet(n: int) -> str:
        i = rng.randrange(0, len(text) - n)
        return text[i: i + n]

    pairs = []
    for _ in range(args.requests):
        s = snippet(rng.randrange(seq // 4, 2 * seq))  # some longer than seq_len: cut from the left
        cut = rng.randrange(len(s) // 2, len(s) - 1)
        pairs.append((s[:cut], s[cut:cut + 32]))
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]

    gpu = load_trained(run_dir, cache, args.device)
    lm = RunLM(gpu, batch_size=32, autocast=autocast_for(cfg) if args.device.startswith("cuda") else None, progress=False)
    ref = RunLM(load_trained(run_dir, cache, "cpu"), batch_size=32, progress=False)
    got, want = lm.loglikelihood(reqs), ref.loglikelihood(reqs)
    diffs = [abs(a[0] - b[0]) for a, b in zip(got, want)]
    rows["ll_max_abs_diff"] = max(diffs)
    rows["ll_max_rel_diff"] = max(d / max(abs(b[0]), 1e-6) for d, b in zip(diffs, want))
    rows["greedy_agreement"] = sum(a[1] == b[1] for a, b in zip(got, want)) / len(got)

    speed = {}
    for bs in (8, 32, 128):
        lm.batch_size = bs
        lm.loglikelihood(reqs[:bs])  # warm-up
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.time()
        lm.loglikelihood(reqs)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.time() - t
        tokens = sum(len(gpu.tokenizer.encode(c)) for _, c in pairs)
        speed[bs] = {"requests_per_s": len(reqs) / dt, "scored_tokens_per_s": tokens / dt}
    rows["speed"] = speed

    # A multiple-choice task over the validation text: which of 4 snippets follows the context.
    docs = []
    for _ in range(100):
        s = snippet(seq)
        wrong = [snippet(16) for _ in range(3)]
        docs.append({"question": s[:-16], "choices": [s[-16:], *wrong], "label": 0})
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    (out / "next_snippet.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "next_snippet.yaml").write_text(
        f"task: next_snippet\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {out / 'next_snippet.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ntarget_delimiter: ''\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n")
    t = time.time()
    data = evaluate_run(gpu, ["next_snippet"], task_manager(["next_snippet"], [tasks]), batch_size=32,
                        progress=False, include=[tasks])
    rows["harness_seconds"] = round(time.time() - t, 1)
    rows["next_snippet"] = {r["metric"]: r["value"] for r in metric_rows(data)}
    (out / "eval_check.json").write_text(json.dumps(rows, indent=2) + "\n")

    print("\n| measure | value |\n|---|---|")
    print(f"| run | {args.preset}, mhar H=4, {args.steps} steps, val loss {rows['final_val_loss']:.4f} ({rows['train_seconds']} s) |")
    print(f"| log-likelihood vs fp32 CPU: max abs / rel diff | {rows['ll_max_abs_diff']:.4g} / {rows['ll_max_rel_diff']:.4g} |")
    print(f"| greedy flags agreeing with fp32 CPU | {rows['greedy_agreement']:.3f} |")
    for bs, v in speed.items():
        print(f"| scoring at batch {bs} on {args.device} | {v['requests_per_s']:.0f} requests/s, {v['scored_tokens_per_s']:.0f} tokens/s |")
    print(f"| next_snippet acc (chance 0.25), harness end to end | {rows['next_snippet'].get('acc', float('nan')):.3f} "
          f"({rows['harness_seconds']} s) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
