"""The GPU check (gpu/check.py, gpu/check.sh), rehearsed on this CPU so that a
GPU call, minutes long and rarely at hand, never finds a broken script: the wheels it carries, its
plan shrunk to a few steps with the study level's packages absent (as on the GPU machine), and its
deadline."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu import check as device
from gpu import wheels as device_wheels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> list[Path]:
    return device_wheels.build_wheels(str(tmp_path_factory.mktemp("whl")))


def test_the_wheels_fit_the_transfer_and_need_nothing_the_gpu_machine_lacks(wheels, tmp_path):
    names = {device_wheels.normalized_name(w.name.split("-")[0]) for w in wheels}
    assert names == {device_wheels.normalized_name(n) for n in device_wheels.CARRIED}
    assert sum(w.stat().st_size for w in wheels) < device_wheels.WHEEL_LIMIT / 4  # the tree travels too
    assert device_wheels.unmet_requirements(wheels) == {}
    # they install for the GPU machine's Python (its tags, not this machine's)
    platforms = [a for p in device_wheels.PLATFORMS for a in ("--platform", p)]
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps",
                           "--only-binary=:all:", "--python-version", device_wheels.DEVICE_PYTHON, "--implementation", "cp",
                           *platforms, "--target", str(tmp_path / "site"), *map(str, wheels)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_wheel_that_needs_a_package_nobody_carries_is_named(wheels, monkeypatch):
    monkeypatch.setattr(device_wheels, "ON_DEVICE", device_wheels.ON_DEVICE - {"py-cpuinfo"})
    deepspeed = next(w.name for w in wheels if w.name.startswith("deepspeed-"))
    assert device_wheels.unmet_requirements(wheels) == {deepspeed: ["py-cpuinfo"]}


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_the_shrunk_plan_runs_every_step_without_the_study_levels_packages(tmp_path):
    """The whole script on CPU, Ray, MLflow and Optuna made unimportable as on the GPU machine."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text("import sys\nfor m in ('ray', 'mlflow', 'optuna'):\n"
                                            "    sys.modules[m] = None\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(block), "WHEELS": str(tmp_path / "none"), "PYTHON": sys.executable}
    done = subprocess.run([str(ROOT / "gpu" / "check.sh"), str(out), "300", "--shrink"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads((out / "device.json").read_text())
    assert report["p5"]["eager"]["tokens_per_s"] > 0 and "matmul_tflops" in report["p5"]
    assert report["smoke"]["exit"] == 0 and report["smoke"]["rows"] == 24  # 4 lengths x 6 k_test
    exact = report["reference"]["exact"]
    assert set(exact) == {f"{c}/{x}x" for c in ("best", "last") for x in ("1", "1.6", "2")}
    assert report["reference"]["plan"]["steps"] == report["reference"]["plan"]["full_steps"]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["device.json", "log.txt", "reference_eval.csv", "reference_progress.csv", "smoke_eval.csv"]
    progress = (out / "reference_progress.csv").read_text().splitlines()
    assert len(progress) == 1 + 4  # a header, then a report every 10 of 40 steps
    assert "reference small configuration: 40 steps" in (out / "log.txt").read_text()


def test_a_deadline_already_spent_runs_nothing_and_still_writes_the_report(tmp_path):
    t0 = time.time()
    report = device.run(tmp_path, deadline_s=5, shrink=True)
    assert time.time() - t0 < 30
    assert all("not_run" in report[name] for name in device.STEPS)
    assert json.loads((tmp_path / "device.json").read_text())["deadline_s"] == 5


@pytest.mark.parametrize("left_s, expected", [(1e6, 50000), (300, 25000), (30, 1000), (100, 7000)])
def test_the_budget_is_the_largest_that_fits_what_is_left(left_s, expected):
    # 10 ms a step, 1 s a report every 1,000 steps, 20 s fixed: 11 s per 1,000 steps
    steps = device.plan_steps(50000, 1000, 500, per_step_s=0.010, per_report_s=1.0, fixed_s=20, left_s=left_s)
    assert steps == expected
    assert steps % 1000 == 0 and 500 <= steps <= 50000


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_the_headline_plan_and_its_half_width_rehearse_on_cpu(tmp_path):
    """Cho et al.'s headline configuration (1-30 digits, a fixed set, no leading zeros, the best step by
    its loss at 100 digits) and its half-width variant, each fit to the deadline, shrunk."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "gpu.check", "run", "--out", str(out), "--deadline-s", "400",
                           "--shrink", "--only", "headline", "headline_half"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads((out / "device.json").read_text())
    for name in ("headline", "headline_half"):
        r = report[name]
        assert set(r["exact"]) == {f"{c}/{x}x" for c in ("best", "last") for x in ("1", "2")}, r
        assert r["plan"]["share_of_budget"] == 1.0 and r["plan"]["lr"] == 1e-4  # the whole (shrunk) budget
        assert (out / f"{name}_progress.csv").read_text().splitlines()[0].endswith("track/len60/loss,wall_s")
    assert report["headline_half"]["config"]["model"]["d_model"] * 2 == report["headline"]["config"]["model"]["d_model"]
    assert report["p5"] == {"not_run": "not asked for (--only)"}


def test_a_headline_run_of_a_fifth_of_its_steps_or_fewer_trains_at_the_higher_lr():
    optim = {"lr": 1e-4, "steps": 50_000, "warmup_steps": 500}
    assert device.fitted_optim(optim, 10_000, 50_000) == {"lr": 3e-4, "steps": 10_000, "warmup_steps": 100}
    assert device.fitted_optim(optim, 10_001, 50_000) == {"lr": 1e-4, "steps": 10_001, "warmup_steps": 100}
    assert device.fitted_optim(optim, 50_000, 50_000)["lr"] == 1e-4
