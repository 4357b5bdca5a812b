"""The ``pipeloom`` command: ``launch``, ``schedule`` and ``trace``.

Each subcommand lives in its own module and registers itself through an
``add_parser(subparsers)`` function, so this file stays a thin dispatcher.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeloom", description="Event-driven pipeline-parallel training for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from . import launch, schedule_cmd, trace_cmd

    launch.add_parser(sub)
    schedule_cmd.add_parser(sub)
    trace_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `pipeloom schedule export ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
