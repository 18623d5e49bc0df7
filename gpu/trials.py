"""Several trial configs trained side by side on one GPU, each fit to a deadline: for a GPU at hand
for minutes, to try recipes a laptop takes hours over.

    python -m gpu.trials --out OUT --deadline-s 480 \\
        [--plan search_spaces/device/PLAN.yaml] [--trial NAME CONFIG [KEY=VALUE ...] ...]

Each trial (a trial config with `--set`-style overrides) runs in a process of its own; all start
together, time 200 steps while the others do, then train the most steps of their budget that fit
nine tenths of what is left (a multiple of eval.every_steps; the cosine schedule then spans those
steps), eager unless the overrides say `deepspeed.compile`. A plan file (search_spaces/device/)
names the trials. OUT gets `trials.json` (the versions; each trial's plan, final metrics and exact
match by length), `trials_progress.csv` (a row per report, as they come, so a trial stopped
at the deadline keeps its trajectory) and `trials_eval.csv`. `--shrink` rehearses it on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu.check import ROOT, ProgressFile, _merge, plan_steps, time_steps, versions

CALIBRATION_STEPS = 200
SHRUNK = {"optim": {"steps": 20, "warmup_steps": 2}, "eval": {"samples_per_point": 16, "val_samples": 16,
                                                                 "every_steps": 10}}


def trial_config(config: str, sets: list[str], shrink: bool) -> dict:
    from study.spec import overrides
    from trial.config import TrialConfig
    from trial.yaml_io import load_yaml

    raw = overrides.apply(load_yaml(config, "a trial config"), sets)
    raw.setdefault("deepspeed", {}).setdefault("compile", False)  # the calibration times the steps it plans
    if shrink:
        raw = _merge(raw, SHRUNK)
    return TrialConfig.model_validate(raw).model_dump()


def plan_trials(path: str) -> list[list[str]]:
    """A plan file's trials, `trials: {NAME: {config: CONFIG, set: [KEY=VALUE, ...]}}`, as --trial lists."""
    from trial.yaml_io import load_yaml

    trials = load_yaml(path, "a device plan").get("trials")
    if not isinstance(trials, dict) or not trials:
        raise ValueError(f"{path}: trials: give a mapping of NAME: {{config: CONFIG, set: [KEY=VALUE, ...]}}")
    out = []
    for name, t in trials.items():
        if not isinstance(t, dict) or not isinstance(t.get("config"), str) or set(t) - {"config", "set"}:
            raise ValueError(f"{path}: trials.{name}: give config (a trial config) and set (a list of KEY=VALUE)")
        out.append([str(name), t["config"], *map(str, t.get("set") or [])])
    return out


def train_one(name: str, cfg: dict, out: Path, deadline: float, shrink: bool) -> dict:
    """Calibrate beside the others, plan the steps that fit, train them, keep the records."""
    import pandas as pd

    import analysis  # noqa: F401  (registers the analyses: trial configs take their sections)
    from trial.loop import train_loop_per_worker

    full, every, warmup = cfg["optim"]["steps"], cfg["eval"]["every_steps"], cfg["optim"]["warmup_steps"]
    timed = time_steps(cfg, 4 if shrink else CALIBRATION_STEPS)
    per_step, per_report = timed["per_step_s"], timed["per_report_s"]
    fixed = timed["outside_s"] + 4 * per_report + 15
    # a tenth held back: the others were still starting while this one timed its steps
    steps = plan_steps(full, every, warmup, per_step, per_report, fixed, 0.9 * (deadline - time.time()))
    plan = {"full_steps": full, "steps": steps, "share_of_budget": steps / full, "per_step_ms": per_step * 1e3,
            "per_report_s": per_report, "fixed_s": fixed}
    print(f"{name}: {per_step * 1e3:.1f} ms a step; {steps} of {full} steps", flush=True)
    cfg = _merge(cfg, {"optim": {"steps": steps, "warmup_steps": min(warmup, steps)}})
    t0 = time.time()
    result = train_loop_per_worker(cfg, ProgressFile(out / f"{name}_progress.csv"))
    records = pd.DataFrame(result["records"])
    records.to_csv(out / f"{name}_eval.csv", index=False)
    exact = {int(n): round(float(g["exact_match"].mean()), 4) for n, g in records.groupby("length")}
    metrics = {k: v for k, v in result["metrics"].items() if isinstance(v, (int, float))}
    return {"plan": plan, "wall_s": time.time() - t0, "exact": exact, "metrics": metrics}


