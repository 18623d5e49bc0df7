"""CLI: `python -m tasks list` and `python -m tasks sample TASK --length N ...` (JSON lines).

Lets a person inspect exactly what a model will see, including coupled ids and loss masks.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

import numpy as np

from . import TASKS, TaskParamError, get_task


def parse_param(item: str) -> tuple[str, Any]:
    """`key=value`; the value is JSON when it parses (ints, bools, null), else a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise TaskParamError("param", f"expected key=value, got {item!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tasks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="print task names with a one-line description")
    sample = commands.add_parser("sample", help="print samples as JSON lines")
    sample.add_argument("task")
    sample.add_argument("--length", type=int, default=None, help="fixed length (default: training distribution)")
    sample.add_argument("--k", type=int, default=None, help="fixed k (default: training distribution)")
    sample.add_argument("--count", type=int, default=1)
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="task constructor parameter (repeatable)")
    return parser


def run_sample(args: argparse.Namespace) -> None:
    params = dict(parse_param(item) for item in args.param)
    task = get_task(args.task, **params)
    batch = task.sample(args.count, np.random.default_rng(args.seed), length=args.length, k=args.k)
    for record in task.to_records(batch):
        print(json.dumps(record))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "list":
        width = max(map(len, TASKS))
        for name, cls in TASKS.items():
            print(f"{name:<{width}}  {cls.description}")
        return 0
    try:
        run_sample(args)
    except TaskParamError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
