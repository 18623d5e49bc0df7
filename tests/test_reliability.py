"""Nothing lost, nothing mixed, nobody in: a FIFO or an undecodable path given as a flag, `--set`
values read as strictly as the file, and a trial reopened on `--resume` that no longer carries what
ended its last attempt. Real MLflow (SQLite); run.py's `main` in-process where nothing may start."""

from __future__ import annotations

import os

import pytest
from test_record_identity import no_study_starts, tracker  # noqa: F401  (a fixture)

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


def test_a_study_made_by_another_driver_after_the_first_check_is_not_written_over(tmp_path, capsys, monkeypatch,
                                                                                  no_study_starts):  # noqa: F811
    """The "already exists" check runs again under the driver lock: another driver that made the study
    between the first check and the lock (its Tune folder and study.json) keeps it."""
    from test_record_identity import SMOKE

    storage = tmp_path / "studies"
    checked = run_cli.checked_study_folder

    def other_driver_in_the_window(args, spec, storage_, study_dir, address):
        stored = checked(args, spec, storage_, study_dir, address)
        os.makedirs(os.path.join(study_dir, "tune"))
        with open(os.path.join(study_dir, "study.json"), "w") as f:
            f.write('{"id": "the other driver\'s"}')
        return stored

    monkeypatch.setattr(run_cli, "checked_study_folder", other_driver_in_the_window)
    monkeypatch.chdir(tmp_path)
    assert run_cli.main(["--space", SMOKE, "--storage", str(storage)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after MLflow's own lines of making its database
    assert last.startswith("error: study 'smoke' already exists") and "another driver made it just now" in last
    assert (storage / "smoke" / "study.json").read_text() == '{"id": "the other driver\'s"}'


def test_resume_follows_a_linked_tune_folder_to_another_users_folder(tmp_path):
    """A `<study>/tune` that is a link is judged by what it names: another user's folder, writable by
    all, is refused, and so is one named by a link deeper in."""
    from test_study_folders import study_folder

    from study.spec.trust import check_resume_folder

    storage = tmp_path / "studies"
    folder = study_folder(storage)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "tuner.pkl").write_bytes(b"state")
    os.chown(theirs, 65534, -1)
    theirs.chmod(0o777)
    (folder / "tune").rmdir()
    (folder / "tune").symlink_to(theirs)
    found = check_resume_folder(str(folder))
    assert found and f"{folder / 'tune'} (a link to {theirs})" in found, found

    os.chown(theirs, os.geteuid(), -1)
    theirs.chmod(0o700)
    assert check_resume_folder(str(folder)) is None  # the same link to a folder of this user's only
    deeper = tmp_path / "deeper"
    deeper.mkdir(mode=0o777)
    deeper.chmod(0o777)
    (theirs / "state").symlink_to(deeper)
    assert "a link to" in (check_resume_folder(str(folder)) or "")
    (theirs / "loop").symlink_to(theirs)  # a link loop ends
    assert check_resume_folder(str(folder))


@pytest.mark.parametrize("uri, shown, secret", [
    ("mssql+pyodbc://h/db?odbc_connect=DRIVER%253Dx%253BPWD%253DSEKRIT", "odbc_connect=***", "odbc_connect (PWD)"),
    ("sqlite:///t.db?odbc_connect=DRIVER%25253Dx%25253BPWD%25253DSEKRIT", "odbc_connect=***", "odbc_connect (PWD)"),
    ("http://h:5000/api;token=SEKRIT", "/api;token=***", "token"),
    ("http://h:5000/?SEKRIT", "/?***", "a bare query item (1)"),
])
def test_secrets_encoded_twice_in_a_path_parameter_or_bare_are_masked_and_refused(uri, shown, secret):
    from trial import storage

    assert "SEKRIT" not in storage.redact(uri) and shown in storage.redact(uri)
    assert storage.secret_keys(uri) == [secret]


def test_a_token_in_a_ray_address_is_never_echoed(tmp_path, capsys, no_study_starts):  # noqa: F811
    err = refused(["--address", "h:6379?token=SEKRIT", "--storage", str(tmp_path)], capsys,
                  "--address: h:6379?token=***")
    assert "SEKRIT" not in err


def test_a_copy_at_the_same_path_on_another_host_is_not_the_study_it_was_copied_from(tmp_path):
    """The folder as another host sees it after `rsync -a`: the same path, the same study.json, another
    folder. Refused on --resume, it can become a study of its own."""
    import shutil

    from test_study_folders import study_folder

    from study.record import identity

    folder = study_folder(tmp_path / "studies")
    original = identity.read(str(folder), "smoke")
    assert original.host and original.inode == os.stat(folder).st_ino
    folder.rename(tmp_path / "original")  # kept: its inode cannot be reused by the copy
    shutil.copytree(tmp_path / "original", folder)  # same path, a new folder (another inode)
    with pytest.raises(identity.StudyFileError, match=r"a copy at the same path.*--new-study"):
        identity.read(str(folder), "smoke")
    renewed = identity.renew(str(folder))
    assert renewed.id != original.id and identity.read(str(folder), "smoke").id == renewed.id


def test_each_host_builds_deepspeeds_ops_in_a_folder_of_its_own(monkeypatch):
    """Nodes sharing a home folder (NFS) never share a build lock: a live lock of another node's is never
    in this node's folder, so it is never taken for a stale one of this node's."""
    import socket

    from trial.session import extension_folder

    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    a = extension_folder()
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    assert extension_folder() != a and a.endswith("-node-a")


def test_the_memory_estimate_counts_the_fixed_set_per_data_worker(tmp_path):
    from test_record_identity import SMOKE

    from study.spec.schema import load_spec
    from trial.limits import estimate

    spec = load_spec(SMOKE, overrides=["task.train_set_size=1000000", "base.deepspeed.data_workers=2"])
    cfg = spec.checked_config(spec.cells()[0])
    _, counted = estimate(cfg)
    piece = next(p for p in counted if p.field == "task.train_set_size")
    train_seq = cfg.task_instance.max_seq_len(cfg.task_instance.train_length, cfg.task_instance.train_k)
    assert piece.bytes == 1_000_000 * train_seq * 24 * 3 and "3 copies" in piece.what


def test_trials_that_fit_alone_but_not_together_are_refused_naming_the_concurrency(capsys, monkeypatch, tmp_path,
                                                                                    no_study_starts):  # noqa: F811
    from test_record_identity import SMOKE

    from trial import limits

    monkeypatch.setattr(limits, "memory_given", lambda *a, **k: (8 * limits.GiB, "a machine of 8 GiB"))
    argv = ["--space", SMOKE, "--storage", str(tmp_path), "--set", "task.train_set_size=4000000"]
    code = run_cli.main([*argv, "--dry-run"])  # one trial fits; the dry run says what it holds
    out = capsys.readouterr().out
    assert code == 0 and "memory: about 2.3 GiB a trial (the largest cell), 2.3 GiB for 1 at once" in out, out
    refused([*argv, "--set", "resources.max_concurrent_trials=4"], capsys,
            "resources.max_concurrent_trials: 4 trials at once would hold about 9.1 GiB, beyond this machine's "
            "8.0 GiB (2.3 GiB a trial); set it to 3 or fewer")
