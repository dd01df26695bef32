"""The allowed values of every configuration key, declared beside its field, and the one check of them.

A numeric field of a configuration dataclass (``config.py``'s sections, a variant's ``Settings``) is
declared with ``ranged(default, lo, hi, ...)``: its range lives in the field's metadata (``"range"``), so
the key, its type and its bounds are read from one place. ``check_fields`` is the one check: run by
``RunConfig.validate`` (the path every command's configuration goes through) on every section and every
kind's settings object, before anything reads a value, so a bad number is refused in one line naming the
key and its range before any tensor is made. Its rules, for every field:

- a number (int or float) must be finite and inside its range; a numeric field without a range is a
  mistake of the package (``tests/reliability/test_reliability_config_keys.py`` fails on one);
- a string must not be empty (no string key of the package means anything empty);
- None is allowed only where the field's type says ``| None`` (it means "the default").

Checks that relate several keys (heads dividing the width, a grouping that fits the depth) stay in the
sections' and kinds' own ``validate``/``check``, which run after this one.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric key: ``lo`` and ``hi`` (None: unbounded on that side), each included unless
    ``lo_open`` / ``hi_open``. Every value must also be finite, whatever the bounds."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return False
        return True

    def describe(self) -> str:
        """The range in words: "positive", "at least 1", "between 0 and 4294967295", "in (0, 0.5)"."""
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            if not self.lo_open and not self.hi_open:
                return f"between {_num(lo)} and {_num(hi)}"
            return f"in {'(' if self.lo_open else '['}{_num(lo)}, {_num(hi)}{')' if self.hi_open else ']'}"
        if lo is not None:
            if self.lo_open:
                return "positive" if lo == 0 else f"greater than {_num(lo)}"
            return f"at least {_num(lo)}"
        if hi is not None:
            return f"less than {_num(hi)}" if self.hi_open else f"at most {_num(hi)}"
        return "a finite number"


def ranged(default: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False) -> Any:
    """A dataclass field with ``default`` whose values must lie in the range (see ``Range``)."""
    return field(default=default, metadata={"range": Range(lo, hi, lo_open, hi_open)})


def field_range(f: dataclasses.Field) -> Range | None:
    return f.metadata.get("range")


def base_type(typ: Any) -> tuple[Any, bool]:
    """(the type a field holds, whether None is allowed): ``int | None`` -> (int, True)."""
    args = typing.get_args(typ)
    if args and (typing.get_origin(typ) in (typing.Union, types.UnionType)):
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else str), type(None) in args
    return typ, False


def check_fields(obj: Any, prefix: str) -> None:
    """Refuse, in one ``UsageError`` line that names the key and what it allows, the first field of the
    dataclass ``obj`` that breaks the rules above; ``prefix`` makes its key (``model.``, ``residual.hc.``)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        typ, optional = base_type(hints[f.name])
        if value is None:
            if not optional:
                raise UsageError(f"{key} cannot be empty")
            continue
        r = field_range(f)
        or_none = " (or none for the default)" if optional else ""
        if typ in (int, float) and not isinstance(value, bool):
            allowed = r.describe() if r is not None else "a finite number"
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"{key} must be a finite number ({allowed}), got {value}")
            if r is not None and value not in r:
                raise UsageError(f"{key} must be {allowed}{or_none}, got {value}")
        elif typ is str and not str(value).strip():
            raise UsageError(f"{key} cannot be empty" + (" (or none)" if optional else ""))
