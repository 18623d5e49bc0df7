"""What a study records and where: a quote in a path, a study
without (or with a corrupt) study.json or driver.lock, same-name studies' artifacts, a deleted experiment, `--mlflow-uri databricks`. Real MLflow (SQLite);
run.py's `main` in-process where nothing may start (a tripwire in place of the study, as in
tests/test_validation_fuzz.py). The same end to end, real Ray and Optuna: tests/test_records.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_study import ROOT

from study import run as run_cli

SMOKE = str(ROOT / "search_spaces" / "smoke.yaml")


@pytest.fixture
def no_study_starts(monkeypatch):
    """A tripwire in place of the study: reaching it means the input was not refused before Ray."""
    from study.experiment import tuning

    def tripwire(*args, **kwargs):
        raise AssertionError("the study started: the input was not refused")

    monkeypatch.setattr(tuning, "run_study", tripwire)
    monkeypatch.setattr(tuning, "start_ray", tripwire)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def refused(argv: list[str], capsys, named: str) -> str:
    """run.py's main on `argv` exits 2 with one `error:` line naming `named`; returns the line."""
    code = run_cli.main(["--space", SMOKE, *argv])
    out, err = capsys.readouterr()
    assert code == 2, f"accepted: {argv}\n{out[-2000:]}\n{err[-2000:]}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert named in lines[0], (named, err)
    return lines[0] + out


def tracker(tmp_path: Path, location: str, artifacts: str, uri: str | None = None):
    """The MLflow recorder (no Ray needed to make one) of the smoke spec for a study at `location`,
    its study started."""
    from study.record.identity import StudyIdentity
    from study.record.mlflow.recorder import MlflowRecorder
    from study.spec.schema import load_spec

    spec = load_spec(SMOKE)
    ident = StudyIdentity(f"{abs(hash((location, artifacts))):032x}", location, "2026-01-01T00:00:00+00:00",
                          spec.model_dump(mode="json"))
    recorder = MlflowRecorder(spec, uri or f"sqlite:///{tmp_path}/mlflow.db", location, ident, artifacts)
    recorder.study_started()
    return recorder


# --- 1. a quote in a path ------------------------------------------------------------------------------
@pytest.mark.parametrize("folder", ["o'neil", 'say "hi"', "o'neil \"the\" 2nd"])
def test_a_quote_in_the_study_location_finds_its_own_parent_again(tmp_path, folder):
    """MLflow's filter strings take a literal's text between its quotes as it is (no escapes): the
    study's location once went in unescaped, and a quote in it ended the study in a traceback."""
    location = str(tmp_path / folder / "studies" / "smoke")
    artifacts = str(tmp_path / folder / "studies" / "mlartifacts" / "smoke")
    first = tracker(tmp_path, location, artifacts)
    again = tracker(tmp_path, location, artifacts)  # a resume finds the same parent
    assert again.parent_id == first.parent_id
    parent = first.client.get_run(first.parent_id)
    assert parent.data.tags["study.location"] == location


# --- 2. identity never by name alone ---------------------------------------------------------------------
def test_a_tracker_without_an_identity_never_adopts_another_studys_parent(tmp_path):
    from study.record.mlflow.recorder import MlflowRecorder
    from study.spec.schema import load_spec

    other = tracker(tmp_path, str(tmp_path / "a" / "smoke"), str(tmp_path / "a" / "mlartifacts" / "smoke"))
    other.client.set_terminated(other.parent_id, "FAILED")
    before = other.client.get_run(other.parent_id)
    anonymous = MlflowRecorder(load_spec(SMOKE), f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "a" / "smoke"),
                               None, str(tmp_path / "a" / "mlartifacts" / "smoke"))
    anonymous.study_started()
    assert anonymous.parent_id != other.parent_id
    after = other.client.get_run(other.parent_id)
    assert (after.info.status, after.data.tags) == (before.info.status, before.data.tags)


def made_before_study_ids(storage: Path) -> Path:
    """A study folder as a study made before study ids left it: Tune's folder and no study.json."""
    folder = storage / "smoke"
    (folder / "tune").mkdir(parents=True)
    return folder


def test_resume_of_a_study_without_study_json_is_refused(tmp_path, capsys, monkeypatch, no_study_starts):
    monkeypatch.chdir(tmp_path)
    folder = made_before_study_ids(tmp_path / "studies")
    line = refused(["--storage", str(tmp_path / "studies"), "--resume"], capsys, str(folder / "study.json"))
    assert "never matched by name" in line, line


@pytest.mark.parametrize("text", ["{\"id\": \"abc\", \"locat", "[1, 2]", "{\"id\": 3}", "\x00\xff"])
def test_resume_of_a_study_with_a_corrupt_study_json_is_refused(tmp_path, capsys, monkeypatch, no_study_starts,
                                                                 text):
    monkeypatch.chdir(tmp_path)
    folder = made_before_study_ids(tmp_path / "studies")
    (folder / "study.json").write_bytes(text.encode("latin-1"))
    refused(["--storage", str(tmp_path / "studies"), "--resume"], capsys, str(folder / "study.json"))
    assert (folder / "study.json").read_bytes() == text.encode("latin-1")  # nothing recorded is lost


