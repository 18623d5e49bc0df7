"""Where in the output does length generalization break? Accuracy per target position.

    python -m study.per_position search_spaces/trials/addition_coupled.yaml --set positional.id_window=null
    python -m study.per_position CONFIG.yaml --lengths 20 30 --seed 3

Trains one trial config in-process (the same loop as `python -m study.train`), then, per test length,
prints for every target position the teacher-forced accuracy (inference ids, the oracle's under
PPC) next to the largest id distance between that target's predicting token and any key it can
attend to, and the largest such distance any training sequence had (analysis/per_position.py,
which a study runs after each trial with a `per_position:` section). docs/coupling.md uses it to show
that full-attention coupling fails exactly where a query sees id distances no training sequence had.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.per_position", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="trial config YAML")
    parser.add_argument("--lengths", type=int, nargs="+", help="test lengths (default: the config's)")
    parser.add_argument("--seed", type=int, help="override the config's seed")
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                        help="override a dotted field, e.g. positional.id_window=null")
    parser.add_argument("--samples", type=int, default=256, help="samples per test length and k (default 256)")
    args = parser.parse_args(argv)

    import torch
    import yaml

    import analysis  # noqa: F401  (registers the analyses: trial configs take their sections)
    from analysis.per_position import position_rows, trained_span
    from study.spec.schema import set_path  # the dotted-path setter study specs use
    from trial.config import TrialConfig
    from trial.loop import load_trained, train_loop_per_worker
    from trial.session import FolderSession
    from trial.yaml_io import describe_errors

    raw = yaml.safe_load(open(args.config))
    for item in args.set:
        path, _, value = item.partition("=")
        set_path(raw, path, yaml.safe_load(value))
    if args.seed is not None:
        raw["seed"] = args.seed
    if args.lengths:
        raw["eval"] = {**raw.get("eval", {}), "lengths": args.lengths}
    try:
        cfg = TrialConfig.model_validate(raw)
    except ValueError as e:
        print(f"error: {describe_errors(e)}", file=sys.stderr)
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")

    with tempfile.TemporaryDirectory() as folder:
        train_loop_per_worker(cfg, FolderSession(folder))
        _, task, model = load_trained(folder)

    pos = cfg.positional
    trained = trained_span(task, pos.scheme, cfg.seed)
    print(f"{cfg.task.name} {pos.label} id_window={pos.id_window} heads={pos.id_window_heads}: "
          f"largest id distance in training {trained}")
    for length, k in cfg.eval_points():
        rows = position_rows(model, task, pos.scheme, length, k, args.samples, cfg.seed, trained, torch.device("cpu"))
        print(f"\nlength {length}" + (f", k {k}" if k else "") + ": target position, accuracy, id distance seen")
        for r in rows:
            flag = "  > trained" if r["id_distance"] > trained else ""
            print(f"  {r['position']:3d}  {r['accuracy']:.2f}  {r['id_distance']:3d}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
