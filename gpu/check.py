"""The GPU check: everything the platform measures on a GPU, in one call of a few minutes.

    python -m gpu.check wheels [--dir .whl]     # here: the wheels a bare GPU machine lacks
    gpu/check.sh OUT [DEADLINE_S]          # there: install them, then `run`
    python -m gpu.check run --out OUT --deadline-s 530 [--shrink]

`run` does each step (the versions, P5 of benchmarks/suite.py, one smoke trial, the reference's
small configuration of coupled addition) in a process of its own with what is left of the
deadline, and writes `device.json`, the CSVs and `log.txt` to OUT; a step stopped at the deadline
keeps what it wrote. `--shrink` rehearses the same plan on a CPU (tests/test_device_check.py). The
steps, the files and what the check measured: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REFERENCE_SPEC = "search_spaces/experiments/coupling_reference_scale_small.yaml"
# Cho et al.'s headline configuration as its scripts/addition/run_coupling.sh ran it at commit 0c72d14:
# 1-30 digits, 4 heads of d_kv 128, d_ff 2048, d_model 1024, batch 1,000, a fixed set of 1M samples with
# no leading zeros, the checkpoint of lowest loss at 100 digits (val_long); tested at 2x and 3x (and 200)
HEADLINE_SPEC = "search_spaces/experiments/coupling_reference_scale.yaml"
HEADLINE = {"task": {"params": {"leading_zeros": False}, "train_set_size": 1_000_000},
            "model": {"head_dim": 128, "d_ff": 2048},
            "eval": {"lengths": [30, 60, 90, 200], "track": [60, 90], "select": {"lengths": [100]}}}
SHORT_LR = 3e-4  # the lr of a run that trains a fifth of the budget or less (the plan: ~3x 1e-4)
SHRUNK_HEADLINE = {"task": {"train_set_size": 2000},
                   "model": {"d_model": 32, "head_dim": 8, "d_ff": 64},
                   "optim": {"batch_size": 16, "steps": 40, "warmup_steps": 4},
                   "eval": {"lengths": [30, 60], "track": [60], "samples_per_point": 8, "batch_size": 8,
                            "val_samples": 8, "every_steps": 10, "track_samples": 8, "select": {"samples": 8}}}
DEFAULT_SPEC = "search_spaces/default.yaml"
STEP_CAPS_S = {"p5": 150, "smoke": 120}  # the reference gets the rest
SHRUNK_P5 = dict(d_model=64, n_layers=2, n_heads=4, seq=64, batch=4, vocab=128)
SHRUNK_REFERENCE = {"model": {"d_model": 64, "head_dim": 16, "d_ff": 128},
                    "optim": {"batch_size": 32, "steps": 40, "warmup_steps": 4},
                    "eval": {"samples_per_point": 32, "batch_size": 32, "val_samples": 32, "every_steps": 10,
                             "track_samples": 32, "select": {"samples": 32}}}


# --- the steps, each in a process of its own ---------------------------------------------------
def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    for name in ("deepspeed", "pydantic", "numpy", "pandas"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["driver"] = None
    return out


def step_p5(out: Path, shrink: bool, partial: Path) -> dict:
    """Eager first, its result kept before compiling (a compile that outlasts the deadline loses
    only the compiled figures)."""
    from benchmarks.suite import p5_gpu, print_p5

    kwargs = dict(steps=2, dims=SHRUNK_P5, device="cpu") if shrink else {}
    result = p5_gpu(compile_modes=(False,), **kwargs)
    partial.write_text(json.dumps(result, default=str))
    if "eager" in result and not shrink:  # the CPU rehearsal leaves compiling out: minutes on 2 cores
        compiled = p5_gpu(compile_modes=(True,), **kwargs)
        result["compiled"] = compiled["compiled"]
        e, c = result["eager"], result["compiled"]
        saved = 1 / e["tokens_per_s"] - 1 / c["tokens_per_s"]
        tokens = result["dims"]["batch"] * result["dims"]["seq"]
        result["compile"] = {"compile_s": c["warmup_s"] - e["warmup_s"], "speedup": c["tokens_per_s"] / e["tokens_per_s"],
                             "steps_to_repay": (c["warmup_s"] - e["warmup_s"]) / (saved * tokens) if saved > 0 else None}
    print_p5(result)
    return result


def step_smoke(out: Path, shrink: bool, partial: Path) -> dict:
    """The default study's first cell, one trial, through the command a user would run."""
    import yaml

    from study.spec.schema import load_spec

    spec = load_spec(str(ROOT / DEFAULT_SPEC))
    cell = spec.cells()[0]
    cfg = spec.trial_config(cell, {}, spec.seed)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    csv_path = out / "smoke_eval.csv"
    command = [sys.executable, "-m", "study.train", f.name, "--out", str(csv_path)]
    if shrink:
        command += ["--steps", "20"]
    t0 = time.time()
    done = subprocess.run(command, cwd=ROOT)
    os.unlink(f.name)
    rows = list(csv.DictReader(open(csv_path))) if csv_path.exists() else []
    return {"cell": cell.label, "exit": done.returncode, "wall_s": time.time() - t0, "rows": len(rows),
            "steps": 20 if shrink else cfg["optim"]["steps"]}


