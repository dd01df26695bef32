"""Hostile input, key by key: every configuration key (computed from the dataclasses and every kind's
``Settings``, never listed by hand) takes a valid value, and each invalid one (wrong type, out of its
range, nan/inf, empty) is refused through the real command line in one line that names the key, exit 2,
no traceback. ``TABLE`` has an entry per key: a key added without one fails ``test_every_key_has_an_entry``."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from mhar_ablate.cli import main
from mhar_ablate.config import RunConfig
from mhar_ablate.ranges import Range, base_type, field_range
from mhar_ablate.variants import RESIDUALS


def computed_keys() -> dict[str, tuple[type, bool, Range | None]]:
    """Every key -> (the type it holds, whether none is allowed, its range)."""
    keys = {}

    def add(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            typ, optional = base_type(hints[f.name])
            if dataclasses.is_dataclass(typ):
                add(typ, f"{prefix}{f.name}.")
            else:
                keys[f"{prefix}{f.name}"] = (typ, optional, field_range(f))

    add(RunConfig, "")
    for kind, cls in RESIDUALS.items():
        if cls.Settings is not None:
            add(cls.Settings, f"residual.{kind}.")
    return keys


KEYS = computed_keys()

# key -> (a valid value, invalid values beyond those made from its type and range, settings it needs).
# Values are command-line strings, as `mhar-ablate info key=value` takes them.
HC, MHC, DENSE, MUDD = ["residual.kind=hc"], ["residual.kind=mhc"], ["residual.kind=denseformer"], ["residual.kind=muddformer"]
TABLE: dict[str, tuple[str, list[str], list[str]]] = {
    "seed": ("7", [], []),
    "model.preset": ("small", ["huge"], []),
    "model.d_model": ("32", [], []),
    "model.n_layers": ("2", [], ["residual.grouping=full"]),
    "model.n_heads": ("2", ["3"], []),  # 3 does not divide d_model=64
    "model.n_kv_heads": ("1", ["3"], []),
    "model.head_dim": ("32", ["15"], []),  # odd: no rotary embedding
    "model.ffn": ("96", [], []),
    "model.seq_len": ("64", [], []),
    "model.vocab_size": ("300", [], []),
    "model.rope_theta": ("10000", [], []),
    "model.norm_eps": ("1e-5", [], []),
    "model.tie_embeddings": ("false", [], []),
    "residual.kind": ("baseline", ["hyper"], []),
    "residual.heads": ("2", ["3"], []),
    "residual.grouping": ("block:2", ["rows", "block:0", "block:9"], []),
    "residual.query_init": ("normal:0.02", ["normal:-1", "normal:nan", "uniform"], []),
    "residual.backend": ("reference", ["cuda"], []),
    "residual.hc.rate": ("2", [], HC),
    "residual.hc.dynamic": ("false", [], HC),
    "residual.mhc.rate": ("2", [], MHC),
    "residual.mhc.sinkhorn_iters": ("5", [], MHC),
    "residual.mhc.gate_init": ("0.1", [], MHC),
    "residual.denseformer.dilation": ("2", [], DENSE),
    "residual.denseformer.period": ("2", ["5"], DENSE),  # 5 > model.n_layers
    "residual.muddformer.multiway": ("false", [], MUDD),
    "data.source": ("stdlib", ["/no/such/folder"], []),
    "data.text_field": ("body", [], []),
    "data.tokenizer": ("bpe", ["words", "/no/such/tokenizer.json"], []),
    "data.vocab_size": ("1000", [], ["data.tokenizer=bpe"]),
    "data.val_fraction": ("0.05", [], []),
    "data.val_sequences": ("8", [], []),
    "data.final_sequences": ("0", [], []),
    "data.max_tokens": ("100000", [], []),
    "optim.lr": ("1e-3", [], []),
    "optim.weight_decay": ("0", [], []),
    "optim.beta1": ("0.8", [], []),
    "optim.beta2": ("0.99", [], []),
    "optim.grad_clip": ("0", [], []),
    "optim.warmup": ("0", [], []),
    "optim.schedule": ("wsd", ["linear"], []),
    "optim.min_lr_ratio": ("0", [], []),
    "optim.decay_fraction": ("1", [], []),
    "train.budget": ("wallclock", ["tokens"], []),
    "train.steps": ("10", [], []),
    "train.time": ("90s", ["soon", "-5m", "nanm"], []),
    "train.flops": ("3P", ["3m", "lots"], []),
    "train.batch_size": ("8", [], []),
    "train.eval_every": ("5", [], []),
    "train.eval_batches": ("2", [], []),
    "train.heatmap_every": ("2", [], []),
    "train.checkpoint_every": ("0", [], []),
    "train.precision": ("fp32", ["fp8"], []),
    "train.logger": ("csv", ["neptune"], []),
    "train.compile": ("true", [], []),
    "train.cuda_graph": ("false", [], []),
    "train.log_every": ("5", [], []),
    "train.threads": ("1", [], []),
    "train.devices": ("2", ["3"], []),  # 3 does not divide train.batch_size=16
    "train.first_batch": ("100", [], []),
    "train.init": ("none", [], []),  # its file is looked for when the run starts
}


def _out_of_range(r: Range, typ: type) -> list[str]:
    """Values just outside each bound, and far outside."""
    out = []
    step = 1 if typ is int else 1e-9
    if r.lo is not None:
        out += [repr(r.lo if r.lo_open else r.lo - step), repr(r.lo - 10**6)]
    if r.hi is not None:
        out += [repr(r.hi if r.hi_open else r.hi + step), repr(r.hi * 10**6)]
    return out


def invalid_values(key: str) -> list[tuple[str, str | None]]:
    """(value, the range its message must state, or None) for ``key``."""
    typ, optional, r = KEYS[key]
    values: list[tuple[str, str | None]] = [("", None)]
    if typ is int:
        values += [(v, None) for v in ("abc", "1.5", "1e400", "nan", "inf", "true", "[1]")]
    elif typ is float:
        values += [(v, None) for v in ("abc", "nan", "inf", "-inf", "1e400", "true")]
    elif typ is bool:
        values += [(v, None) for v in ("maybe", "2", "none" if not optional else "maybe")]
    if r is not None:
        values += [(v, r.describe()) for v in _out_of_range(r, typ)]
    values += [(v, None) for v in TABLE[key][1]]
    return values


def test_every_key_has_an_entry():
    assert set(TABLE) == set(KEYS), (f"keys without a TABLE entry: {sorted(set(KEYS) - set(TABLE))}; "
                                     f"entries for no key: {sorted(set(TABLE) - set(KEYS))}")


def test_every_numeric_key_has_a_range():
    missing = [k for k, (typ, _, r) in KEYS.items() if typ in (int, float) and r is None]
    assert not missing, f"numeric keys without a range (ranges.ranged): {missing}"


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("key", sorted(KEYS))
def test_key_takes_its_valid_value_and_refuses_each_invalid_one(key, capsys):
    valid, _, context = TABLE[key]
    code, err = _run(capsys, ["info", *context, f"{key}={valid}"])
    assert code == 0, f"{key}={valid}: {err}"
    for value, allowed in invalid_values(key):
        code, err = _run(capsys, ["info", *context, f"{key}={value}"])
        lines = [l for l in err.splitlines() if l.strip()]
        assert code == 2, f"{key}={value!r}: exit {code}, {err}"
        assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith("error: "), f"{key}={value!r}: {err}"
        assert key in lines[0] and "internal error" not in lines[0], f"{key}={value!r}: {lines[0]}"
        if allowed is not None:
            assert allowed in lines[0], f"{key}={value!r}: the range {allowed!r} is not in {lines[0]!r}"


def test_yaml_values_of_the_wrong_type_are_refused(tmp_path, capsys):
    """YAML has types of its own: true is no number, a list is no string or number."""
    for text, key in [("model: {d_model: true}\n", "model.d_model"), ("optim: {lr: false}\n", "optim.lr"),
                      ("data: {source: [a, b]}\n", "data.source"), ("train: {steps: [1]}\n", "train.steps"),
                      ("seed: .nan\n", "seed"), ("optim: {lr: .inf}\n", "optim.lr"), ("data: {text_field: ''}\n", "data.text_field")]:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        code, err = _run(capsys, ["info", "--config", str(cfg)])
        assert code == 2 and key in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (text, err)


def test_shipped_presets_and_studies_pass_the_ranges():
    from mhar_ablate.config import build_config, list_resources
    from mhar_ablate.sweep.definition import StudyDefinition

    for preset in list_resources("configs"):
        build_config(overrides={"model.preset": preset})
    for name in list_resources("studies"):
        study = StudyDefinition.load(name)
        for budget in study.budgets:
            for arm in study.arms:
                study.arm_config(arm, 0, budget, {})
        if study.source:
            study.source_config(0, {})
