"""What a result was produced with: the library versions that change what trains and how fast, the
package version, the git commit of the checkout the package runs from (with a flag for uncommitted
changes and the SHA-256 of their diff), and the machine (host, CPU, cores, GPU, CUDA driver). Every run's result, every checkpoint and every study records it; a study, or a
run resumed from its checkpoint, refuses to continue under other library versions unless told to.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import socket
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
    none = {"git_commit": None, "git_dirty": None, "git_diff_sha256": None}
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
    dirty = bool(status.stdout.strip())
    return {"git_commit": commit.stdout.strip(), "git_dirty": dirty, "git_diff_sha256": _diff_sha256() if dirty else None}


def _diff_sha256() -> str | None:
    """SHA-256 of the uncommitted changes: ``git diff HEAD`` (binary-safe) and every untracked file's
    path and bytes, so that two dirty trees with the same hash hold the same code."""
    try:
        diff = subprocess.run(["git", "-C", str(CHECKOUT), "diff", "HEAD", "--binary"], capture_output=True,
                              timeout=60)
        untracked = subprocess.run(["git", "-C", str(CHECKOUT), "ls-files", "--others", "--exclude-standard", "-z"],
                                   capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if diff.returncode or untracked.returncode:
        return None
    h = hashlib.sha256(diff.stdout)
    for name in sorted(n for n in untracked.stdout.split(b"\0") if n):
        h.update(b"\0untracked\0" + name + b"\0")
        try:
            h.update((CHECKOUT / os.fsdecode(name)).read_bytes())
        except OSError:  # a file removed meanwhile, or unreadable
            pass
    return h.hexdigest()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_smi(query: str) -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if not out.returncode else []


@functools.lru_cache(maxsize=1)
def machine() -> dict[str, Any]:
    """Host name, CPU model and cores, the GPUs' names, the CUDA driver's version (None where no GPU)."""
    gpus: list[str] = []
    driver = None
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    if gpus or shutil.which("nvidia-smi"):
        rows = _nvidia_smi("name,driver_version")
        if rows:
            gpus = gpus or [r.rsplit(",", 1)[0].strip() for r in rows]
            driver = rows[0].rsplit(",", 1)[-1].strip()
    return {"hostname": socket.gethostname(), "cpu": _cpu_model(), "cpu_cores": os.cpu_count(),
            "gpus": gpus, "cuda_driver": driver}


def environment() -> dict[str, Any]:
    """The versions a result is produced with, as JSON-able values."""
    env: dict[str, Any] = {"mhar-ablate": __version__}
    env.update({name: _version(name) for name in LIBRARIES})
    env["python"] = platform.python_version()
    env.update(git_state())
    env["machine"] = machine()
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
