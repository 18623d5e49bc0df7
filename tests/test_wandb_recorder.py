"""The W&B recorder (study/record/wandb_recorder.py) records a real smoke study (real Ray, DeepSpeed,
Optuna) as offline W&B runs under the study's folder, with no network: a parent run and a run per
trial, grouped by the study, each trial's metrics over its steps, and the selection on the parent.
The runs are read back from the files wandb wrote, as a user's `wandb sync` would upload them."""

from __future__ import annotations

import inspect
import json
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_study import ENV, ROOT, SMOKE

pytest.importorskip("wandb")


def offline_env(tmp_path: Path) -> dict[str, str]:
    """wandb offline and silent, its config, cache and staging folders in tmp_path (nothing in $HOME)."""
    home = tmp_path / "wandb-home"
    return {**ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
            "WANDB_DIR": str(home / "dir"), "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
            "WANDB_ARTIFACT_DIR": str(home / "artifacts")}


def wandb_records(path: Path):
    """The records of an offline run's `run-<id>.wandb` file. This reads wandb's PRIVATE file format,
    for this test only (wandb 0.31 has no Python reader of it, and an offline run writes no
    wandb-summary.json or config.yaml): a 7-byte header (`:W&B`, magic, version), then a LevelDB-style
    log of 32 KiB blocks whose chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) hold
    protobuf `Record`s (wandb/proto/wandb_internal.proto)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def offline_runs(folder: Path) -> list[dict]:
    """Each offline run under `folder`: its id, name, group, job type, tags, config, summary (the
    last value of each top-level key), history rows, exit code and files folder."""
    runs = []
    for file in sorted(folder.glob("offline-run-*/run-*.wandb")):
        run = {"files": file.parent / "files", "config": {}, "summary": {}, "history": [], "exit_code": None}
        for r in wandb_records(file):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run.update(id=r.run.run_id, name=r.run.display_name, group=r.run.run_group,
                           job_type=r.run.job_type, tags=list(r.run.tags))
                run["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
            elif kind == "summary":
                run["summary"].update({i.key: json.loads(i.value_json) for i in r.summary.update if i.key})
            elif kind == "history":
                run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in r.history.item})
            elif kind == "exit":
                run["exit_code"] = r.exit.exit_code
        runs.append(run)
    return runs


@pytest.mark.slow
def test_a_study_recorded_by_wandb_offline_has_a_parent_and_a_run_per_trial(tmp_path):
    storage = tmp_path / "studies"
    claim = "claims=[{name: learns, cell: {train_length: 8}, at_least: 0.0}]"
    out = subprocess.run([sys.executable, str(ROOT / "study" / "run.py"), "--space",
                          str(ROOT / "search_spaces" / "smoke.yaml"), "--storage", str(storage),
                          "--recorder", "wandb", "--set", "resources.max_concurrent_trials=2", "--set", claim],
                         cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    study = storage / "smoke"
    assert f"offline runs in {study / 'wandb'}" in out.stdout, out.stdout[-2000:]
    assert not (storage / "mlflow.db").exists() and not (storage / "mlartifacts").exists()

    runs = offline_runs(study / "wandb")
    assert {r["group"] for r in runs} == {"smoke"}, "every run is grouped by its study"
    parents = [r for r in runs if r["job_type"] == "study"]
    trials = {r["config"]["trial_id"]: r for r in runs if r["job_type"] == "trial"}
    assert len(parents) == 1 and len(runs) == 1 + len(trials), [(r["name"], r["job_type"]) for r in runs]
    parent = parents[0]
    study_id = json.loads((study / "study.json").read_text())["id"]
    assert parent["name"] == "smoke" and parent["config"]["study.id"] == study_id
    assert parent["config"]["grid"] == SMOKE["grid"] and parent["exit_code"] == 0

    # one run per trial, with its config, its metrics over steps and its final status
    results = pd.read_csv(study / "results.csv", dtype={"trial_id": str}).drop_duplicates("trial_id")
    assert set(trials) == set(results.trial_id) and len(trials) == 4  # 2 cells x 2 searched trials
    metric = SMOKE["objective"]["metric"]
    for row in results.to_dict("records"):
        run = trials[row["trial_id"]]
        assert run["config"]["study.id"] == study_id and run["config"]["role"] == "search" and "search" in run["tags"]
        assert run["config"]["search"]["optim.lr"] == pytest.approx(row["search.optim.lr"])
        points = [(h["step"], h[metric]) for h in run["history"] if metric in h]
        steps = [s for s, _ in points]
        assert steps == sorted(steps) and len(steps) >= 3 and steps[-1] == SMOKE["base"]["optim"]["steps"], steps
        assert points[-1][1] == pytest.approx(row[metric]), (points, row[metric])
        assert any(h.get("eval/records/_type") == "table-file" for h in run["history"]), "no evaluation points"
        assert run["summary"]["status"] == "FINISHED" and run["exit_code"] == 0 and run["summary"]["checkpoint"]
        assert run["summary"]["host/kernels"].startswith("cpu ")

    # the selection, the claim's verdict and the report on the parent
    from study.spec.schema import load_spec

    selected = pd.read_csv(study / "selected.csv", dtype={"trial_id": str})
    summary = parent["summary"]
    assert sorted(summary["selected"]) == sorted(selected.trial_id) and len(selected) == 2  # one per cell
    index = {c.label: c.index for c in load_spec(str(ROOT / "search_spaces" / "smoke.yaml")).cells()}
    for row in selected.to_dict("records"):
        i = index[row["cell"]]
        assert summary[f"cell{i}/trial_id"] == row["trial_id"], summary
        assert summary[f"cell{i}/search.optim.lr"] == pytest.approx(row["search.optim.lr"])
        assert summary[f"cell{i}/{metric}"] == pytest.approx(row[f"{metric}_mean"])
    assert summary["claim/learns"] in ("holds", "fails", "inconclusive") and summary["claim/learns/line"]
    assert summary["status"] == "FINISHED" and "time/wall_since_ray_s" in summary
    assert (parent["files"] / "report" / "results.csv").read_bytes() == (study / "results.csv").read_bytes()


def test_wandb_is_a_recorder_choice_with_every_event_and_a_wrong_flag_exits_2(capsys):
    """`--recorder wandb` is registered, answers each of the protocol's methods with the same
    parameters; an unknown recorder, or --mlflow-uri with W&B, is refused with exit 2."""
    from study import run
    from study.record.recorder import Lookups, Recorder, recorder_class
    from study.record.wandb_recorder import WandbRecorder

    assert recorder_class("wandb") is WandbRecorder
    for name, proto in {**vars(Lookups), **vars(Recorder)}.items():
        if name.startswith("_") or not (callable(proto) or isinstance(proto, (classmethod, staticmethod))):
            continue
        ours = getattr(WandbRecorder, name)
        proto_fn = getattr(proto, "__func__", proto)
        ours_fn = getattr(ours, "__func__", ours)
        assert list(inspect.signature(ours_fn).parameters) == list(inspect.signature(proto_fn).parameters), name

    smoke = str(ROOT / "search_spaces" / "smoke.yaml")
    with pytest.raises(SystemExit) as exited:
        run.main(["--space", smoke, "--recorder", "nowhere", "--dry-run"])
    assert exited.value.code == 2 and "'wandb'" in capsys.readouterr().err
    assert run.main(["--space", smoke, "--recorder", "wandb", "--mlflow-uri", "sqlite:///x.db", "--dry-run"]) == 2
    assert "--mlflow-uri: --recorder wandb does not record to MLflow" in capsys.readouterr().err
