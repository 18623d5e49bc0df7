"""Nothing lost, nothing mixed, nobody in: a FIFO or an undecodable path given as a flag, `--set`
values read as strictly as the file, and a trial reopened on `--resume` that no longer carries what
ended its last attempt. Real MLflow (SQLite); run.py's `main` in-process where nothing may start."""

from __future__ import annotations

import os

import pytest
from test_review_records import no_study_starts, tracker  # noqa: F401  (a fixture)

from study import run as run_cli
from study.record.recorder import TrialInfo


def refused(argv: list[str], capsys, named: str) -> str:
    code = run_cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert named in err, (named, err)
    return err


@pytest.mark.parametrize("flag", ["--space", "--cluster"])
def test_a_fifo_given_as_a_file_is_refused_at_once(flag, tmp_path, capsys, no_study_starts):  # noqa: F811
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    argv = ["--dry-run", flag, str(fifo)]
    refused(argv, capsys, f"{fifo}: not a regular file")


def test_a_storage_path_that_is_not_utf8_is_refused_naming_the_flag(tmp_path, capsys, no_study_starts):  # noqa: F811
    bad = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xffname")
    refused(["--storage", bad], capsys, "--storage: not valid UTF-8")
    assert not os.path.exists(os.fsencode(bad))


@pytest.mark.parametrize("value, named", [
    ("name=&a [*a, *a]", "--set name:1:5: alias *a is inside the collection &a"),
    ("name=" + "[" * 5000, "--set name:1:"),
    ("base.optim.steps=" + "9" * 5000, "--set base.optim.steps: a value YAML cannot read"),
    ("base.optim.steps=" + "9" * 40, "--set base.optim.steps: 99999999999999999999... is a 40-digit number"),
    ("grid={a: 1, a: 2}", "--set grid:1:"),
])
def test_set_values_are_read_as_strictly_as_the_file(value, named, capsys, no_study_starts):  # noqa: F811
    refused(["--dry-run", "--set", value], capsys, named)


def test_a_trial_reopened_on_resume_no_longer_carries_its_error(tmp_path):
    location, artifacts = str(tmp_path / "studies" / "smoke"), str(tmp_path / "studies" / "mlartifacts" / "smoke")
    first = tracker(tmp_path, location, artifacts)
    trial = TrialInfo("t00001", 0, "search", {"seed": 0}, {})
    first.trial_started(trial)
    first.trial_error(trial, "OSError: [Errno 28] No space left on device")
    first.flush()
    run_id = first.children["t00001"]
    assert "error" in first.client.get_run(run_id).data.tags

    again = tracker(tmp_path, location, artifacts)  # --resume: the same study, its runs found again
    again.trial_started(trial)
    again.flush()
    run = again.client.get_run(run_id)
    assert again.children["t00001"] == run_id and run.info.status == "RUNNING"
    assert "error" not in run.data.tags and "stopped" not in run.data.tags