class ProgressFile:
    """A training loop's session that appends each report's scalars to a CSV as it comes, so a run
    stopped at the deadline keeps its trajectory; `tracked`: the lengths whose series it keeps."""

    checkpointing = False
    keys = ("step", "loss", "val_loss", "val_exact", "select/loss", "select/exact", "lr", "tokens_per_s",
            "time/train_s", "time/eval_s")

    def __init__(self, path: Path | None, tracked: list[int] | None = (10,)):
        self.path, self.reports = path, []
        self.tracked = [f"track/len{n}/{m}" for n in (tracked or []) for m in ("exact", "loss")]
        if path is not None:
            with open(path, "w") as f:
                f.write(",".join([*self.keys, *self.tracked]) + ",wall_s\n")
        self.start = time.time()

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        self.reports.append(metrics)
        if self.path is not None:
            values = [metrics.get(k, "") for k in (*self.keys, *self.tracked)] + [round(time.time() - self.start, 2)]
            with open(self.path, "a") as f:
                f.write(",".join(str(v) for v in values) + "\n")
        shown = self.tracked[0] if self.tracked else "val_exact"
        print(f"  step {metrics['step']}: loss {metrics.get('loss', float('nan')):.4g}, "
              f"val_exact {metrics.get('val_exact', float('nan')):.3f}, "
              f"{shown} {metrics.get(shown, float('nan')):.3f}", flush=True)

    def restore_dir(self):
        return contextlib.nullcontext()


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def reference_config(shrink: bool, variant: str = "reference") -> dict:
    """The trial config a deadline-fitted step trains: the reference's small configuration, or the
    headline one (`headline`, and `headline_half` at half the width and batch)."""
    from study.spec.schema import load_spec

    spec = load_spec(str(ROOT / (REFERENCE_SPEC if variant == "reference" else HEADLINE_SPEC)))
    cfg = spec.trial_config(spec.cells()[0], {}, spec.seed)
    if variant != "reference":
        cfg = _merge(cfg, HEADLINE)
    if shrink:
        cfg = _merge(cfg, SHRUNK_REFERENCE if variant == "reference" else SHRUNK_HEADLINE)
    if variant == "headline_half":  # half the width and the batch of whatever it runs at
        cfg = _merge(cfg, {"model": {"d_model": cfg["model"]["d_model"] // 2, "d_ff": cfg["model"]["d_ff"] // 2},
                           "optim": {"batch_size": cfg["optim"]["batch_size"] // 2}})
    workers = 1 if shrink else max(1, min(8, (os.cpu_count() or 2) - 2))
    cfg["deepspeed"] = {**cfg["deepspeed"], "data_workers": workers}
    if os.environ.get("DEVICE_CHECK_EAGER"):  # `run --eager`, handed down to the step's process
        cfg["deepspeed"]["compile"] = False
    return cfg


def plan_steps(full_steps: int, every: int, warmup: int, per_step_s: float, per_report_s: float,
               fixed_s: float, left_s: float) -> int:
    """The most steps (a multiple of `every`, at most the full budget, at least the warm-up) whose
    run fits `left_s`: fixed costs, then per step its share of the training and reports."""
    per = per_step_s + per_report_s / every
    fits = int((left_s - fixed_s) / per) if per > 0 else full_steps
    steps = min(full_steps, fits // every * every)
    return max(steps, warmup, every) if steps < full_steps else full_steps


def flops_per_token(cfg: dict, seq: float) -> float:
    """Training FLOPs per token of the reference model: 6 per matmul weight, plus attention's scores
    and values (head_dim x heads wide), forward and backward."""
    from trial.config import TrialConfig

    tc = TrialConfig.model_validate(cfg)
    model = tc.build_model(len(tc.task_instance.vocab))
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "pos" not in n)
    m = tc.model
    width = (m.head_dim or m.d_model // m.n_heads) * m.n_heads
    return 6 * matmul + 6 * m.n_layers * width * seq


def time_steps(cfg: dict, steps: int) -> dict:
    """Train `steps` steps of a trial config, reporting halfway and at the end, and time them: seconds
    a step, a report, and the wall outside both (start-up, the final evaluation)."""
    from trial.loop import train_loop_per_worker

    t0 = time.time()
    session = ProgressFile(None)
    train_loop_per_worker(_merge(cfg, {"optim": {"steps": steps, "warmup_steps": min(steps, cfg["optim"]["warmup_steps"])},
                                       "eval": {"every_steps": steps // 2}}), session)
    wall = time.time() - t0
    first, last = session.reports[0], session.reports[-1]
    first_step = first.get("startup/first_step_s", 0.0)  # the first report holds the start-up
    return {"per_step_s": (last["time/train_s"] - first_step) / max(1, steps - 1), "per_report_s": first["time/eval_s"],
            "outside_s": wall - last["time/train_s"] - last["time/eval_s"] + first_step}


def step_reference(out: Path, shrink: bool, partial: Path, deadline: float, variant: str = "reference") -> dict:
    """Calibrate, plan the largest budget that fits, train it, score best and last. A headline run that
    trains a fifth of its budget or less takes SHORT_LR, its schedule (1% warm-up, cosine to 10%) fitted
    to the steps it trains."""
    import pandas as pd

    import analysis  # noqa: F401  (registers the analyses: trial configs take their sections)
    from trial.loop import train_loop_per_worker

    cfg = reference_config(shrink, variant)
    full, every = cfg["optim"]["steps"], cfg["eval"]["every_steps"]
    calibration = 4 if shrink else 400
    fixed_set = cfg["task"].get("train_set_size")
    try:  # calibrated on fresh samples: a step costs the same, and the fixed set is made once, below
        timed = time_steps({**cfg, "task": {**cfg["task"], "train_set_size": None}}, calibration)
    except Exception as e:  # noqa: BLE001  a compile that fails here must not cost the measurement
        if cfg["deepspeed"].get("compile") is False:
            raise
        print(f"reference: the compiled step failed ({type(e).__name__}: {e}); going on eager", flush=True)
        cfg["deepspeed"]["compile"] = False
        timed = time_steps({**cfg, "task": {**cfg["task"], "train_set_size": None}}, calibration)
    per_step, per_report = timed["per_step_s"], timed["per_report_s"]
    fixed = timed["outside_s"] + 2 * per_report + 10 + (fixed_set or 0) * SET_SECONDS_PER_SAMPLE
    left = deadline - time.time()
    steps = plan_steps(full, every, cfg["optim"]["warmup_steps"], per_step, per_report, fixed, left)
    plan = {"full_steps": full, "steps": steps, "share_of_budget": steps / full, "calibration_steps": calibration,
            "per_step_s": per_step, "per_report_s": per_report, "fixed_s": fixed, "left_s": left}
    partial.write_text(json.dumps({"plan": plan}))
    print(f"reference: {per_step * 1e3:.2f} ms a step, {per_report:.2f} s a report, {fixed:.0f} s fixed; "
          f"{left:.0f} s left: {steps} of {full} steps ({steps / full:.0%} of the full budget)", flush=True)
    cfg["optim"] = fitted_optim(cfg["optim"], steps, full) if variant != "reference" else {**cfg["optim"], "steps": steps}
    plan["lr"] = cfg["optim"]["lr"]
    partial.write_text(json.dumps({"plan": plan}))
    t0 = time.time()
    session = ProgressFile(out / f"{variant}_progress.csv", cfg["eval"].get("track"))
    result = train_loop_per_worker(cfg, session)
    wall = time.time() - t0
    records = pd.DataFrame(result["records"])
    records.to_csv(out / f"{variant}_eval.csv", index=False)
    m = result["metrics"]
    tokens = m["tokens_per_s"] * m["time/train_s"]
    seq = 3.5 * cfg["task"]["params"]["train_length"] / 2 + 4  # a mean sample: two operands, the sum, 4 marks
    flops = flops_per_token(cfg, seq) * tokens
    train_length = cfg["task"]["params"]["train_length"]
    exact = {f"{ckpt}/{n / train_length:g}x": float(g["exact_match"].mean())
             for (ckpt, n), g in records.groupby(["checkpoint", "length"])} if "checkpoint" in records else {
        f"last/{n / train_length:g}x": float(g["exact_match"].mean()) for n, g in records.groupby("length")}
    return {"plan": plan, "compiled": cfg["deepspeed"].get("compile", "auto"), "wall_s": wall, "train_s": m["time/train_s"], "tokens": tokens, "flops": flops,
            "achieved_tflops": flops / max(m["time/train_s"], 1e-9) / 1e12, "exact": exact,
            "best_step": m.get("best/step"), "steps": steps, "config": {k: cfg[k] for k in ("model", "optim")}}


SET_SECONDS_PER_SAMPLE = 2e-5  # making a fixed training set, from above (1M samples of 1-30 digits: ~10 s here)


def fitted_optim(optim: dict, steps: int, full: int) -> dict:
    """The headline's optimizer for `steps` of its `full` budget: the schedule (1% warm-up, cosine to
    10%) over the steps it trains, and SHORT_LR where that is a fifth of the budget or less."""
    fitted = {**optim, "steps": steps, "warmup_steps": max(1, steps // 100)}
    return {**fitted, "lr": SHORT_LR} if steps <= full // 5 else fitted


def step_headline(out: Path, shrink: bool, partial: Path, deadline: float) -> dict:
    return step_reference(out, shrink, partial, deadline, "headline")


def step_headline_half(out: Path, shrink: bool, partial: Path, deadline: float) -> dict:
    return step_reference(out, shrink, partial, deadline, "headline_half")


STEPS = {"p5": step_p5, "smoke": step_smoke, "reference": step_reference, "headline": step_headline,
         "headline_half": step_headline_half}
ON_REQUEST = ("headline", "headline_half")  # each needs a call of its own: run with --only


def run_step(name: str, out: Path, shrink: bool, deadline: float) -> dict:
    """A step in a process group of its own, stopped (with whatever it started) at its share of
    the deadline; what it wrote stays."""
    cap = STEP_CAPS_S.get(name)
    timeout = deadline - time.time() if cap is None else min(cap, deadline - time.time())
    if timeout < 10:
        return {"not_run": f"the deadline: {max(0, timeout):.0f} s left"}
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / f"{name}.json"
        command = [sys.executable, "-m", "gpu.check", "step", name, "--out", str(out),
                   "--deadline", str(time.time() + timeout - 5), "--result", str(result_file)]
        if shrink:
            command.append("--shrink")
        t0 = time.time()
        proc = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            ended = "" if code == 0 else f"failed: exit {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step and its workers and commands
            proc.wait()
            ended = "stopped at the deadline"
        kept = json.loads(result_file.read_text()) if result_file.exists() else {}
    wall = time.time() - t0
    if ended.startswith("stopped"):
        return {**kept, "stopped": f"at the deadline, after {wall:.0f} s; what it wrote is kept"}
    if ended or not kept:
        return {**kept, "failed": f"{ended or 'no result'} after {wall:.0f} s (log.txt has its output)"}
    return {**kept, "step_wall_s": wall}


def run(out: Path, deadline_s: float, shrink: bool, only: list[str] | None = None) -> dict:
    start = time.time()
    deadline = start + deadline_s
    out.mkdir(parents=True, exist_ok=True)
    report = {"versions": versions(), "deadline_s": deadline_s, "shrunk": shrink}
    print(json.dumps(report["versions"]), flush=True)
    for name in STEPS:
        if (only and name not in only) or (not only and name in ON_REQUEST):
            report[name] = {"not_run": "not asked for (--only)"}
            continue
        print(f"--- {name} ({deadline - time.time():.0f} s left)", flush=True)
        report[name] = run_step(name, out, shrink, deadline)
        (out / "device.json").write_text(json.dumps(report, indent=1, default=str))
    report["wall_s"] = time.time() - start
    (out / "device.json").write_text(json.dumps(report, indent=1, default=str))
    summarize(report)
    return report


def summarize(report: dict) -> None:
    v = report["versions"]
    print(f"\n{v['device']} (driver {v['driver']}), torch {v['torch']} (CUDA {v['cuda']}), "
          f"DeepSpeed {v['deepspeed']}, Python {v['python']}, {report['wall_s']:.0f} s in all")
    p5 = report["p5"]
    for mode in ("eager", "compiled"):
        if mode in p5:
            m = p5[mode]
            print(f"P5 {mode}: {m['tokens_per_s']:.0f} tokens/s, MFU {m['mfu']:.1%} of the datasheet, "
                  f"{m['of_matmul']:.1%} of the measured matmul ({p5['matmul_tflops']:.0f} TFLOP/s)")
    if not any(mode in p5 for mode in ("eager", "compiled")):
        print(f"P5: {p5}")
    s = report["smoke"]
    print(f"smoke: {s}" if "exit" not in s else f"smoke ({s['cell']}): exit {s['exit']}, {s['rows']} evaluation rows, "
          f"{s['wall_s']:.0f} s")
    for name in ("reference", *ON_REQUEST):
        r = report[name]
        if "exact" not in r:
            print(f"{name}: {r}")
            continue
        share = r["plan"]["share_of_budget"]
        label = "reference small configuration" if name == "reference" else f"{name} configuration"
        print(f"{label}: {r['steps']} steps ({share:.0%} of its {r['plan']['full_steps']}) at lr {r['plan'].get('lr')}, "
              f"{r['wall_s']:.0f} s, {r['flops']:.2e} FLOPs, {r['achieved_tflops']:.1f} TFLOP/s in training; "
              f"best step {r['best_step']}")
        for key, value in sorted(r["exact"].items()):
            print(f"  exact {key}: {value:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu.check", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels", help="download or build the wheels the GPU machine lacks")
    w.add_argument("--dir", default=".whl", help="where the wheels go (ignored by git; carried by the device call)")
    r = sub.add_parser("run", help="the whole check (gpu/check.sh runs it there)")
    r.add_argument("--out", required=True, help="the folder the results go to")
    r.add_argument("--deadline-s", type=float, default=530, help="stop every step by then, keeping its results")
    r.add_argument("--shrink", action="store_true", help="the same plan on a CPU, tiny and short")
    r.add_argument("--only", nargs="+", choices=list(STEPS), help="run these steps only")
    r.add_argument("--eager", action="store_true", help="train the reference without torch.compile")
    s = sub.add_parser("step", help="one step of `run`, in a process of its own")
    s.add_argument("name", choices=list(STEPS), help="the step")
    s.add_argument("--out", required=True, help="the folder the results go to")
    s.add_argument("--deadline", type=float, required=True, help="the wall-clock time to be done by")
    s.add_argument("--result", required=True, help="the JSON file the step's result goes to")
    s.add_argument("--shrink", action="store_true", help="the same step on a CPU, tiny and short")
    args = parser.parse_args(argv)
    if args.command == "wheels":
        from gpu.wheels import WHEEL_LIMIT, build_wheels, unmet_requirements

        wheels = build_wheels(args.dir)
        size = sum(w.stat().st_size for w in wheels)
        for wheel in wheels:
            print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
        print(f"{size / 2**20:.1f} MiB in all (the limit is {WHEEL_LIMIT / 2**20:.0f} MiB with the tree)")
        unmet = unmet_requirements(wheels)
        for name, missing in unmet.items():
            print(f"error: {name} requires {', '.join(missing)}, which neither travels nor is on the GPU machine")
        return 2 if unmet or size > WHEEL_LIMIT else 0
    if args.command == "run":
        if args.eager:
            os.environ["DEVICE_CHECK_EAGER"] = "1"
        report = run(Path(args.out), args.deadline_s, args.shrink, args.only)
        failed = [name for name in STEPS if "failed" in report[name] or report[name].get("exit", 0) != 0]
        return 1 if failed else 0
    out = Path(args.out)
    fn = STEPS[args.name]
    result_file = Path(args.result)
    if args.name in ("reference", *ON_REQUEST):
        result = fn(out, args.shrink, result_file, args.deadline)
    else:
        result = fn(out, args.shrink, result_file)
    result_file.write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
