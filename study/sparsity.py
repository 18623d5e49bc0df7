"""`python -m study.sparsity`: the sparsity meter (analysis/sparsity.py) on one trained model.

The model is a trial checkpoint, an MLflow trial run's checkpoint, or a local Hugging Face folder
(study/model_source.py). The settings are SparsitySpec's, its defaults where a flag is not given,
checked as a `sparsity:` section of the checkpoint's trial would be. Writes targets.csv,
summary.csv and k_hist.png to --out; with --mlflow-run, also logs the summary to that run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from pydantic import ValidationError

from analysis.sparsity import SparsitySpec, by_kind, csv_ready, plot_k, run_meter, summarize
from models.positions import PositionalScheme
from study.model_source import add_model_source, checkpoint_of, record_measurement
from trial.yaml_io import describe_errors


def parse(argv: list[str] | None) -> argparse.Namespace:
    d = SparsitySpec()
    p = argparse.ArgumentParser(prog="python -m study.sparsity", description=__doc__.split("\n")[0])
    add_model_source(p, "a local Hugging Face causal-LM folder (text; hide only)")
    p.add_argument("--corpus", help="text for --hf (default: stdlib)")
    p.add_argument("--method", choices=["occlusion", "greedy", "gain", "attention"], help=f"default {d.method}")
    p.add_argument("--ablation", choices=["auto", "resample", "hide"], help=f"default {d.ablation}")
    p.add_argument("--targets", type=int, help=f"default {d.targets}")
    p.add_argument("--k-max", type=int, help=f"default {d.k_max}")
    p.add_argument("--recover", type=float, help=f"default {d.recover}")
    p.add_argument("--draws", type=int, help=f"default {d.draws}")
    p.add_argument("--short-context", type=int, help="tokens before the target always kept "
                   "(default: 0 resample, 1 hide, 32 text)")
    p.add_argument("--long-context", type=int, help=f"text: tokens before the target (default {d.long_context})")
    p.add_argument("--length", type=int, help="synthetic: measure at this length (default: the train mix)")
    p.add_argument("--k", type=int, help="synthetic k-tasks: measure at this k")
    p.add_argument("--seed", type=int, default=0, help="seed of the targets and resampled values (default 0)")
    p.add_argument("--out", default="sparsity_out", help="folder for targets.csv, summary.csv, k_hist.png")
    return p.parse_args(argv)


def model_of(args: argparse.Namespace, spec: SparsitySpec):
    """(model, task, id scheme, text tokens or None) of the chosen source; ValueError names the flag."""
    if args.checkpoint:
        from trial.config import TrialConfig
        from trial.loop import load_trained

        trial, task, model = load_trained(args.checkpoint)
        # the same checks as a `sparsity:` section of that trial (a ValidationError)
        TrialConfig.model_validate({**trial.model_dump(), "sparsity": spec.model_dump()})
        return model, task, trial.positional.scheme, None
    from analysis.hf_model import HFCausalLM, hf_tokens
    from tasks import get_task

    if spec.ablation == "resample":
        raise ValueError("--ablation: resample needs a synthetic task; --hf measures text (hide)")
    task = get_task("lm", corpus=args.corpus or "stdlib", train_length=2)
    model = HFCausalLM(args.hf, attention=spec.method == "attention").eval()
    text = hf_tokens(args.hf, np.asarray(task.val_tokens)[: 200 * (spec.long_context + 1) * spec.targets])
    return model, task, PositionalScheme(ids="sequential"), text


def progress(done: int, total: int, seconds: float) -> None:
    left = seconds / done * (total - done)
    print(f"  {done}/{total} targets, {seconds:.0f} s, about {left:.0f} s left", file=sys.stderr, flush=True)


def write_and_print(table, info: dict, task, spec: SparsitySpec, out: str) -> None:
    summary = by_kind(table, spec.k_max)
    os.makedirs(out, exist_ok=True)
    csv_ready(table).to_csv(os.path.join(out, "targets.csv"), index=False)
    summary.to_csv(os.path.join(out, "summary.csv"), index=False)
    plot_k(table, spec.k_max, os.path.join(out, "k_hist.png"),
           f"sparsity meter on {task.name}: {spec.method}/{info['ablation']}, {len(table)} targets")
    print(f"task={task.name} method={spec.method} ablation={info['ablation']} L={info['short_context']} "
          f"k_max={spec.k_max} recover={spec.recover}: {len(table)} targets in {info['seconds']:.1f} s "
          f"({info['seconds_per_1k_targets']:.1f} s per 1000 targets)")
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    dist = table[~table.flat].k.value_counts().sort_index()
    print("k distribution (targets):", ", ".join(
        f"{'>' + str(spec.k_max) if k > spec.k_max else int(k)}: {n}" for k, n in dist.items()))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        spec = SparsitySpec(**{k: v for k, v in vars(args).items() if k in SparsitySpec.model_fields and v is not None})
        args.checkpoint = checkpoint_of(args)
        model, task, scheme, text = model_of(args, spec)
    except (ValueError, ValidationError) as e:
        print(f"error: {describe_errors(e)}", file=sys.stderr)
        return 2
    table, info = run_meter(model, task, scheme, spec, args.seed, progress=progress, text_tokens=text)
    write_and_print(table, info, task, spec, args.out)
    metrics = {k: float(v) for k, v in summarize(table, spec.k_max).items() if isinstance(v, (int, float))}
    record_measurement(args, "sparsity", metrics, {"sparsity.method": f"{spec.method}/{info['ablation']}"})
    print(json.dumps({"out": args.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
