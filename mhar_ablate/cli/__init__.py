"""The ``mhar-ablate`` command line: ``main.py`` parses and dispatches; ``eval.py`` is ``mhar-ablate eval``."""

from .main import main

__all__ = ["main"]
