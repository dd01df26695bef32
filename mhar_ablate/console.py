"""What the package prints to the terminal beside its progress bars: one line that lands above the bars,
not on them."""

from __future__ import annotations

import sys


def log_line(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()

