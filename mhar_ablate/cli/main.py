"""The ``mhar-ablate`` command line (also ``python -m mhar_ablate``).

Bad input is one line on stderr and exit code 2; ``--debug`` shows tracebacks. An option that does not
apply (``--time`` under a steps budget, ``seed=`` on a study) is one warning line, and the command goes
on. No line shows a storage URL's password.

``--version`` prints the package's version and the versions of the libraries whose behaviour results
depend on. ``--quiet`` (before or after the command) leaves only warnings, errors and each command's
result or table, and no progress bars (``console.py``; bars are drawn only on a terminal anyway).
``--print-config`` (train, study, info) prints the resolved configuration as YAML that ``--config FILE``
reads back to the same configuration, and stops.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
from pathlib import Path

from ..config import BUDGETS, unused_vocabulary
from ..console import log_line, note, set_quiet
from ..errors import UsageError, out_of_memory_reason
from ..redaction import redact, register


OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad input
        raise UsageError(f"{self.prog}: {message}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default="outputs", metavar="DIR",
                   help="folder that holds studies and runs (default: outputs/)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    _quiet_arg(p)


def _quiet_arg(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's default must not undo a --quiet given before the command.
    p.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="print only warnings, errors and the result (no progress bars, no progress lines)")


def _print_config_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--print-config", action="store_true",
                   help=f"print {what} as YAML (which --config FILE reads back to the same configuration) and stop")


EXPORT_HF_HELP = (
    "Write a trained run as a folder another program loads. A baseline run (residual.kind=baseline) becomes a "
    "transformers Qwen3 folder (config.json, model.safetensors, and the tokenizer as tokenizer.json where "
    "transformers can express it: the byte tokenizer, the run's BPE or tokenizer file), which "
    "AutoModelForCausalLM.from_pretrained(OUT) loads to the same logits as this package; a setting Qwen3 cannot "
    "express is refused, never approximated. A routed run (mhar, attnres, delta, hc, ...) has no transformers "
    "architecture: it is written as weights.safetensors (its metadata names the config) with its config.yaml, and "
    "the command prints how to load it with this package. RUN is a run folder, its name under --output/runs, or a "
    "study's run folder; OUT must be new or an empty folder (it is written beside it and renamed into place).")


def _budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", choices=BUDGETS, help="equal optimiser steps, equal training time or equal training FLOPs")
    p.add_argument("--steps", type=int, metavar="N", help="optimiser steps for --budget steps (for a study under --budget "
                   "flops without --flops: the baseline arm's steps, whose FLOPs every arm gets)")
    p.add_argument("--time", metavar="DURATION", help="training time for --budget wallclock: 90s, 10m, 1.5h or seconds")
    p.add_argument("--flops", metavar="F", help="training FLOPs for --budget flops: 3e15, 3P, 300T or a number "
                   "(each arm trains the steps they buy it; `mhar-ablate info` shows the FLOPs per step)")
    p.add_argument("--logger", choices=("tensorboard", "csv", "wandb"), help="where the series go (same as "
                   "train.logger=...; default tensorboard; wandb needs the wandb extra, WANDB_MODE=offline works)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mhar-ablate", description="Ablation studies of depth-routing residuals (MHAR).")
    parser.add_argument("--version", action="store_true",
                        help="print the package's version and those of torch, triton, lightning and optuna")
    parser.add_argument("--quiet", action="store_true", default=False,
                        help="print only warnings, errors and the result (no progress bars, no progress lines)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    t = sub.add_parser("train", help="train one run into a new run folder under --output")
    t.add_argument("--config", metavar="FILE", help="YAML with model/residual/data/optim/train sections")
    _budget_args(t)
    t.add_argument("--preset", help="model preset from configs/ (same as model.preset=...)")
    t.add_argument("--resume", metavar="RUN", help="continue this run folder from its checkpoint")
    t.add_argument("--devices", type=int, metavar="N", help="processes for the run through Lightning DDP: GPUs, "
                   "or CPU processes with gloo (same as train.devices=N; train.batch_size stays the global batch)")
    t.add_argument("--allow-version-change", action="store_true",
                   help="resume a checkpoint written under other torch/triton/lightning/optuna versions")
    _print_config_arg(t, "the resolved configuration")
    _common(t)
    t.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. residual.heads=4")

    c = sub.add_parser("convert", help="attach MHAR's delta form to a trained baseline or Qwen3 model: a new run "
                                         "folder at step 0 that computes what the source does")
    c.add_argument("source", help="a baseline run folder or checkpoint of this package, or a local Hugging Face "
                                  "Qwen3 folder (config.json + *.safetensors)")
    c.add_argument("--heads", type=int, required=True, metavar="H", help="routing heads of the delta branch")
    c.add_argument("--blocks", type=int, required=True, metavar="N", help="blocks the layers are grouped into "
                                                                          "(must divide the layer count)")
    c.add_argument("--config", metavar="FILE", help="YAML with data/optim/train sections for the continuation")
    _budget_args(c)
    _common(c)
    c.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides for the continuation")

    s = sub.add_parser("study", help="run (or resume) the study defined in studies/NAME.yaml under one budget")
    s.add_argument("name", help="a study in studies/ (heads, grouping, query_init, budget) or a YAML path")
    _budget_args(s)
    s.add_argument("--preset", help="model preset for every arm (same as model.preset=...)")
    s.add_argument("--seeds", type=int, metavar="N",
                   help="seeds per arm (default: the study's); more than a study ran with trains only the new ones")
    s.add_argument("--tune", choices=("lr",), help="tune this hyperparameter per arm with TPE before the grid")
    s.add_argument("--trials", type=int, metavar="N", help="TPE trials per arm for --tune (default 6)")
    s.add_argument("--prune", action="store_true", help="stop hopeless trials early (median pruner)")
    s.add_argument("--storage", metavar="URL", help="Optuna storage URL, e.g. postgresql://user@host/db for workers on "
                   "several machines (default: SQLite in --output for one worker, a journal file there for several)")
    s.add_argument("--workers", default="1", metavar="N|gpus", help="worker processes on this machine (default 1); "
                   "gpus: one per visible GPU (per --devices GPUs), each pinned to its GPUs; on a CPU each gets its own cores")
    s.add_argument("--devices", type=int, metavar="N", help="processes per trial through Lightning DDP (GPUs, or CPU "
                   "processes with gloo); same as train.devices=N")
    s.add_argument("--trials-per-gpu", type=int, default=1, metavar="K", help="let K trials share one GPU "
                   "(--budget steps only: under a wall-clock budget every trial has its device to itself)")
    s.add_argument("--heartbeat", type=int, default=30, metavar="S", help="with a database server: seconds between a "
                   "running trial's heartbeats; a trial silent for 3 of them is resumed by another worker (default 30)")
    s.add_argument("--keep-checkpoints", action="store_true",
                   help="keep finished trials' checkpoints (by default they are removed once the result is recorded)")
    s.add_argument("--allow-version-change", action="store_true",
                   help="continue a study under other torch/triton/lightning/optuna versions than it ran with")
    _print_config_arg(s, "each arm's resolved configuration (seed 0; one YAML document per arm, and one for a "
                         "source stage)")
    _common(s)
    s.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every arm")

    e = sub.add_parser("export", help="print a study's ablation table and write it, with plots, beside the runs")
    e.add_argument("name")
    e.add_argument("--format", choices=("md", "latex", "csv", "json"), default="md")
    e.add_argument("--budget", choices=BUDGETS, help="one budget (default: every budget run)")
    e.add_argument("--storage", metavar="URL")
    e.add_argument("--target-loss", type=float, metavar="LOSS", help="the validation loss the time-to-target columns "
                   "aim at (default: each seed's baseline final loss)")
    _common(e)

    v = sub.add_parser("eval", help="run lm-evaluation-harness tasks on a trained run, or on every finished run of a "
                                    "study (needs the eval extra: pip install 'mhar-ablate[eval]')")
    v.add_argument("run", nargs="?", metavar="RUN", help="a run folder (or its name under --output/runs)")
    v.add_argument("--study", metavar="NAME", help="evaluate every finished run of this study instead of one RUN")
    v.add_argument("--tasks", required=True, metavar="T[,T...]", help="lm-eval task, group or tag names, comma-separated")
    v.add_argument("--include", action="append", default=[], metavar="DIR",
                   help="a folder of task YAMLs (e.g. tasks over local data files); may be repeated")
    v.add_argument("--limit", type=int, metavar="N", help="at most N examples per task (for a quick look)")
    v.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples (default: each task's own)")
    v.add_argument("--batch-size", type=int, default=16, metavar="B", help="sequences per forward (default 16)")
    v.add_argument("--device", metavar="D", help="torch device (default: cuda when visible, else cpu)")
    v.add_argument("--budget", choices=BUDGETS, help="with --study: one budget (default: every budget run)")
    v.add_argument("--storage", metavar="URL", help="with --study: the study's storage (default: as recorded)")
    v.add_argument("--force", action="store_true", help="evaluate again runs already evaluated with these settings")
    _common(v)

    b = sub.add_parser("tensorboard", help="start TensorBoard on a study's runs (or print the command)")
    b.add_argument("name")
    b.add_argument("--port", type=int, default=6006)
    b.add_argument("--host", metavar="HOST", help="the address TensorBoard listens on, passed through (default: "
                   "TensorBoard's, this machine only; 0.0.0.0 serves every interface)")
    b.add_argument("--budget", choices=BUDGETS, help="one budget's runs only (default: every budget, run names "
                   "starting with it)")
    b.add_argument("--print", dest="print_only", action="store_true", help="print the command instead of running it")
    _common(b)

    h = sub.add_parser("export-hf", help="write a run as a transformers Qwen3 folder (baseline) or as safetensors "
                                          "and config (routed runs)", description=EXPORT_HF_HELP)
    h.add_argument("run", metavar="RUN", help="a run folder, its name under --output/runs, or a study's run folder")
    h.add_argument("out", metavar="OUT", help="the folder to write (new, or empty)")
    _common(h)

    from ..data.pack import add_pack_arguments

    k = sub.add_parser("pack", help="pack a corpus's tokens and tokenizer into a small folder that a machine "
                                     "without network trains on (data.source=FOLDER)")
    add_pack_arguments(k)
    _common(k)

    from ..bench.cli import add_bench_parser

    add_bench_parser(sub)

    i = sub.add_parser("info", help="print a configuration's parameter counts and routing overhead")
    i.add_argument("--config", metavar="FILE")
    i.add_argument("--preset")
    i.add_argument("--debug", action="store_true")
    _quiet_arg(i)
    _print_config_arg(i, "the resolved configuration (instead of the counts)")
    i.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    from ..config import parse_duration, parse_flops, parse_overrides

    o = parse_overrides(args.overrides)
    if getattr(args, "preset", None):
        o["model.preset"] = args.preset
    if getattr(args, "budget", None):
        o["train.budget"] = args.budget
    if getattr(args, "steps", None) is not None:
        o["train.steps"] = str(args.steps)
    if getattr(args, "time", None) is not None:
        o["train.time"] = str(parse_duration(args.time))
    if getattr(args, "flops", None) is not None:
        o["train.flops"] = repr(parse_flops(args.flops))
    if getattr(args, "devices", None) is not None:
        o["train.devices"] = str(args.devices)
    if getattr(args, "logger", None):
        o["train.logger"] = args.logger
    return o


def cmd_info(args: argparse.Namespace) -> int:
    from ..config import build_config, kind_class
    from ..model import routing_overhead

    cfg = build_config(args.config, _overrides(args))
    if args.print_config:
        return _print_config(cfg)
    tokenizer_vocab = 256 if cfg.data.tokenizer == "byte" else cfg.data.vocab_size
    vocab = cfg.model.vocab_size or tokenizer_vocab
    if cfg.data.tokenizer in ("byte", "bpe"):  # a tokenizer.json's size is known only once it is read
        if unused := unused_vocabulary(vocab, tokenizer_vocab):
            _warn(unused)
    n, nb, pct = routing_overhead(cfg.model, cfg.residual, vocab)
    print(f"preset {cfg.model.preset}: d={cfg.model.d_model}, {cfg.model.n_layers} layers, vocab {vocab:,}")
    own = cfg.residual.settings()
    settings = f" ({', '.join(f'{k}={v}' for k, v in vars(own).items())})" if own is not None else ""
    label = kind_class(cfg.residual.kind).label(cfg.residual)  # arm_label's, without importing Lightning
    print(f"{label}{settings} parameters: {n:,}; baseline: {nb:,}; routing overhead: {pct:+.4f} %")
    from ..config import format_flops
    from ..model.flops import flops_per_token

    f, fb = flops_per_token(cfg.model, cfg.residual, vocab), flops_per_token(cfg.model, type(cfg.residual)(kind="baseline"), vocab)
    tokens = cfg.train.batch_size * cfg.model.seq_len
    print(f"training FLOPs per token: {f.total:,.0f} (matmuls {f.matmul:,.0f}, attention {f.attention:,.0f}, "
          f"routing {f.routing:,.0f}; baseline {fb.total:,.0f}, {100 * (f.total / fb.total - 1):+.2f} %); "
          f"per step of {tokens:,} tokens: {format_flops(f.total * tokens)}")
    return 0


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _config_yaml(cfg) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def _print_config(cfg) -> int:
    print(_config_yaml(cfg), end="")
    return 0


def versions_text() -> str:
    """The package's version, then the versions of the libraries a result depends on (two lines), read from
    the installed distributions (nothing is imported)."""
    import platform
    from importlib import metadata

    from .. import __version__

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    libs = ", ".join(f"{n} {version(n)}" for n in ("torch", "triton", "lightning", "optuna"))
    return f"mhar-ablate {__version__}\n{libs} (python {platform.python_version()})"


# Which length options each budget reads: under flops, a study reads --steps when --flops is not given
# (the baseline's steps, whose FLOPs every arm gets); ``train`` reads --flops only.
_LENGTH = {"steps": "--steps", "wallclock": "--time", "flops": "--flops"}


def _warn_unused_budget_options(args: argparse.Namespace, budget: str, study: bool = False) -> bool:
    """Warn about (and drop from ``args``) a length option of another budget; True if one was dropped."""
    dropped = False
    for option in ("steps", "time", "flops"):
        if getattr(args, option, None) is None or _LENGTH[budget] == f"--{option}":
            continue
        if option == "steps" and budget == "flops" and study and args.flops is None:
            continue  # the baseline's steps set the FLOPs budget
        owner = next(b for b, o in _LENGTH.items() if o == f"--{option}")
        why = (f"this budget is flops (its length is --flops{'; a study reads --steps only without --flops' if study else ''})"
               if budget == "flops" else f"this budget is {budget} (its length is {_LENGTH[budget]})")
        _warn(f"--{option} applies to --budget {owner}; {why}, so --{option} is ignored")
        setattr(args, option, None)
        dropped = True
    return dropped


def cmd_train(args: argparse.Namespace) -> int:
    from ..config import build_config
    from ..io import check_writable_folder
    from ..training.run import find_run, load_run_config, new_run_dir, train_run
    from ..training.stop import stop_on_signals

    output = Path(args.output)
    if args.resume:
        if args.overrides or args.config or args.preset:
            raise UsageError("--resume continues a run exactly as configured: drop --config, --preset and key=value")
        if args.budget or args.steps is not None or args.time is not None or args.flops is not None:
            raise UsageError("--resume keeps the run's own budget")
        run_dir = find_run(output, args.resume)
        cfg = load_run_config(run_dir)
        if args.print_config:
            return _print_config(cfg)
        check_writable_folder(run_dir, "run folder")
    else:
        cfg = build_config(args.config, _overrides(args))
        if _warn_unused_budget_options(args, cfg.train.budget):
            cfg = build_config(args.config, _overrides(args))  # without the option that does not apply
        if cfg.train.budget == "flops" and cfg.train.flops is None:
            raise UsageError("--budget flops needs its length: --flops F (like 3e15 or 3P; `mhar-ablate info` "
                             "shows the FLOPs of one step)")
        if args.print_config:
            return _print_config(cfg)
        check_writable_folder(output)
        run_dir = new_run_dir(output, cfg)
    cache = output / "cache"
    from ..data import load_corpus

    corpus = load_corpus(cfg.data, cache)  # cached: train_run reuses it
    log_line(f"data: {corpus.info.describe()}")
    from ..training.final_eval import shortfall

    short = shortfall(cfg.data.val_fraction, len(corpus.val), len(corpus.train) + len(corpus.val), cfg.model.seq_len,
                     cfg.final_sequences())
    if short:
        log_line(short)
    log_line(f"run folder: {run_dir}")
    import torch

    try:
        with stop_on_signals() as stop:
            # Every line the run prints goes above its progress bar (console.log_line), none onto it.
            result = train_run(cfg, run_dir, cache, resume=bool(args.resume), stop=stop, log=log_line,
                               allow_version_change=args.allow_version_change)
    except torch.OutOfMemoryError as e:  # the run's size or a neighbour on the GPU, not a bug
        print(f"error: out of GPU memory ({out_of_memory_reason(e)}) in {run_dir}: a smaller train.batch_size or model fits, "
              "or a GPU without other processes", file=sys.stderr)
        return 1
    print(f"{result['status']}: {result['step']} steps, {float(result['seconds']):.1f}s of training, "
          f"final val loss {float(result['final_val_loss']):.4f}, {result['tokens_per_s'] or 0:,.0f} tokens/s")
    if args.quiet:
        print(f"run folder: {run_dir}")
    else:
        print(f"TensorBoard: tensorboard --logdir {run_dir / 'tb' if (run_dir / 'tb').is_dir() else run_dir}")
    if result["status"] == "interrupted":
        print(f"resume with: mhar-ablate train --output {output} --resume {run_dir.name}")
        return 130
    return 0 if result["status"] == "completed" else 1


def cmd_convert(args: argparse.Namespace) -> int:
    from ..interop.convert import convert

    if args.heads < 1 or args.blocks < 1:
        raise UsageError(f"--heads and --blocks must be at least 1, got {args.heads} and {args.blocks}")
    output = Path(args.output)
    run_dir = convert(args.source, args.heads, args.blocks, output, args.config, _overrides(args), log=log_line)
    print(f"run folder: {run_dir} (step 0; its weights: {run_dir / 'init.safetensors'})")
    print(f"train it with: mhar-ablate train --output {output} --resume {run_dir.name}")
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from ..sweep.definition import StudyDefinition, StudyRun
    from ..sweep.driver import run_study
    from ..training.stop import stop_on_signals

    definition = StudyDefinition.load(args.name)
    budget = args.budget or "steps"
    if args.seeds is not None and args.seeds < 1:
        raise UsageError(f"--seeds must be at least 1, got {args.seeds}")
    if args.trials is not None and args.trials < 1:
        raise UsageError(f"--trials must be at least 1, got {args.trials}")
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise UsageError(f"--output {args.output} is a file, not a folder")
    if args.heartbeat < 1:
        raise UsageError(f"--heartbeat must be at least 1 second, got {args.heartbeat}")
    from ..config import parse_overrides

    given = parse_overrides(args.overrides)
    _overrides(args)  # a bad value (--time soon) is an error before any warning
    _warn_unused_budget_options(args, budget, study=True)
    if "seed" in given:
        _warn(f"seed={given['seed']} is ignored: a study trains seeds 0 to N-1 of every arm (--seeds N sets N)")
    if "train.budget" in given:
        _warn(f"train.budget={given['train.budget']} is ignored: a study's budget is --budget ({budget})")
    if args.trials is not None and not args.tune:
        _warn("--trials is ignored without --tune")
    overrides = _overrides(args)
    overrides.pop("train.budget", None)
    overrides.pop("seed", None)
    sr = StudyRun(definition, budget, Path(args.output), overrides, args.seeds or definition.seeds,
                  storage=args.storage, prune=args.prune, tune=args.tune, tune_trials=args.trials or 6,
                  workers=args.workers, trials_per_gpu=args.trials_per_gpu, heartbeat=args.heartbeat,
                  keep_checkpoints=args.keep_checkpoints, allow_version_change=args.allow_version_change)
    if args.print_config:
        return _print_study_configs(sr)
    with stop_on_signals() as stop:
        summary = run_study(sr, stop=stop)
    if summary["interrupted"]:
        print(f"interrupted: rerun `{_command_line(args)}` to resume", file=sys.stderr)
        return 130
    if summary.get("out_of_memory") and summary["done"] < len(sr.grid()):
        print(f"error: {summary['out_of_memory']} trial(s) ran out of GPU memory and {len(sr.grid()) - summary['done']} "
              f"grid point(s) are unfinished: rerun `{_command_line(args)}` to retry them"
              + (" with a smaller --trials-per-gpu" if args.trials_per_gpu > 1 else ""), file=sys.stderr)
        return 1
    if summary.get("workers_died") and summary["done"] < len(sr.grid()):
        print(f"error: {summary['workers_died']} worker(s) died and {len(sr.grid()) - summary['done']} grid point(s) are "
              f"unfinished: rerun `{_command_line(args)}` to resume them", file=sys.stderr)
        return 1
    from ..reporting.table import build_table
    from ..reporting.render import render
    from ..sweep.catalog import load_studies

    (study,) = load_studies(Path(args.output), definition.name, budget, args.storage)
    if not args.quiet:
        print()
    print(render(build_table(study), "md"))
    if not args.quiet:
        print(f"runs and TensorBoard logs: {sr.folder}")
        print(f"next: mhar-ablate tensorboard {definition.name}{_out(args)}   |   "
              f"mhar-ablate export {definition.name} --format md{_out(args)}")
    return 0


def _print_study_configs(sr) -> int:
    """Each arm's configuration at seed 0 (the others differ only in ``seed``), and a source stage's, as YAML
    documents: each, saved alone, is a ``--config`` for ``train`` that trains that grid point."""
    configs = sr.configs()
    docs = [(f"source stage (seed 0 of {sr.seeds})", cfg) for seed, cfg in sr.source_configs().items() if seed == 0]
    docs += [(f"arm {arm} (seed 0 of {sr.seeds}; the other seeds differ only in seed)", configs[(arm, 0)])
             for arm in sr.definition.arms]
    print("\n---\n".join(f"# study {sr.definition.name}, budget {sr.budget}: {what}\n{_config_yaml(cfg)}".rstrip("\n")
                         for what, cfg in docs))
    return 0


def _out(args: argparse.Namespace) -> str:
    return "" if args.output == "outputs" else f" --output {shlex.quote(args.output)}"


def _command_line(args: argparse.Namespace) -> str:
    """The command as it was given (every option, so the same command resumes), passwords masked."""
    argv = [a for a in getattr(args, "argv", []) if a != "--debug"]
    return redact("mhar-ablate " + shlex.join(argv))


def cmd_export(args: argparse.Namespace) -> int:
    from ..reporting.table import build_table
    from ..reporting.export import export, rankings, verdicts
    from ..sweep.catalog import load_studies, study_folder

    output = Path(args.output)
    if args.target_loss is not None and not (math.isfinite(args.target_loss) and args.target_loss > 0):
        raise UsageError(f"--target-loss must be a positive finite loss, got {args.target_loss}")
    studies = load_studies(output, Path(args.name).stem, args.budget, args.storage)
    tables = []
    for study in studies:
        text, files = export(study, args.format, study_folder(output, study, args.name), args.target_loss)
        tables.append(build_table(study, args.target_loss))
        print(text)
        note(f"written: {', '.join(str(f) for f in files)}")
    if len(tables) > 1:
        print("verdicts by measure (lowest validation loss first):", file=sys.stderr)
        print(verdicts(tables), file=sys.stderr)
        side = rankings(tables)
        if side:
            from ..io import write_text

            path = study_folder(output, studies[0], args.name).parent / "rankings.md"
            write_text(path, f"### {tables[0].name}: the ranking under each budget\n\n{side}")
            print(f"\nthe ranking under each budget (best first):\n{side}", file=sys.stderr)
            note(f"written: {path}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from ..console import bars_enabled
    from .eval import EvalOptions, eval_run_command, eval_study_command, parse_tasks

    if (args.run is None) == (args.study is None):
        raise UsageError("eval takes one RUN or --study NAME")
    if args.run is not None and (args.budget or args.storage):
        raise UsageError("--budget and --storage apply to --study only")
    opts = EvalOptions(parse_tasks(args.tasks), [Path(p) for p in args.include], args.limit, args.num_fewshot,
                       args.batch_size, device=args.device, force=args.force, progress=bars_enabled())
    output = Path(args.output)
    if args.study is not None:
        return eval_study_command(args.study, output, opts, args.budget, args.storage)
    return eval_run_command(args.run, output, opts)


def cmd_tensorboard(args: argparse.Namespace) -> int:
    import shutil
    import subprocess

    logdir = Path(args.output) / "studies" / Path(args.name).stem
    if args.budget:
        logdir = logdir / args.budget
    if not logdir.is_dir():
        raise UsageError(f"no runs for study {args.name!r} under {logdir.parent}")
    host = ["--host", args.host] if args.host else []
    if args.host is not None and not args.host.strip():
        raise UsageError("--host needs an address (a name or IP such as 0.0.0.0)")
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(args.port), *host]
    shown = shlex.join(["tensorboard", "--logdir", str(logdir), "--port", str(args.port), *host])
    if args.print_only or not shutil.which(sys.executable):
        print(shown)
        return 0
    note(f"starting: {shown}   (Ctrl-C stops it)")
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from ..interop.export_hf import export_hf

    export_hf(args.run, args.out, Path(args.output))
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from ..data.pack import pack_from_args

    return pack_from_args(args, Path(args.output) / "cache")


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.cli import cmd_bench as run

    return run(args)


COMMANDS = {"bench": cmd_bench, "convert": cmd_convert, "train": cmd_train, "study": cmd_study, "export": cmd_export, "tensorboard": cmd_tensorboard,
            "info": cmd_info, "eval": cmd_eval, "export-hf": cmd_export_hf, "pack": cmd_pack}


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--time -5m`` would read to argparse as a missing value; pass it on as ``--time=-5m`` so that
    the user hears what is wrong with the value itself."""
    out: list[str] = []
    for a in argv:
        if out and out[-1] in ("--time", "--steps", "--flops", "--seeds", "--trials", "--workers", "--devices", "--trials-per-gpu",
                               "--heartbeat", "--heads", "--blocks", "--limit", "--num-fewshot",
                               "--batch-size") and re.match(r"-[0-9.]", a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def _register_storage(argv: list[str]) -> None:
    """Secrets of a ``--storage`` URL are masked from the first line on, before anything can print it."""
    for i, a in enumerate(argv):
        if a == "--storage" and i + 1 < len(argv):
            register(argv[i + 1])
        elif a.startswith("--storage="):
            register(a.split("=", 1)[1])


def main(argv: list[str] | None = None) -> int:
    from ..training.stop import StopNow

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    _register_storage(argv)
    given = list(argv)
    was_quiet = os.environ.get("MHAR_ABLATE_QUIET")
    try:
        # key=value overrides may stand anywhere after the command; argparse cannot take a variable-length
        # positional after options, so they are split off first.
        overrides = [a for a in argv if OVERRIDE.match(a)]
        argv = _attach_negative_values(argv)
        args = build_parser().parse_args([a for a in argv if not OVERRIDE.match(a)])
        args.argv = given
        args.quiet = bool(getattr(args, "quiet", False))
        set_quiet(args.quiet)
        if args.version:
            print(versions_text())
            return 0
        if hasattr(args, "overrides"):
            args.overrides = overrides + list(args.overrides)
        elif overrides:
            raise UsageError(f"{args.command} takes no key=value overrides: {' '.join(overrides)}")
        if not args.command:
            build_parser().print_help()
            return 2
        return COMMANDS[args.command](args)
    except UsageError as e:
        if debug:
            raise
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, StopNow):
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, not bad input: say so in one line unless asked for more
        if debug:
            raise
        print(f"error: internal error: {type(e).__name__}: {redact(str(e))} (run again with --debug for the traceback)",
              file=sys.stderr)
        return 1
    finally:
        if was_quiet is None:  # this command's --quiet does not outlive it (tests run many in one process)
            os.environ.pop("MHAR_ABLATE_QUIET", None)
        else:
            os.environ["MHAR_ABLATE_QUIET"] = was_quiet


if __name__ == "__main__":
    sys.exit(main())
