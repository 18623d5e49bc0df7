"""What a trial holds in memory, estimated from its config (trial/limits.py's `estimate`), is checked
against the memory it is given before anything starts: a spec or trial config whose trial cannot fit
exits 2 in seconds with one line naming the field and the estimate, and every shipped spec and trial
config still fits. Driven like tests/test_size_bounds.py: the CLIs' `main` in-process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_study import ENV

from study import run as run_cli
from study import train as train_cli
from study.spec.schema import StudySpec, load_spec
from trial.config import TrialConfig, load_trial_config
from trial.limits import MAX_GPU_BYTES, MAX_NODE_BYTES, GiB, estimate, fits, memory_given, pieces

ROOT = Path(__file__).resolve().parents[1]
SMOKE = yaml.safe_load((ROOT / "search_spaces" / "smoke.yaml").read_text())
TRIAL = yaml.safe_load((ROOT / "search_spaces" / "trials" / "sparse_parity.yaml").read_text())


def spec_with(**base) -> dict:
    spec = yaml.safe_load(yaml.safe_dump(SMOKE))
    for group, values in base.items():
        spec["base"].setdefault(group, {}).update(values)
    return spec


def dry_run(tmp_path: Path, spec: dict, capsys, *flags: str) -> tuple[int, str, float]:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    storage = tmp_path / "storage"
    start = time.perf_counter()
    code = run_cli.main(["--space", str(path), "--storage", str(storage), "--dry-run", *flags])
    seconds = time.perf_counter() - start
    assert not storage.exists()
    return code, capsys.readouterr().err, seconds


def refused(code: int, err: str, *named: str) -> str:
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in named:
        assert text in err, (text, err)
    return err


# --- the spec: each field within its bound, together beyond any machine ----------------------
def test_a_spec_whose_trial_cannot_fit_any_machine_is_refused_in_seconds(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = spec_with(positional={"max_position": 1_000_000},
                     eval={"lengths": [10, 900_000], "samples_per_point": 10_000_000, "batch_size": 1_048_576})
    for flags in ((), ("--address", "127.0.0.1:6379")):  # this machine, and a cluster's largest node
        code, err, seconds = dry_run(tmp_path, spec, capsys, *flags)
        refused(code, err, "eval.batch_size: a trial would hold about", "GiB per worker", "1048576 sequences",
                "eval.lengths 900000")
        assert seconds < 30, seconds
    assert "the largest node targeted" in err


def test_a_trial_beyond_this_machine_but_within_a_node_is_refused_here_only(tmp_path, capsys, monkeypatch):
    """The embedded Ray runs the trials on this machine, whose memory bounds them; joining a cluster,
    the largest node this platform targets does (MAX_NODE_BYTES)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    here, _ = memory_given()
    one = spec_with(positional={"max_position": 128}, eval={"lengths": [8, 100], "batch_size": 1})
    study = StudySpec.model_validate(one)
    cfg = TrialConfig.model_validate(study.trial_config(study.cells()[0], {"optim.lr": 0.001}, 0))
    per_sequence = next(p.bytes for p in pieces(cfg) if p.field == "eval.batch_size")
    batch = 2 * here // per_sequence  # about twice this machine's memory
    spec = spec_with(positional={"max_position": 128}, eval={"lengths": [8, 100], "batch_size": batch})
    assert 2 * here < MAX_NODE_BYTES
    code, err, _ = dry_run(tmp_path, spec, capsys)
    refused(code, err, "eval.batch_size:", "this machine's memory")
    code, err, _ = dry_run(tmp_path, spec, capsys, "--address", "127.0.0.1:6379")
    assert code == 0, err


@pytest.mark.parametrize("field,value,named", [
    ("long_context", 2**21, "loss_gap.long_context"), ("targets", 10**8, "loss_gap.targets"),
    ("rows_per_batch", 2**21, "loss_gap.rows_per_batch")])
def test_loss_gap_sizes_have_upper_bounds(field, value, named, tmp_path, capsys):
    trial = yaml.safe_load((ROOT / "search_spaces" / "trials" / "lm_stdlib.yaml").read_text())
    trial.setdefault("loss_gap", {})[field] = value
    path = tmp_path / "trial.yaml"
    path.write_text(yaml.safe_dump(trial))
    code = train_cli.main([str(path), "--out", str(tmp_path / "missing" / "eval.csv")])
    refused(code, capsys.readouterr().err, named, "less than or equal to")


def test_loss_gap_sizes_that_add_up_beyond_the_machine_are_refused_naming_the_field(tmp_path, capsys):
    """Each within its bound, together one forward batch of 64k windows of 4k tokens."""
    trial = yaml.safe_load((ROOT / "search_spaces" / "trials" / "lm_stdlib.yaml").read_text())
    trial["positional"]["max_position"] = 4096
    trial["loss_gap"].update(long_context=4000, rows_per_batch=65536)
    path = tmp_path / "trial.yaml"
    path.write_text(yaml.safe_dump(trial))
    code = train_cli.main([str(path), "--out", str(tmp_path / "missing" / "eval.csv")])
    err = refused(code, capsys.readouterr().err, "loss_gap.rows_per_batch: a trial would hold about",
                  "this machine's memory")
    assert "--out" not in err  # refused before the run's own checks


