"""Security with real processes: a checkpoint found through an MLflow tag is read as weights only (a
pickle in it runs no code). That the embedded Ray listens on 127.0.0.1 only, and a `file:` storage
URI is the folder it names: tests/test_study.py (the study beside another Ray). The refusals of bad
flags, and `local` in any spelling: tests/test_validation_fuzz.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from test_study import ROOT, main_in_process

# --- checkpoints are weights, not programs ------------------------------------------------------------
MARKER_CODE = "open({path!r}, 'w').write('pwned')"


class RunsCode:
    """A pickle that runs code when loaded with weights_only=False."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (MARKER_CODE.format(path=str(self.marker)),)


def trial_config(zero_stage: int) -> dict:
    cfg = yaml.safe_load((ROOT / "search_spaces" / "trials" / "sparse_parity.yaml").read_text())
    cfg["optim"].update(steps=4, warmup_steps=1)
    cfg["eval"].update(every_steps=4, samples_per_point=4)
    cfg.setdefault("deepspeed", {})["zero_stage"] = zero_stage
    cfg.pop("sparsity", None)
    return cfg


def hostile_checkpoint(folder: Path, zero_stage: int, marker: Path) -> Path:
    """A checkpoint folder as a trial writes it (trial_config.json, checkpoint/*.pt) whose .pt files
    are pickles that run code."""
    from trial.config import TrialConfig

    (folder / "checkpoint").mkdir(parents=True)
    (folder / "trial_config.json").write_text(TrialConfig.model_validate(trial_config(zero_stage)).model_dump_json())
    names = (["mp_rank_00_model_states.pt"] if zero_stage < 3 else
             ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    for name in names:
        torch.save({"module": RunsCode(marker), "payload": RunsCode(marker)}, folder / "checkpoint" / name)
    (folder / "latest").write_text("checkpoint")
    return folder


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_checkpoint_that_holds_code_does_not_run_it(zero_stage, tmp_path):
    from trial.loop import load_trained

    marker = tmp_path / "pwned"
    folder = hostile_checkpoint(tmp_path / "ckpt", zero_stage, marker)
    with pytest.raises(Exception) as e:
        load_trained(str(folder))
    assert not marker.exists(), "loading the checkpoint ran the code in it"
    assert "weights" in str(e.value).lower() or "unpickl" in type(e.value).__name__.lower(), e.value
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # restored after a ZeRO-3 load


def test_a_checkpoint_an_mlflow_tag_points_to_is_read_as_weights(tmp_path, capsys):
    """The analysis CLIs follow a trial run's `checkpoint` tag: anyone who can write the tracking store
    can point it anywhere."""
    from mlflow.tracking import MlflowClient

    from study import sparsity

    marker = tmp_path / "pwned"
    folder = hostile_checkpoint(tmp_path / "planted", 0, marker)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("study"))
    client.set_tag(run.info.run_id, "checkpoint", str(folder))
    with pytest.raises(Exception):  # noqa: B017 (any refusal will do: the point is the marker below)
        sparsity.main(["--mlflow-run", run.info.run_id, "--mlflow-uri", uri, "--out", str(tmp_path / "out")])
    assert not marker.exists(), "the tagged checkpoint ran its code"


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_real_checkpoints_still_load_as_weights(zero_stage, tmp_path):
    from trial.loop import load_trained, train_loop_per_worker
    from trial.session import FolderSession

    folder = tmp_path / "ckpt"
    train_loop_per_worker(trial_config(zero_stage), FolderSession(str(folder)))
    cfg, _, model = load_trained(str(folder))
    assert cfg.deepspeed.zero_stage == zero_stage
    state = model.state_dict()
    assert state and all(torch.isfinite(v).all() for v in state.values())
    assert json.loads((folder / "trial_config.json").read_text())["deepspeed"]["zero_stage"] == zero_stage


# --- a record that outlives the cluster ---------------------------------------------------------------
def test_a_cluster_study_recording_to_sqlite_is_warned_that_the_record_dies_with_the_head(tmp_path, monkeypatch,
                                                                                         capsys):
    """On a cluster (`ray job submit` sets RAY_ADDRESS) the driver runs on the head node: the default
    SQLite record is a file there and goes away with it. Warned (the study still runs), with how to point
    --mlflow-uri at a server that outlives the cluster; a laptop's study and a tracking server are not.
    Dry runs (preflight, the spec and the plan; no Ray, no network), run.py's main in this process."""
    from study.record.mlflow.uri_checks import ephemeral_record

    spec = str(ROOT / "search_spaces" / "smoke.yaml")
    storage = str(tmp_path / "studies")
    dry = ["--space", spec, "--storage", storage, "--dry-run"]
    cluster = {"RAY_ADDRESS": "10.0.0.5:6379"}  # as under `ray job submit`
    code, _, err = main_in_process(dry, monkeypatch, capsys, env=cluster)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    for said in (f"sqlite:///{storage}/mlflow.db", "head node", "goes away", "--mlflow-uri http://",
                 "mlflow server --backend-store-uri postgresql"):
        assert said in warnings[0], warnings[0]
    code, _, err = main_in_process(dry, monkeypatch, capsys)  # the embedded Ray: the record stays on this machine
    assert code == 0 and "warning" not in err, err
    code, _, err = main_in_process([*dry, "--mlflow-uri", "http://10.0.0.9:5000"], monkeypatch, capsys, env=cluster)
    assert code == 0 and "warning" not in err, err

    # the same decision for each way of naming a cluster and a store
    bucket_default = ephemeral_record(None, "ray://head:10001", "s3://bucket/studies")
    assert f"sqlite:///{os.path.abspath('studies')}/mlflow.db" in bucket_default  # for a bucket: ./studies
    assert "head node" in ephemeral_record("sqlite:////data/mlflow.db", "auto", storage)
    for uri in ("http://mlflow.internal:5000", "https://mlflow.example.org",
                "postgresql+psycopg2://mlflow@db:5432/mlflow"):
        assert ephemeral_record(uri, "10.0.0.5:6379", storage) is None, uri
    assert ephemeral_record(None, None, storage) is None  # run.py's address for the embedded Ray
    assert ephemeral_record("sqlite:////data/mlflow.db", None, storage) is None

