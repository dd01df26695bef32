"""What a result was produced with: the library versions that change what trains and how fast, the
package version, and the git commit of the checkout the package runs from (with a flag for
uncommitted changes). Every run's result, every checkpoint and every study records it; a study, or a
run resumed from its checkpoint, refuses to continue under other library versions unless told to.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from . import __version__

# The libraries whose version can change a result: numerics and kernels (torch, triton), the training
# loop (lightning) and the study driver (optuna); the package itself is compared too.
LIBRARIES = ("torch", "triton", "lightning", "optuna")
COMPARED = ("mhar-ablate", *LIBRARIES)
CHECKOUT = Path(__file__).resolve().parent.parent


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def git_state() -> dict[str, Any]:
    """``git_commit`` and ``git_dirty`` of the checkout this package runs from; None outside one."""
    none = {"git_commit": None, "git_dirty": None}
    if not (CHECKOUT / ".git").exists():  # an installed wheel, not a checkout
        return none
    try:
        commit = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(CHECKOUT), "status", "--porcelain"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):  # no git on the machine
        return none
    if commit.returncode or status.returncode:
        return none
    return {"git_commit": commit.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def environment() -> dict[str, Any]:
    """The versions a result is produced with, as JSON-able values."""
    env: dict[str, Any] = {"mhar-ablate": __version__}
    env.update({name: _version(name) for name in LIBRARIES})
    env["python"] = platform.python_version()
    env.update(git_state())
    return env


def differences(recorded: dict[str, Any] | None, current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, recorded, current) for each compared package whose version differs; nothing is
    compared where no record exists (a study or checkpoint written before versions were recorded)."""
    if not isinstance(recorded, dict):
        return []
    return [(k, recorded.get(k), current.get(k)) for k in COMPARED
            if k in recorded and recorded.get(k) != current.get(k)]


def describe_differences(diffs: list[tuple[str, Any, Any]]) -> tuple[str, str]:
    """('torch 2.12.0, optuna 4.5.0', 'torch 2.13.0, optuna 5.0.0') for a message."""
    old = ", ".join(f"{k} {v or 'absent'}" for k, v, _ in diffs)
    new = ", ".join(f"{k} {v or 'absent'}" for k, _, v in diffs)
    return old, new