def test_study_train_refuses_a_trial_this_machine_cannot_hold(tmp_path, capsys):
    trial = yaml.safe_load(yaml.safe_dump(TRIAL))
    trial["optim"]["batch_size"] = 2**20  # within MAX_BATCH; a training step of 2^20 sequences
    path = tmp_path / "trial.yaml"
    path.write_text(yaml.safe_dump(trial))
    start = time.perf_counter()
    code = train_cli.main([str(path), "--out", str(tmp_path / "missing" / "eval.csv")])
    refused(code, capsys.readouterr().err, "optim.batch_size: a trial would hold about", "a training step")
    assert time.perf_counter() - start < 30


def test_a_gpu_worker_is_given_one_gpu_or_its_share():
    assert memory_given(1, on_this_machine=False)[0] == MAX_GPU_BYTES
    assert memory_given(0.5, on_this_machine=False)[0] == MAX_GPU_BYTES // 2
    assert memory_given(0, 4, on_this_machine=False)[0] == MAX_NODE_BYTES  # a cluster: each node its own
    here, _ = memory_given(0, 1)
    assert memory_given(0, 2)[0] == here // 2  # the embedded Ray: the workers share this machine


# --- what still fits: every shipped spec and trial config ------------------------------------------------
SPECS = sorted([*(ROOT / "search_spaces").glob("*.yaml"), *(ROOT / "search_spaces" / "experiments").glob("*.yaml")])
TRIALS = sorted((ROOT / "search_spaces" / "trials").glob("*.yaml"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_shipped_spec_fits_where_it_runs(path):
    """On this machine where it runs here (no GPU asked), else on the largest machine targeted."""
    spec = load_spec(str(path), here=not yaml.safe_load(path.read_text()).get("resources", {}).get(
        "gpus_per_worker"))
    assert spec.cells()


@pytest.mark.parametrize("path", TRIALS, ids=lambda p: p.stem)
def test_every_shipped_trial_config_fits_this_machine(path):
    assert fits(load_trial_config(str(path))) is None


# --- the estimate is from above: a trial's measured peak stays under it ----------------------------------
PEAK = """
import resource, sys
from study import train
code = train.main([sys.argv[1]])
print("peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)
sys.exit(code)
"""


@pytest.mark.slow
@pytest.mark.parametrize("what", ["evaluation", "training"])
def test_a_trials_peak_memory_stays_under_its_estimate(what, tmp_path):
    trial = yaml.safe_load(yaml.safe_dump(TRIAL))
    trial["positional"]["max_position"] = 512
    trial["optim"].update(steps=2, warmup_steps=1)
    if what == "evaluation":  # sequences of 400 tokens, 256 at a time
        trial["eval"].update(lengths=[400], ks=[2], samples_per_point=256, batch_size=256, val_samples=64)
    else:  # 128 sequences of about 300 tokens per step through 4 layers
        trial["task"]["params"].update(train_length=300, min_length=290)
        trial["model"]["n_layers"] = 4
        trial["optim"]["batch_size"] = 128
        trial["eval"].update(lengths=[300], ks=[2], samples_per_point=16, batch_size=16, val_samples=16)
    path = tmp_path / "trial.yaml"
    path.write_text(yaml.safe_dump(trial))
    total, counted = estimate(load_trial_config(str(path)))
    assert counted[0].field == ("eval.batch_size" if what == "evaluation" else "optim.batch_size")
    out = subprocess.run([sys.executable, "-c", PEAK, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    peak = int(out.stdout.split("peak ")[-1])
    assert peak < total, (peak / GiB, total / GiB)


# --- a fraction of a CPU ----------------------------------------------------------------------------------
@pytest.mark.slow  # a real Ray started: the whole suite's
def test_a_fractional_cpu_share_is_accepted_because_ray_schedules_it(tmp_path, capsys, monkeypatch):
    """`resources.cpus_per_worker: 1.5` is kept: Ray takes fractional CPU requests above 1 too (to
    0.0001), and runs a task asking 1.5 CPUs on a Ray of 2; a spec asking it is accepted."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = ("import ray\nray.init(address='local', num_cpus=2, include_dashboard=False)\n"
            "print('RAN', ray.get(ray.remote(num_cpus=1.5)(lambda: 7).remote()))\nray.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert "RAN 7" in out.stdout, out.stderr[-3000:]
    spec = yaml.safe_load(yaml.safe_dump(SMOKE))
    spec["resources"]["cpus_per_worker"] = 1.5
    assert dry_run(tmp_path, spec, capsys)[0] == 0
