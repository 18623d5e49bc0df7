"""`python -m study.loss_gap`: the loss-gap analysis (analysis/loss_gap.py) on one trained model.

The model is a trial checkpoint, an MLflow trial run's checkpoint, or a local Hugging Face folder
(study/model_source.py). The settings are LossGapSpec's, its defaults where a flag is not given.
Writes tokens.csv, summary.csv and gap_scatter.png to --out; with --mlflow-run, also logs the
summary to that run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from pydantic import ValidationError

from analysis.hf_model import HFCausalLM, hf_tokens
from analysis.loss_gap import LossGapSpec, plot_gap, run_analysis, sample_windows, summarize_gap
from study.model_source import add_model_source, checkpoint_of, record_measurement
from trial.yaml_io import describe_errors


def parse(argv: list[str] | None) -> argparse.Namespace:
    d = LossGapSpec()
    p = argparse.ArgumentParser(prog="python -m study.loss_gap", description=__doc__.split("\n")[0])
    add_model_source(p, "a local Hugging Face causal-LM folder")
    p.add_argument("--corpus", help="text to analyse (default: the trial's corpus; stdlib for --hf)")
    p.add_argument("--long-context", type=int, help=f"L_bar (default {d.long_context})")
    p.add_argument("--short-context", type=int, help=f"L (default {d.short_context})")
    p.add_argument("--ks", help=f"comma-separated (default {','.join(map(str, d.ks))})")
    p.add_argument("--method", choices=list(LossGapSpec.model_fields["method"].annotation.__args__),
                   help=f"default {d.method}")
    p.add_argument("--targets", type=int, help=f"default {d.targets}")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled windows (default 0)")
    p.add_argument("--out", default="loss_gap_out", help="folder for tokens.csv, summary.csv, gap_scatter.png")
    return p.parse_args(argv)


def spec_of(args: argparse.Namespace) -> LossGapSpec:
    given = {k: v for k, v in vars(args).items() if k in LossGapSpec.model_fields and v is not None}
    if "ks" in given:
        given["ks"] = [int(k) for k in given["ks"].split(",")]
        if "sparse_k" not in given and LossGapSpec().sparse_k not in given["ks"]:
            given["sparse_k"] = given["ks"][0]  # the CLI reports no sparse/dense split
    return LossGapSpec(**given)


def model_and_tokens(args: argparse.Namespace, spec: LossGapSpec):
    """(model, held-out text tokens) of the chosen source; a ValueError names the flag."""
    from tasks import get_task

    if args.checkpoint:
        from trial.loop import load_trained

        trial, task, model = load_trained(args.checkpoint)
        if args.corpus:
            task = get_task("lm", corpus=args.corpus, train_length=2)
        if spec.long_context >= trial.positional.max_position:
            raise ValueError(f"--long-context {spec.long_context} is beyond the model's max_position "
                             f"{trial.positional.max_position}")
        return model, task.val_tokens
    task = get_task("lm", corpus=args.corpus or "stdlib", train_length=2)
    model = HFCausalLM(args.hf, attention=spec.method == "attention").eval()
    return model, hf_tokens(args.hf, np.asarray(task.val_tokens)[: 200 * (spec.long_context + 1) * spec.targets])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        spec = spec_of(args)
        args.checkpoint = checkpoint_of(args)
        model, tokens = model_and_tokens(args, spec)
    except (ValueError, ValidationError) as e:
        print(f"error: {describe_errors(e)}", file=sys.stderr)
        return 2
    windows = sample_windows(tokens, spec.targets, spec.long_context + 1, args.seed)
    records, timing = run_analysis(model, windows, spec)
    summary = summarize_gap(records, spec.min_gap)
    os.makedirs(args.out, exist_ok=True)
    records.to_csv(os.path.join(args.out, "tokens.csv"), index=False)
    summary.to_csv(os.path.join(args.out, "summary.csv"), index=False)
    plot_gap(records, os.path.join(args.out, "gap_scatter.png"),
             f"loss gap of {args.hf or args.checkpoint}: L_bar {spec.long_context}, L {spec.short_context}, "
             f"{len(records)} targets, {spec.method}")
    print(f"method={spec.method} L_bar={spec.long_context} L={spec.short_context} targets={spec.targets} "
          f"({timing['seconds_per_1k_targets']:.1f} s per 1000 targets)")
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    metrics = {f"recovered_{how}/k{row.k}": float(getattr(row, f"recovered_{how}"))
               for row in summary.itertuples() for how in ("median", "mean")}
    record_measurement(args, "loss_gap", metrics, {"loss_gap.method": spec.method})
    print(json.dumps({"out": args.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
