"""The `diloco-p2p` command line: parse, then dispatch to `diloco_p2p.commands`.

A user's mistake exits 2 with one line, no traceback.
"""

from __future__ import annotations

import argparse
import sys

from diloco_p2p.commands import COMMANDS
from diloco_p2p.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco-p2p", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    args.argv = raw[1:]  # the command's own arguments, for the train command's local-rank launches
    try:
        return args.run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
