"""The libraries whose internals the code touches (pyproject.toml says which and why) are installed within
the range pyproject.toml declares: outside it, those internals are untested, so the suite says so rather
than passing on a stack the bounds do not admit. One test per bounded dependency."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
BOUNDED = ("torch", "triton", "lightning", "optuna")


def _requirement(name: str) -> Requirement:
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (req,) = [r for r in map(Requirement, deps) if r.name.lower() == name]
    return req


@pytest.mark.parametrize("name", BOUNDED)
def test_the_installed_version_is_within_the_declared_range(name):
    req = _requirement(name)
    assert any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier), f"{req}: no upper bound"
    if req.marker is not None and not req.marker.evaluate():
        pytest.skip(f"{req} does not apply on this platform")
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{name} is required ({req}) but not installed")
    # A local build tag (2.13.0+cpu) is the release itself; a pre-release of the next one is outside.
    assert req.specifier.contains(Version(installed).public, prereleases=True), (
        f"{name} {installed} is outside the tested range {req.specifier}: check the internals pyproject.toml "
        f"lists for {name} against this release, then move the bound")
