"""P6: the study platform at scale, on a simulated multi-node Ray cluster on this machine.

    python -m benchmarks.suite --only P6 [--trials 100 300 [1000]] [--nodes 2] [--p6-profile DIR] --json FILE
    python -m benchmarks.scale [--trials 6] [--nodes 2] [--json FILE]        # the same, P6 alone

A `ray.cluster_utils.Cluster` of M worker nodes runs a generated study of N trials whose training
is near zero, through `study/run.py --address CLUSTER` as a user runs it, so Tune, Optuna, MLflow,
the snapshots and the report are the real ones. What a trial does costs next to nothing; what is
measured is everything around it. The cluster, the study, every key under "P6" -> "N" in the JSON
(driver overhead, MLflow calls, snapshots, state size, the kill and resume, the report) and how
each is measured: docs/scale.md, "How P6 measures".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "study" / "run.py"
NAME = "p6"
# a progress line of study/experiment/progress.py: "[0:12] finished train_length=6,d_model=8 #8f545 (search: ...)"
PROGRESS = re.compile(r"^\[[\d:]+\] (started|finished|stopped|FAILED)\s+(\S+) #(\S+) \(")
ENDED = ("finished", "stopped", "FAILED")
STATE_FILE = re.compile(r"^(experiment_state|search_gen_state|searcher-state|callback-states|basic-variant-state)-")


# --- the study --------------------------------------------------------------------------------
def build_spec(n: int, trial_cpus: float, concurrency: int) -> dict:
    """A study of exactly n trials: 4 cells (2 if n is not a multiple of 4, 1 if odd) x n/cells
    Optuna trials, each 2 training steps of a 1-layer model and an 8-sample evaluation."""
    grid = {"task.params.train_length": [6, 8], "model.d_model": [8, 16]}
    if n % 4:
        grid.pop("model.d_model")
    if n % 2:
        grid.pop("task.params.train_length")
    cells = math.prod(len(v) for v in grid.values())
    return {
        "name": NAME,
        "description": f"P6 scale benchmark: {n} near-zero trials",
        "task": {"name": "sparse_parity", "params": {"min_length": 2, "train_k": 2,
                                                      **({} if grid.get("task.params.train_length") else
                                                         {"train_length": 6})}},
        "base": {
            "positional": {"encoding": "learned", "ids": "random_shift", "max_position": 16},
            "model": {"n_layers": 1, "n_heads": 1, **({} if "model.d_model" in grid else {"d_model": 8})},
            "optim": {"steps": 2, "batch_size": 8, "warmup_steps": 0},
            "eval": {"lengths": [8], "ks": [1, 2], "samples_per_point": 8, "batch_size": 8, "val_samples": 8,
                     "every_steps": 2},
        },
        "grid": grid,
        "search": {"trials_per_cell": n // cells, "sampler": "tpe", "seed": 0,
                   "params": {"optim.lr": {"loguniform": [0.001, 0.01]}}},
        "objective": {"metric": "val_exact", "mode": "max"},
        "scheduler": {"type": "none"},
        "replicas": 1,
        "resources": {"workers_per_trial": 1, "cpus_per_worker": trial_cpus, "zero_stage": 0,
                      "max_concurrent_trials": concurrency, "max_failures": 1, "warm_processes": True},
        "seed": 0,
    }


# --- the cluster: a process of its own ---------------------------------------------------------
class SimulatedCluster:
    """`python benchmarks/scale.py --cluster NODES NODE_CPUS RAY_TMP` in a session of its own: a head
    (0 CPUs) and NODES worker nodes on 127.0.0.1, with Ray's temp dir under RAY_TMP. Stopped with
    SIGTERM (Cluster.shutdown), then anything still running out of RAY_TMP is killed."""

    def __init__(self, nodes: int, node_cpus: float, log: Path):
        self.tmp = tempfile.mkdtemp(prefix="p6r", dir="/tmp")  # short: Ray's socket paths are limited
        token = secrets.token_hex(32)
        # RAY_AUTH_TOKEN: Ray turns token authentication on and would otherwise write
        # ~/.ray/auth_token; the driver needs the same token to join
        self.env = {**os.environ, "RAY_TMPDIR": self.tmp, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every node on 127.0.0.1 (study/run.py)
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    # the venv's ninja first, as study/run.py does for its own Ray: trials JIT-load DeepSpeed's
                    # comm op, and a second ninja takes the first one's build log as stale and rebuilds it
                    # (in every cold trial, and again for every other user of the shared build cache)
                    "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("RAY_ADDRESS", None)
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--cluster", str(nodes), str(node_cpus), self.tmp],
            env=self.env, cwd=self.tmp, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
            start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith("address "):
            self.stop()
            raise RuntimeError(f"the simulated cluster did not start:\n{log.read_text()[-3000:]}")
        self.address = line.split()[1]
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # never let its pipe fill

    def stop(self) -> None:
        import psutil

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in psutil.process_iter(["cmdline"]):  # only what runs out of this cluster's own temp dir
            try:
                if any(self.tmp in part for part in p.info["cmdline"] or []):
                    p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def _serve_cluster(nodes: int, node_cpus: float, tmp: str) -> None:
    os.makedirs(os.path.join(tmp, "ray"), exist_ok=True)
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": os.path.join(tmp, "ray")})
    for _ in range(nodes):
        cluster.add_node(num_cpus=node_cpus)
    cluster.wait_for_nodes()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"address {cluster.address}", flush=True)
    while not stop.wait(1):
        pass
    cluster.shutdown()


# --- a driver, as a user runs it, its lines stamped as they come --------------------------------
class Driver:
    live: list[Driver] = []  # stopped with the benchmark, whatever ends it

    def __init__(self, args: list[str], cwd: Path, env: dict, log: Path, stats: Path | None = None,
                 profile: Path | None = None):
        cmd = [sys.executable, str(Path(__file__).resolve())]
        if stats is not None:
            cmd += ["--driver", str(stats)] + (["--profile", str(profile)] if profile else [])
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [*cmd, "--", str(RUN), *args] if stats is not None else [sys.executable, str(RUN), *args],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.events: list[tuple[float, str, str]] = []  # (t, event, "label #id")
        self.log = log.open("w")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        Driver.live.append(self)

    def _read(self) -> None:
        for line in self.proc.stdout:
            t = time.monotonic() - self.t0
            self.lines.append((t, line.rstrip("\n")))
            self.log.write(f"{t:9.3f} {line}")
            self.log.flush()
            m = PROGRESS.match(line)
            if m:
                self.events.append((t, m[1], f"{m[2]} #{m[3]}"))

    def ended(self) -> int:
        return sum(e in ENDED for _, e, _ in self.events)

    def wait_until(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate() or self.proc.poll() is not None:
                return predicate()
            time.sleep(0.05)
        return False

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.reader.join(timeout=30)
        self.exit_t = time.monotonic() - self.t0
        self.log.close()
        return rc

    def first(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if line.startswith(pattern)), None)

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


# --- what a finished study left ---------------------------------------------------------------
def trial_times(tune_dir: Path) -> dict[str, float]:
    """Each trial's `time_total_s` in its last result (Tune's result.json, one JSON per line), by
    trial id (its folder is cell{i}-{trial id})."""
    out = {}
    for result in sorted(tune_dir.glob("cell*-*/result.json")):
        last = None
        with result.open() as f:
            for line in f:
                if line.strip():
                    last = line
        if last:
            out[result.parent.name.split("-", 1)[1]] = float(json.loads(last).get("time_total_s", 0.0))
    return out


def _reports(result_json: Path) -> int:
    with result_json.open() as f:
        return sum(1 for line in f if line.strip())


def state_sizes(tune_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(tune_dir.iterdir())
            if p.is_file() and (STATE_FILE.match(p.name) or p.name in ("tuner.pkl", "last-complete-snapshot.json"))}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mlflow_children(db: Path) -> list[dict]:
    """The study's trial runs in the SQLite store: {trial_id, status, deleted}. Read-write, not `mode=ro`:
    a driver SIGKILLed mid-write leaves a hot journal, which only a writer may roll back."""
    with sqlite3.connect(f"file:{db}?mode=rw", uri=True, timeout=30) as con:
        rows = con.execute(
            "SELECT r.run_uuid, r.status, r.lifecycle_stage, t.value FROM runs r JOIN tags p "
            "ON p.run_uuid = r.run_uuid AND p.key = 'mlflow.parentRunId' LEFT JOIN tags t "
            "ON t.run_uuid = r.run_uuid AND t.key = 'tune.trial_id'").fetchall()
    return [{"run": r, "status": s, "deleted": stage == "deleted", "trial_id": tid} for r, s, stage, tid in rows]


def results_trials(study_dir: Path) -> int:
    import pandas as pd

    return int(pd.read_csv(study_dir / "results.csv").trial_id.nunique())


# --- one N ------------------------------------------------------------------------------------
def _driver_env(cluster: SimulatedCluster) -> dict:
    return {**cluster.env, "PYTHONUNBUFFERED": "1"}


def _args(spec_path: Path, storage: Path, cluster: SimulatedCluster, resume: bool = False) -> list[str]:
    return ["--space", str(spec_path), "--storage", str(storage), "--mlflow-uri", f"sqlite:///{storage}/mlflow.db",
            "--address", cluster.address, *(["--resume"] if resume else [])]


def _limit(n: int) -> float:
    return 900 + 15 * n  # seconds a driver may take before the benchmark gives up on it


def full_study(n: int, spec_path: Path, work: Path, cluster: SimulatedCluster, concurrency: int,
               profile_dir: Path | None) -> dict:
    storage = work / "full"
    stats_path = work / "full-driver-stats.json"
    profile = profile_dir / f"driver-{n}.prof" if profile_dir else None
    load_before = os.getloadavg()[0]
    driver = Driver(_args(spec_path, storage, cluster), work, _driver_env(cluster), work / "full-driver.log",
                    stats=stats_path, profile=profile)
    rc = driver.wait(_limit(n))
    if rc != 0:
        raise RuntimeError(f"P6 N={n}: the study exited {rc}:\n{driver.tail()}")
    study_dir = storage / NAME
    tune_dir = study_dir / "tune"
    stats = json.loads(stats_path.read_text())
    times = trial_times(tune_dir)
    t_ray = driver.first("ray: ")
    ends = [t for t, e, _ in driver.events if e in ENDED]
    wall = driver.exit_t - t_ray
    out = {
        "trials": len(times),
        "concurrency": concurrency,
        "load_avg_1m": [load_before, os.getloadavg()[0]],  # the machine's, before and after the study
        "driver_wall_s": driver.exit_t,
        "study_wall_s": wall,
        "trial_s_sum": sum(times.values()),
        "driver_overhead_ms_per_trial": 1000 * (wall - sum(times.values()) / concurrency) / n,
        "first_trial_started_s": next((t for t, e, _ in driver.events if e == "started"), None),
        "first_trial_s": ends[0] if ends else None,
    }
    if len(ends) >= 40:  # the middle half, and the first and last quarter's pace (no cold start in them)
        q1, q3 = len(ends) // 4, 3 * len(ends) // 4
        by_id = {short[-5:]: t for short, t in times.items()}
        ended = [(t, who.rsplit("#", 1)[1]) for t, e, who in driver.events if e in ENDED]
        inside = sum(by_id.get(short, 0.0) for t, short in ended[q1 + 1: q3 + 1])
        out["steady_ms_per_trial"] = 1000 * ((ends[q3] - ends[q1]) - inside / concurrency) / (q3 - q1)
        out["interval_ms_first_quarter"] = 1000 * (ends[q1] - ends[0]) / q1
        out["interval_ms_last_quarter"] = 1000 * (ends[-1] - ends[q3]) / (len(ends) - 1 - q3)
    # CPU seconds of the driver process per trial: what it did, hardly moved by a busy machine
    out["driver_cpu_ms_per_trial"] = 1000 * stats["cpu_s"] / n
    calls = stats["mlflow"]
    store_calls = stats["mlflow_store"]
    out.update({
        "mlflow_calls_per_trial": sum(c for c, _ in calls.values()) / n,
        "mlflow_s_per_trial": sum(s for _, s in calls.values()) / n,
        "mlflow_store_calls_per_trial": sum(c for c, _ in store_calls.values()) / n,
        "mlflow_by_method": {k: {"calls": c, "s": round(s, 3)} for k, (c, s) in sorted(calls.items())},
    })
    timers = stats["timers"]
    for key, names in (("snapshot", ("tune.checkpoint", "snapshots.in_storage", "snapshots.mark_complete")),
                       ("tracker", tuple(k for k in timers if k.startswith("tracker."))),
                       ("searcher", tuple(k for k in timers if k.startswith("searcher.")))):
        out[f"{key}_s_per_trial"] = sum(timers[k][1] for k in names if k in timers) / n
    out["timers"] = {k: {"calls": c, "s": round(s, 3)} for k, (c, s) in sorted(timers.items())}
    sizes = state_sizes(tune_dir)
    out.update({"state_bytes": sum(sizes.values()), "state_files": sizes, "tune_dir_bytes": dir_bytes(tune_dir)})
    children = mlflow_children(storage / "mlflow.db")
    out["mlflow_runs"] = sum(not c["deleted"] for c in children)
    # the report, rebuilt from the study folder
    report_out = work / "report"
    t0 = time.monotonic()
    rep = subprocess.run([sys.executable, "-m", "study.report", str(study_dir), "--out", str(report_out)],
                         cwd=ROOT, env=_driver_env(cluster), capture_output=True, text=True, timeout=_limit(n))
    out["report_s"] = time.monotonic() - t0
    if rep.returncode != 0:
        raise RuntimeError(f"P6 N={n}: python -m study.report exited {rep.returncode}:\n{rep.stderr[-3000:]}")
    if profile:
        out["profile_top"] = _profile_top(profile)
    return out


def resume_study(n: int, spec_path: Path, work: Path, cluster: SimulatedCluster, kill_signal: int) -> dict:
    storage = work / "resume"
    first = Driver(_args(spec_path, storage, cluster), work, _driver_env(cluster), work / "resume-killed.log")
    half = n // 2
    if not first.wait_until(lambda: first.ended() >= half, _limit(n)):
        first.wait(1)
        raise RuntimeError(f"P6 N={n}: the study to resume never reached {half} trials:\n{first.tail()}")
    os.kill(first.proc.pid, kill_signal)
    killed_rc = first.wait(120)
    ended_before = first.ended()
    started_before = {who for _, e, who in first.events if e == "started"}
    db = storage / "mlflow.db"
    finished_before = {c["trial_id"] for c in mlflow_children(db) if c["status"] == "FINISHED" and not c["deleted"]}

    stats_path = work / "resume-driver-stats.json"
    second = Driver(_args(spec_path, storage, cluster, resume=True), work, _driver_env(cluster),
                    work / "resume-resumed.log", stats=stats_path)
    rc = second.wait(_limit(n))
    if rc != 0:
        raise RuntimeError(f"P6 N={n}: the resumed study exited {rc}:\n{second.tail()}")
    started_after = [(t, who) for t, e, who in second.events if e == "started"]
    # a trial finished before the kill and run again: its result.json holds a second report (each
    # trial of this spec reports once, at its last step); one run again under a new id would show as
    # more than N trials in results.csv and MLflow
    tune_dir = storage / NAME / "tune"
    rerun = {t for t in finished_before if sum(_reports(r) for r in tune_dir.glob(f"cell*-{t}/result.json")) > 1}
    children = mlflow_children(db)
    live = [c for c in children if not c["deleted"]]
    timers = json.loads(stats_path.read_text())["timers"]
    return {
        # where the resumed driver's time to its first trial went: reading the study back (the last
        # complete snapshot put back, Tune's experiment restored), MLflow's parent found again
        "resume_restore_s": sum(timers.get(k, [0, 0.0])[1] for k in
                                ("tune.Tuner.restore", "snapshots.restore_complete_snapshot")),
        "resume_tracker_init_s": timers.get("tracker.init", [0, 0.0])[1],
        "kill_signal": signal.Signals(kill_signal).name,
        "killed_at_trials_ended": ended_before,
        "killed_driver_rc": killed_rc,
        "finished_in_mlflow_at_kill": len(finished_before),
        "resume_s": started_after[0][0] if started_after else None,
        "resume_first_new_s": next((t for t, who in started_after if who not in started_before), None),
        "resume_first_finished_s": next((t for t, e, _ in second.events if e in ENDED), None),
        "resume_ray_s": second.first("ray: "),
        "resumed_driver_wall_s": second.exit_t,
        "restarted_trials": sum(who in started_before for _, who in started_after),
        "rerun_trials": len(rerun),
        "results_trials": results_trials(storage / NAME),
        "mlflow_runs": len(live),
        "mlflow_finished": sum(c["status"] == "FINISHED" for c in live),
        "mlflow_deleted": len(children) - len(live),
        "incomplete_snapshot_note": any("last snapshot in storage was incomplete" in line for _, line in second.lines),
    }


def _profile_top(path: Path, n: int = 20) -> list[dict]:
    import pstats

    stats = pstats.Stats(str(path))
    rows = []
    for (file, line, fn), (_, calls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({fn})", "calls": calls, "tottime_s": round(tottime, 3),
                     "cumtime_s": round(cumtime, 3)})
    rows.sort(key=lambda r: -r["cumtime_s"])
    return rows[:n]


def p6_scale(trials=(100, 300), nodes: int = 2, node_cpus: float = 1.0, trial_cpus: float = 0.5,
             kill_signal: str = "SIGKILL", profile_dir: str | None = None, workdir: str | None = None,
             resume: bool = True) -> dict:
    """P6 for each N in `trials` on one simulated cluster of `nodes` worker nodes."""
    import yaml

    concurrency = max(1, int(nodes * node_cpus / trial_cpus + 1e-9))
    keep = workdir is not None
    base = Path(workdir or tempfile.mkdtemp(prefix="bench-p6-"))
    base.mkdir(parents=True, exist_ok=True)
    profile = Path(profile_dir).resolve() if profile_dir else None
    if profile:
        profile.mkdir(parents=True, exist_ok=True)
    out: dict = {"cluster": {"nodes": nodes, "node_cpus": node_cpus, "trial_cpus": trial_cpus,
                             "concurrency": concurrency, "head_cpus": 0}}
    t0 = time.monotonic()
    cluster = SimulatedCluster(nodes, node_cpus, base / "cluster.log")
    out["cluster"]["start_s"] = time.monotonic() - t0
    try:
        for n in trials:
            work = base / f"n{n}"
            work.mkdir(parents=True, exist_ok=True)
            spec_path = work / "spec.yaml"
            spec_path.write_text(yaml.safe_dump(build_spec(n, trial_cpus, concurrency), sort_keys=False))
            print(f"P6 N={n}: the study, start to end ({work})", flush=True)
            row = full_study(n, spec_path, work, cluster, concurrency, profile)
            if resume:
                print(f"P6 N={n}: killed at N/2, then --resume", flush=True)
                row.update(resume_study(n, spec_path, work, cluster, getattr(signal, kill_signal)))
            out[str(n)] = row
            print_row(n, row)
    finally:
        for driver in Driver.live:
            if driver.proc.poll() is None:
                driver.proc.kill()
        cluster.stop()
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return out


def print_row(n: int, r: dict) -> None:
    def f(key, fmt="{:.2f}"):
        v = r.get(key)
        return "-" if v is None else fmt.format(v)

    print(f"  N={n}: overhead {f('driver_overhead_ms_per_trial', '{:.0f}')} ms/trial, driver CPU "
          f"{f('driver_cpu_ms_per_trial', '{:.0f}')} ms/trial "
          f"(steady {f('steady_ms_per_trial', '{:.0f}')}; between finishes {f('interval_ms_first_quarter', '{:.0f}')} "
          f"-> {f('interval_ms_last_quarter', '{:.0f}')} ms first -> last quarter), study {f('study_wall_s', '{:.0f}')} s, "
          f"first trial {f('first_trial_s', '{:.1f}')} s; MLflow {f('mlflow_calls_per_trial', '{:.1f}')} calls "
          f"{f('mlflow_s_per_trial', '{:.3f}')} s per trial; snapshots {f('snapshot_s_per_trial', '{:.3f}')} s per trial; "
          f"state {r.get('state_bytes', 0) / 1e6:.1f} MB; report {f('report_s', '{:.1f}')} s; "
          f"resume {f('resume_s', '{:.1f}')} s (first new trial {f('resume_first_new_s', '{:.1f}')} s, "
          f"rerun {r.get('rerun_trials', '-')}, trials {r.get('results_trials', '-')}/{n})", flush=True)


def print_p6(r: dict) -> None:
    c = r["cluster"]
    print(f"P6 scale: {c['nodes']} simulated node(s) x {c['node_cpus']:g} CPU, {c['trial_cpus']:g} CPU per trial, "
          f"{c['concurrency']} at once")
    for key, row in r.items():
        if isinstance(row, dict) and key.isdigit():
            print_row(int(key), row)
    sizes = sorted(int(k) for k in r if k.isdigit())
    if len(sizes) >= 2:
        lo, hi = str(sizes[0]), str(sizes[-1])
        for key in ("driver_overhead_ms_per_trial", "driver_cpu_ms_per_trial", "mlflow_s_per_trial",
                    "snapshot_s_per_trial", "state_bytes", "resume_s", "report_s"):
            a, b = r[lo].get(key), r[hi].get(key)
            if a and b:
                print(f"  {key}: x{b / a:.2f} from N={lo} to N={hi} (N x{int(hi) / int(lo):.0f})")


# --- the driver's instruments (python benchmarks/scale.py --driver STATS -- study/run.py ...) --------
def _instrument(stats: dict) -> None:
    """Count and time, in this process, what study/run.py's driver does: MlflowClient's public
    methods (outermost calls), the tracking store's, Tune's experiment-state save, the snapshot
    read-back and one-object copy, the tracker's and searcher's hooks."""
    import functools
    import inspect

    depth = threading.local()

    def wrap(owner, attr: str, bucket: str, key: str, outermost: bool = True) -> None:
        fn = inspect.getattr_static(owner, attr)
        kind = type(fn) if isinstance(fn, (staticmethod, classmethod)) else None
        if kind is not None:
            fn = fn.__func__
        if isinstance(fn, property) or not callable(fn):
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            level = getattr(depth, bucket, 0)
            setattr(depth, bucket, level + 1)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(depth, bucket, level)
                if level == 0 or not outermost:
                    entry = stats[bucket].setdefault(key, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t0
                    stats["first_end_s"].setdefault(f"{bucket}.{key}", time.time() - stats["started"])

        setattr(owner, attr, kind(timed) if kind else timed)

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking import MlflowClient

    for name, fn in list(vars(MlflowClient).items()):
        if not name.startswith("_") and inspect.isfunction(fn):
            wrap(MlflowClient, name, "mlflow", name)
    for name, fn in list(vars(SqlAlchemyStore).items()):
        if not name.startswith("_") and inspect.isfunction(fn):
            wrap(SqlAlchemyStore, name, "mlflow_store", name)
    from ray.tune.execution.tune_controller import TuneController

    wrap(TuneController, "checkpoint", "timers", "tune.checkpoint")
    from study.experiment import snapshots

    wrap(snapshots, "in_storage", "timers", "snapshots.in_storage")
    wrap(snapshots, "mark_complete", "timers", "snapshots.mark_complete")
    from ray import tune

    from study.experiment import tuning
    from study.experiment.search import CellSearcher
    from study.record.mlflow.recorder import MlflowRecorder

    wrap(tune.Tuner, "restore", "timers", "tune.Tuner.restore")  # what --resume reads back
    wrap(tuning, "restore_complete_snapshot", "timers", "snapshots.restore_complete_snapshot")
    wrap(MlflowRecorder, "study_started", "timers", "tracker.init")  # a resume finds its runs here

    for name in ("trial_started", "trial_result", "trial_checkpoint", "trial_done", "trial_error",
                 "snapshot_stored", "reconcile", "selection", "study_finished"):
        if hasattr(MlflowRecorder, name):
            wrap(MlflowRecorder, name, "timers", f"tracker.{name}", outermost=False)
    for name in ("suggest", "on_trial_result", "on_trial_complete", "save", "restore"):
        if name in vars(CellSearcher):
            wrap(CellSearcher, name, "timers", f"searcher.{name}", outermost=False)


def _driver(stats_path: str, profile: str | None, argv: list[str]) -> None:
    import atexit
    import resource
    import runpy

    stats: dict = {"mlflow": {}, "mlflow_store": {}, "timers": {}, "first_end_s": {}, "started": time.time()}
    sys.path.insert(0, str(ROOT))
    _instrument(stats)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()

    def dump():
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        stats["ended"] = time.time()
        usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the driver, Ray's own too
        stats["cpu_s"] = usage.ru_utime + usage.ru_stime
        Path(stats_path).write_text(json.dumps(stats))

    atexit.register(dump)
    sys.argv = argv
    if profiler is not None:
        profiler.enable()
    runpy.run_path(argv[0], run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cluster"]:
        _serve_cluster(int(argv[1]), float(argv[2]), argv[3])
        return 0
    if argv[:1] == ["--driver"]:
        rest = argv[2:]
        profile = None
        if rest[:1] == ["--profile"]:
            profile, rest = rest[1], rest[2:]
        _driver(argv[1], profile, rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, nargs="+", default=[100, 300], help="a study of each size (default 100 300)")
    p.add_argument("--nodes", type=int, default=2, help="simulated worker nodes (default 2)")
    p.add_argument("--node-cpus", type=float, default=1.0, help="CPUs each simulated node declares (default 1)")
    p.add_argument("--trial-cpus", type=float, default=0.5, help="CPUs each trial asks for (default 0.5)")
    p.add_argument("--kill-signal", default="SIGKILL", choices=["SIGKILL", "SIGINT", "SIGTERM"],
                   help="what stops the driver mid-study before the resume (default SIGKILL)")
    p.add_argument("--no-resume", action="store_true", help="skip the kill-and-resume study")
    p.add_argument("--profile", help="cProfile the first study's driver into this folder")
    p.add_argument("--workdir", help="keep the studies here (default: a temporary folder, removed)")
    p.add_argument("--json", help="write {'P6': ...} here")
    args = p.parse_args(argv)
    t0 = time.time()
    result = p6_scale(args.trials, args.nodes, args.node_cpus, args.trial_cpus, args.kill_signal, args.profile,
                      args.workdir, not args.no_resume)
    result["seconds"] = time.time() - t0
    print_p6(result)
    if args.json:
        Path(args.json).write_text(json.dumps({"P6": result}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
