"""Child processes of this package (study workers, distributed ranks): tied to their parent's life, and
drawing no progress bars over each other's."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: get ``sig`` when the parent process ends, so a killed ``study`` leaves no orphan training."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class NotATerminal:
    """stderr for a worker process: its runs draw no progress bars over each other's."""

    def __init__(self, stream):
        self._stream = stream

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._stream, name)