def run(trials: list[list[str]], out: Path, deadline_s: float, shrink: bool) -> dict:
    """Start every trial, stop what runs past the deadline, gather their files into OUT."""
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + deadline_s
    threads = str(max(1, (os.cpu_count() or 2) // max(1, len(trials))))
    report: dict = {"versions": versions(), "deadline_s": deadline_s, "trials": {}}
    print(json.dumps(report["versions"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for name, config, *sets in trials:
            command = [sys.executable, "-m", "gpu.trials", "one", name, config, *sets,
                       "--dir", tmp, "--deadline", str(deadline - 5)] + (["--shrink"] if shrink else [])
            env = {**os.environ, "OMP_NUM_THREADS": threads}
            procs[name] = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
        for name, proc in procs.items():
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = "stopped at the deadline"
            result = Path(tmp) / f"{name}.json"
            kept = json.loads(result.read_text()) if result.exists() else {}
            report["trials"][name] = {**kept, "exit": code}
        for kind in ("progress", "eval"):
            parts = [pd.read_csv(p).assign(trial=p.name[: -len(f"_{kind}.csv")])
                     for p in sorted(Path(tmp).glob(f"*_{kind}.csv")) if p.stat().st_size]
            if parts:
                pd.concat(parts).to_csv(out / f"trials_{kind}.csv", index=False)
    (out / "trials.json").write_text(json.dumps(report, indent=1, default=str))
    for name, r in report["trials"].items():
        plan = r.get("plan", {})
        print(f"{name}: exit {r['exit']}, {plan.get('steps', '?')} steps "
              f"({plan.get('per_step_ms', float('nan')):.1f} ms each), exact by length {r.get('exact', {})}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu.trials", description=__doc__.split("\n")[0])
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["one"]:  # a trial's own process
        parser.add_argument("one", help="train one trial, in the process `run` started for it")
        parser.add_argument("name", help="the trial's name")
        parser.add_argument("config", help="its trial config")
        parser.add_argument("sets", nargs="*", help="its overrides, KEY=VALUE")
        parser.add_argument("--dir", required=True, help="the folder its files go to")
        parser.add_argument("--deadline", type=float, required=True, help="the wall-clock time to be done by")
        parser.add_argument("--shrink", action="store_true", help="tiny and short, on a CPU")
        args = parser.parse_args(argv)
        cfg = trial_config(args.config, args.sets, args.shrink)
        result = train_one(args.name, cfg, Path(args.dir), args.deadline, args.shrink)
        (Path(args.dir) / f"{args.name}.json").write_text(json.dumps(result, default=str))
        return 0
    parser.add_argument("--out", required=True, help="the folder the results go to")
    parser.add_argument("--deadline-s", type=float, default=480, help="every trial done, or stopped, by then")
    parser.add_argument("--plan", help="a YAML file of trials (search_spaces/device/)")
    parser.add_argument("--trial", nargs="+", action="append", default=[], metavar="NAME CONFIG [KEY=VALUE]",
                        help="a name, a trial config and its overrides (repeatable)")
    parser.add_argument("--shrink", action="store_true", help="the same plan on a CPU, tiny and short")
    args = parser.parse_args(argv)
    try:
        args.trial = (plan_trials(args.plan) if args.plan else []) + args.trial
    except (OSError, ValueError) as e:
        from trial.yaml_io import describe_errors
        print(f"error: --plan: {describe_errors(e)}", file=sys.stderr)
        return 2
    if not args.trial:
        parser.error("give --plan or --trial")
    names = [t[0] for t in args.trial]
    bad = [t for t in args.trial if len(t) < 2 or not t[0].replace("_", "").isalnum() or names.count(t[0]) > 1]
    if bad:
        parser.error(f"--trial {' '.join(bad[0])}: give a NAME of its own (letters, digits, _) then CONFIG")
    for name, config, *sets in args.trial:  # bad input is named here, before anything trains
        try:
            trial_config(config, sets, args.shrink)
        except (OSError, ValueError) as e:
            from trial.yaml_io import describe_errors
            print(f"error: --trial {name}: {describe_errors(e)}", file=sys.stderr)
            return 2
    report = run(args.trial, Path(args.out), args.deadline_s, args.shrink)
    return 0 if all(r["exit"] == 0 for r in report["trials"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
