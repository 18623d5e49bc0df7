"""Where in the output does length generalization break? Accuracy per target position.

    python -m study.per_position search_spaces/trials/addition_coupled.yaml --set positional.id_window=null
    python -m study.per_position CONFIG.yaml --lengths 20 30 --seed 3

Trains one trial config in-process (the same loop as `python -m study.train`), then, per test length,
prints for every target position the teacher-forced accuracy (inference ids, the oracle's under
PPC) next to the largest id distance between that target's predicting token and any key it can
attend to, and the largest such distance any training sequence had. docs/coupling.md
uses it to show that full-attention coupling fails exactly where a query sees id distances that no
training sequence had.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np


def id_span(ids: np.ndarray, seq_len: np.ndarray) -> np.ndarray:
    """[B, T]: the largest |id_t - id_j| over the keys j <= t a query at t may attend to."""
    T = ids.shape[1]
    valid = np.arange(T)[None, :] < seq_len[:, None]
    diff = np.abs(ids[:, :, None] - ids[:, None, :])
    causal = np.tril(np.ones((T, T), dtype=bool))[None] & valid[:, None, :]
    return np.where(causal, diff, 0).max(axis=2)


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
    from study.spec.schema import set_path  # the dotted-path setter study specs use
    from trial.config import TrialConfig
    from trial.evaluate import with_places
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
    rng = np.random.default_rng([cfg.seed, 31337])
    train = task.sample(4096, rng)
    train_ids = pos.scheme.training_ids(train.position_ids, train.seq_len, rng, task.fixed_prefix)
    trained_span = int(id_span(train_ids, train.seq_len).max())
    print(f"{cfg.task.name} {pos.label} id_window={pos.id_window} heads={pos.id_window_heads}: "
          f"largest id distance in training {trained_span}")
    for length, k in cfg.eval_points():
        batch = with_places(task, task.sample(args.samples, rng, length=length, k=k), pos.scheme)
        ids = pos.scheme.inference_ids(batch.position_ids)
        places = None if batch.digit_places is None else torch.from_numpy(batch.digit_places[:, :-1])
        with torch.no_grad():
            logits, _, _ = model(torch.from_numpy(batch.tokens[:, :-1]), torch.from_numpy(ids[:, :-1]),
                                 digit_places=places)
        right = (logits.argmax(-1).numpy() == batch.tokens[:, 1:]) & batch.loss_mask[:, 1:]
        P, G = int(batch.prompt_len[0]), int(batch.seq_len[0] - batch.prompt_len[0])
        acc = right[:, P - 1 : P - 1 + G].mean(0)
        span = id_span(ids, batch.seq_len)[:, P - 1 : P - 1 + G].max(0)
        print(f"\nlength {length}" + (f", k {k}" if k else "") + ": target position, accuracy, id distance seen")
        for i in range(G):
            flag = "  > trained" if span[i] > trained_span else ""
            print(f"  {i:3d}  {acc[i]:.2f}  {span[i]:3d}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
