"""CLI: `python -m tasks list` and `python -m tasks sample TASK --length N ...` (JSON lines).

Lets a person inspect exactly what a model will see, including coupled ids and loss masks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

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
    except RecursionError:  # no parameter nests; a traceback would not say which argument
        raise TaskParamError(key, "a value nested too deeply to read") from None
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tasks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="print task names with a one-line description")
    sample = commands.add_parser("sample", help="print samples as JSON lines")
    sample.add_argument("task", help="a task name (`python -m tasks list`)")
    sample.add_argument("--length", type=int, default=None, help="fixed length (default: training distribution)")
    sample.add_argument("--k", type=int, default=None, help="fixed k (default: training distribution)")
    sample.add_argument("--count", type=int, default=1, help="how many samples (default 1)")
    sample.add_argument("--seed", type=int, default=0, help="same seed, same samples (default 0)")
    sample.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="task constructor parameter (repeatable)")
    return parser


# One call holds count x (longest sequence) tokens as arrays, then as JSON records (up to ~1 KB per
# token); far beyond this the machine runs out of memory before a line is printed, so it is refused.
MAX_SAMPLE_TOKENS = 10**6


def check_sample_args(task, args: argparse.Namespace) -> None:
    """Refuse what would fail later with a traceback or an out-of-memory kill, naming the argument."""
    if args.seed < 0:
        raise TaskParamError("seed", f"{args.seed} is negative; seeds are integers >= 0")
    if args.count < 1:
        raise TaskParamError("count", f"{args.count} is smaller than 1")
    if args.k is not None and not task.uses_k:
        raise TaskParamError("k", f"task {task.name!r} has no k axis")
    if args.length is not None:
        task.check(args.length, args.k)
    length = task.train_length if args.length is None else args.length
    longest = task.max_seq_len(length, args.k if task.uses_k else None)
    if longest * args.count > MAX_SAMPLE_TOKENS:
        if longest <= MAX_SAMPLE_TOKENS:
            param = "count"
        else:
            param = "train_length" if args.length is None else "length"
        raise TaskParamError(param, f"{args.count} sample(s) of up to {longest} tokens exceed the bound of "
                                    f"{MAX_SAMPLE_TOKENS} tokens per call (memory)")


def run_sample(args: argparse.Namespace) -> None:
    params = dict(parse_param(item) for item in args.param)
    task = get_task(args.task, **params)
    check_sample_args(task, args)
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
