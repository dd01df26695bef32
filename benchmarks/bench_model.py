"""``mhar-ablate bench model`` as a stand-alone script, for a GPU machine where the package is only on the
path: the same options (``mhar_ablate.bench``), the same table and JSON rows.

    PYTHONPATH=$PWD python3 benchmarks/bench_model.py --preset paper350m --check --json /tmp/model.json

Bad options exit with code 2 and one line, as the command line does.
"""

from __future__ import annotations

import argparse
import sys

from mhar_ablate.bench.cli import add_bench_parser, cmd_bench
from mhar_ablate.errors import UsageError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_model.py")
    add_bench_parser(parser.add_subparsers(dest="command"))
    try:
        return cmd_bench(parser.parse_args(["bench", "model", *(sys.argv[1:] if argv is None else argv)]))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
