"""Train one trial in this process, without Ray: `python -m study.train CONFIG.yaml [--seed S]
[--steps N] [--set KEY=VALUE ...] [--out eval.csv]`.

The same loop a study runs (trial/loop.py), with the analyses its config asks for, printing the
evaluation table. For a first look at a trial config, or to debug one, before a study runs it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import analysis  # noqa: F401  (registers the analyses: trial configs take their sections)
from study.spec import overrides as override
from trial.config import TrialConfig
from trial.limits import fits
from trial.loop import Diverged, train_loop_per_worker
from trial.yaml_io import describe_errors, load_yaml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="trial config YAML (e.g. search_spaces/trials/sparse_parity.yaml)")
    parser.add_argument("--seed", type=int, help="override the config's seed")
    parser.add_argument("--steps", type=int, help="override optim.steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="set a config field before it is validated, e.g. optim.lr=0.001, "
                             "positional.encoding=rope (repeatable; VALUE is YAML)")
    parser.add_argument("--out", help="write the evaluation table here (CSV)")
    args = parser.parse_args(argv)
    try:
        cfg = TrialConfig.model_validate(override.apply(load_yaml(args.config, "a trial config"), args.set))
        overrides = {}
        if args.seed is not None:
            overrides["seed"] = args.seed
        if args.steps is not None:  # a warm-up longer than the run is cut to it
            overrides["optim"] = {**cfg.optim.model_dump(), "steps": args.steps,
                                  "warmup_steps": min(cfg.optim.warmup_steps, max(args.steps, 1))}
        if overrides:
            cfg = TrialConfig.model_validate({**cfg.model_dump(), **overrides})
        problem = fits(cfg, gpus_per_worker=1 if torch.cuda.is_available() else 0)  # this machine's memory
        if problem:
            raise ValueError(problem)
    except (OSError, ValueError) as e:
        print(f"error: {describe_errors(e)}", file=sys.stderr)
        return 2
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):  # not after training
        print(f"error: --out: no folder {os.path.dirname(os.path.abspath(args.out))}", file=sys.stderr)
        return 2
    if args.out and os.path.isdir(args.out):
        print(f"error: --out: {args.out} is a folder; give a file name", file=sys.stderr)
        return 2
    import pandas as pd

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    try:
        result = train_loop_per_worker(cfg)
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    table = pd.DataFrame(result["records"])
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    shown = ("acc_", "exact_", "val_", "loss_in_dist", "loss_beyond", "loss_gap/", "sparsity/")
    summary = {k: round(v, 4) for k, v in result["metrics"].items() if k.startswith(shown)}
    print(summary)
    if args.out:
        table.to_csv(args.out, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
