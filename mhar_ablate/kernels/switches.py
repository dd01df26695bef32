"""Launch switches of a kernel package (``history``, ``column``) set on the package itself.

Each package keeps its switches (launch configurations, tables, overrides that benchmarks and tests set) in
one module, its ``config``, which the launch code reads by attribute when it launches. ``forward_switches``
makes the package forward them: ``package.NAME`` reads ``config.NAME``, and ``package.NAME = value`` (or
``monkeypatch.setattr(package, "NAME", value)``) sets it there, so that a switch set on the package takes
effect at the next launch. The package holds no copy of a switch that could go stale.

A package attribute that is neither a switch nor a submodule (a re-exported function or class) cannot be set
on the package: the package's own code calls its submodules' names, so replacing the re-export would change
none of its launches. Patch it in the submodule that calls it instead.
"""

from __future__ import annotations

import sys
import types

__all__ = ["forward_switches", "switch_names"]


def switch_names(config: types.ModuleType) -> frozenset[str]:
    """A config module's switches: its upper-case names, public or private (``_INTERPRETER_CONFIG``)."""
    return frozenset(name for name in vars(config) if name.lstrip("_").isupper())


class _SwitchedPackage(types.ModuleType):
    """A kernel package whose ``config`` submodule holds its switches; ``forward_switches`` gives each package a
    subclass with one property a switch."""

    def __setattr__(self, name: str, value) -> None:
        held = self.__dict__.get(name)
        if held is not None and not name.startswith("__") and not isinstance(held, types.ModuleType):
            owner = getattr(held, "__module__", None)  # a function's or class's own module; else who holds it
            if not isinstance(owner, str) or not owner.startswith(self.__name__ + "."):
                owner = next((m.__name__ for m in vars(self).values()
                              if isinstance(m, types.ModuleType) and getattr(m, name, None) is held), "its submodule")
            raise AttributeError(f"{self.__name__}.{name} is a re-export of {owner}.{name}, which the package's "
                                 f"code reads: set it on {owner}")
        super().__setattr__(name, value)  # a switch: its property sets it in config

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | switch_names(self.config))


def _switch(config: types.ModuleType, name: str) -> property:
    # A data descriptor, not a module __getattr__: reads and writes both go to config, and tools that restore
    # what they set (pytest's monkeypatch) see the switch as set through the descriptor and set it back.
    return property(lambda package: getattr(config, name), lambda package, value: setattr(config, name, value),
                    doc=f"{config.__name__}.{name}")


def forward_switches(package_name: str) -> None:
    """Make the package ``package_name`` (already holding its ``config`` submodule) forward its switches."""
    package = sys.modules[package_name]
    config = getattr(package, "config", None)
    if not isinstance(config, types.ModuleType):
        raise ValueError(f"{package_name} has no config submodule to forward switches to")
    switches = {name: _switch(config, name) for name in switch_names(config)}
    package.__class__ = type(f"SwitchedPackage[{package_name}]", (_SwitchedPackage,), switches)
