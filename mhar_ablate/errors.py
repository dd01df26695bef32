"""The one exception type that means "the user asked for something invalid".

The CLI turns it into a single line on stderr and exit code 2; everything else is a bug and keeps its
traceback (or is summarised under ``--debug``-less runs by the CLI's last-resort handler).
"""


class UsageError(ValueError):
    """Bad input from the user: an unknown key, a value out of range, a missing file."""
