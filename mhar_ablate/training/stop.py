"""Stopping a run between steps: SIGINT and SIGTERM become a request that the budget callback reads
after the current optimiser step, so a stop never lands mid-update and always leaves a checkpoint.
A second SIGINT stops at once (``StopNow``), except while a checkpoint or a result is being written:
there it waits until the file is whole, so the second Ctrl-C never loses what the first was saving.

Kept free of Lightning so that commands which may not train (a finished study) start quickly.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
from typing import Iterator


class StopNow(BaseException):
    """A second SIGINT: stop without finishing the step. A BaseException that is not a
    KeyboardInterrupt, because Lightning answers a KeyboardInterrupt with ``sys.exit(1)``; the run
    catches this, keeps its last complete checkpoint and records itself as interrupted."""


class StopRequest:
    """Set from a signal handler; read between steps, so a stop never lands mid-update."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.now = False  # StopNow has been raised: the run is stopping at once
        self._pending = False  # a second SIGINT arrived during a write: raised when the write is done
        self._writing = 0

    def __bool__(self) -> bool:
        return self.signal is not None

    def second(self) -> None:
        """The handler's answer to a SIGINT after the first stop request: ``StopNow`` (deferred while a
        checkpoint or result is written); once the run is already stopping at once, KeyboardInterrupt
        outside a write, nothing inside one."""
        if self._writing:
            self._pending = not self.now
            return
        if self.now:
            raise KeyboardInterrupt
        self.now = True
        raise StopNow

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A write that a second SIGINT must not cut short (a checkpoint, a result)."""
        self._writing += 1
        try:
            yield
        finally:
            self._writing -= 1
        if not self._writing and self._pending:
            self._pending = False
            self.now = True
            raise StopNow


def _say(line: str) -> None:
    """One line on stderr from a signal handler: a raw write, since the handler may run in the middle
    of a buffered write to the same stream (which ``print`` would answer with a reentrancy error)."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # stderr is not a file here
        pass


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """SIGINT/SIGTERM ask the run to stop after the current step (checkpoint first); a second SIGINT
    stops at once. Handlers are restored afterwards, and only the main thread can install them."""
    stop = StopRequest()

    def handler(signum, frame):
        if stop and signum == signal.SIGINT:
            stop.second()
            return
        if not stop:
            _say(f"{signal.Signals(signum).name}: stopping after this step, with a checkpoint"
                 + ("; press Ctrl-C again to stop at once" if signum == signal.SIGINT else ""))
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
