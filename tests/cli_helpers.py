"""Running the command line in a test the way a user meets it."""

from __future__ import annotations

from mhar_ablate.cli import main


def one_error(capsys, argv: list[str]) -> str:
    """Run ``mhar-ablate ARGV``: it must exit with 2 and print exactly one ``error: ...`` line, returned."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err