@pytest.mark.parametrize("text", ["{\"host\": \"h\", \"pi", "[1, 2]", "\"a lock\"", "\x00\xff"])
def test_a_corrupt_driver_lock_is_refused(tmp_path, capsys, monkeypatch, no_study_starts, text):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "studies" / "smoke"
    folder.mkdir(parents=True)
    (folder / "driver.lock").write_bytes(text.encode("latin-1"))
    refused(["--storage", str(tmp_path / "studies")], capsys, str(folder / "driver.lock"))
    assert (folder / "driver.lock").read_bytes() == text.encode("latin-1")
    assert not (folder / "tune").exists()


# --- 10a. databricks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("uri", ["databricks", "databricks://my-profile", "Databricks"])
def test_databricks_is_a_tracking_uri_not_a_file_store(uri, tmp_path, capsys, monkeypatch):
    from study.record.mlflow.uri_checks import check_mlflow_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert check_mlflow_uri(uri, network=True) is None  # and nothing is contacted
    code = run_cli.main(["--space", SMOKE, "--storage", str(tmp_path / "studies"), "--mlflow-uri", uri, "--dry-run"])
    assert code == 0, capsys.readouterr().err


# --- 5. one artifact location per study ------------------------------------------------------------------
def test_same_name_studies_keep_their_artifacts_under_their_own_storage(tmp_path):
    a = tracker(tmp_path, str(tmp_path / "a" / "smoke"), str(tmp_path / "a" / "mlartifacts" / "smoke"))
    b = tracker(tmp_path, str(tmp_path / "b" / "smoke"), str(tmp_path / "b" / "mlartifacts" / "smoke"))
    (tmp_path / "note.txt").write_text("b's")
    b.client.log_artifact(b.parent_id, str(tmp_path / "note.txt"))
    uri_a = a.client.get_run(a.parent_id).info.artifact_uri
    uri_b = b.client.get_run(b.parent_id).info.artifact_uri
    assert uri_a.startswith(str(tmp_path / "a" / "mlartifacts")), uri_a
    assert uri_b.startswith(str(tmp_path / "b" / "mlartifacts")), uri_b
    assert list((tmp_path / "b" / "mlartifacts").rglob("note.txt")) and not list(tmp_path.glob("a/**/note.txt"))
    # the second study is found again (a resume) where it recorded, and so is the first
    assert tracker(tmp_path, str(tmp_path / "b" / "smoke"), str(tmp_path / "b" / "mlartifacts" / "smoke")
                   ).parent_id == b.parent_id
    assert tracker(tmp_path, str(tmp_path / "a" / "smoke"), str(tmp_path / "a" / "mlartifacts" / "smoke")
                   ).parent_id == a.parent_id


def test_a_deleted_experiment_of_the_name_is_refused_before_ray(tmp_path, capsys, monkeypatch, no_study_starts):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    storage = tmp_path / "studies"
    storage.mkdir()
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    client.delete_experiment(client.create_experiment("smoke", artifact_location=str(storage / "mlartifacts")))
    capsys.readouterr()  # MLflow's own log lines of making the store
    line = refused(["--storage", str(storage)], capsys, "experiment 'smoke'")
    assert "deleted" in line and "restore" in line, line


# --- end to end: a quote in the storage path, its resume, a second storage, one MLflow store: the studies
# of tests/test_records.py's test_two_studies_of_one_name_never_touch_each_others_record_and_reports_are_whole


def test_resume_of_a_study_whose_experiment_was_deleted_is_refused(tmp_path, capsys, monkeypatch, no_study_starts):
    from study.record import identity as ident
    from study.spec.schema import load_spec

    monkeypatch.chdir(tmp_path)
    storage = tmp_path / "studies"
    first = tracker(tmp_path, str(storage / "smoke"), str(storage / "mlartifacts" / "smoke"),
                    uri=f"sqlite:///{storage}/mlflow.db")
    stored = ident.create(load_spec(SMOKE), str(storage / "smoke"))
    (storage / "smoke" / "tune").mkdir()
    first.client.set_tag(first.parent_id, "study.id", stored.id)  # the parent of the study in that folder
    first.client.delete_experiment(first.experiment_id)
    capsys.readouterr()
    line = refused(["--storage", str(storage), "--resume"], capsys, "experiment 'smoke'")
    assert "deleted" in line and "restore" in line, line


def test_a_result_recorded_again_after_its_answer_was_lost_is_one_point_per_step(tmp_path):
    """MLflow stopped after it took a batch but before it answered (a server killed mid-request): the
    backlog replays that result. It keeps its event's timestamp, so MLflow's store keeps one point,
    not two at the same step (a real SQLite store; the lost answer is the replay of a taken entry)."""
    import time
    from types import SimpleNamespace

    from study.experiment.recording import trial_info
    from study.experiment.search import CellSearcher
    from study.record.mlflow.recorder import MlflowRecorder

    t = tracker(tmp_path, str(tmp_path / "studies" / "smoke"), str(tmp_path / "studies" / "mlartifacts" / "smoke"))
    config = CellSearcher(t.spec, {"workers_per_trial": 1}).suggest("t0")
    trial = trial_info(SimpleNamespace(trial_id="abc_00000", config=config))
    # a backlog entry as the event holds it: the event, its arguments, when it happened
    held = (MlflowRecorder.trial_result.__wrapped__, (trial, {"step": 20, "val_loss": 0.5}), {}, time.time())
    for _ in range(2):  # taken, then replayed because its answer was lost
        t.backlog.append(held)
        t.flush()
        time.sleep(0.01)
    history = t.client.get_metric_history(t.children[trial.trial_id], "val_loss")
    assert [(m.step, m.value) for m in history] == [(20, 0.5)]
