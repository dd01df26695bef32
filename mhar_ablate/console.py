"""What the package prints to the terminal beside its progress bars.

- ``log_line``: an informational line (stdout) that lands above the bars, not on them (``tqdm.write``).
  Every line printed while a bar may be drawn (training, evaluation, a study's trials) goes through it.
- ``note``: the same on stderr (the commands whose stdout is a table or a result keep their notes off it).
- ``bars_enabled``: whether a progress bar is drawn. Only on a terminal: off one (a log file, a pipe, a CI
  job) no bar is drawn at all, so no carriage-return frames reach the log; the plain lines that remain (each
  evaluation's ``eval N: step ...`` line, a study's per-trial lines) are the periodic progress there.
- ``--quiet`` (``set_quiet``): no informational lines and no bars; warnings, errors and each command's
  final result or table still print. The setting is an environment variable, so the processes a run
  starts (DDP ranks, a study's workers) are quiet too.
"""

from __future__ import annotations

import os
import sys

QUIET_ENV = "MHAR_ABLATE_QUIET"


def set_quiet(on: bool) -> None:
    if on:
        os.environ[QUIET_ENV] = "1"
    else:
        os.environ.pop(QUIET_ENV, None)


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def bars_enabled() -> bool:
    """Draw progress bars: stderr is a terminal and ``--quiet`` is off."""
    return not quiet() and sys.stderr.isatty()


def log_line(msg: str) -> None:
    if quiet():
        return
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()


def note(msg: str) -> None:
    if quiet():
        return
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stderr)
    sys.stderr.flush()
