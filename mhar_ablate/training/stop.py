"""Stopping a run between steps: SIGINT and SIGTERM become a request that the budget callback reads
after the current optimiser step, so a stop never lands mid-update and always leaves a checkpoint.

Kept free of Lightning so that commands which may not train (a finished study) start quickly.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class StopRequest:
    """Set from a signal handler; read between steps, so a stop never lands mid-update."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def __bool__(self) -> bool:
        return self.signal is not None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """SIGINT/SIGTERM ask the run to stop after the current step (checkpoint first); a second SIGINT
    stops at once. Handlers are restored afterwards, and only the main thread can install them."""
    stop = StopRequest()

    def handler(signum, frame):
        if stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.signal = signal.Signals(signum).name

    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)
