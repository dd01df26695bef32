"""The one exception type that means "the user asked for something invalid".

The CLI turns it into a single line on stderr and exit code 2; everything else is a bug and keeps its
traceback (or is summarised under ``--debug``-less runs by the CLI's last-resort handler).
"""


class UsageError(ValueError):
    """Bad input from the user: an unknown key, a value out of range, a missing file."""


def out_of_memory_reason(e: BaseException) -> str:
    """The first sentence of a CUDA out-of-memory message (what was asked for), without its long account of
    the GPU's pools: the line a trial records and the CLI prints."""
    return (str(e).splitlines() or ["CUDA out of memory"])[0].split(". GPU")[0]
