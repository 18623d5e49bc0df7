"""What a study folder's path and contents may be: a storage path MLflow would read as URI text is
refused before anything is written, and any other works end to end; a deeply nested study.json,
driver.lock or snapshot record is one error line; a copied study folder cannot take over the
original's MLflow record; a full disk stops a study at once, saying so, with its MLflow run KILLED
(resumable), not FAILED; `--resume` refuses a folder other users can write. Real MLflow (SQLite),
Ray and Optuna; run.py's `main` in-process where nothing may start (tests/test_record_identity.py's
tripwire), a subprocess where the study runs."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_record_identity import SMOKE, no_study_starts, refused  # noqa: F401 (a fixture)
from test_study import ENV, ROOT, cli_in_process, main_in_process, mlflow_runs, run, write_spec

from study import run as run_cli
from study.experiment import snapshots
from study.record import identity
from study.record.mlflow.uri_checks import check_record_paths, sqlite_database
from study.spec.schema import load_spec
from study.spec.trust import check_resume_folder

DEEP = b'{"id": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"


def tree(root: Path) -> list[str]:
    """Every file and folder under root (a folder made beside the storage shows here too)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def study_folder(storage: Path, name: str = "smoke") -> Path:
    """A study of the smoke spec as a driver leaves it: its identity and Tune's folder."""
    folder = storage / name
    identity.create(load_spec(SMOKE), str(folder))
    (folder / "tune").mkdir()
    return folder


# --- a storage path holding what a URI reads otherwise ---------------------------------------------------
@pytest.mark.parametrize("name,named", [("p%41", "'%41'"), ("q?x", "'?'"), ("a%2fb?c", "'%2f'")])
def test_a_storage_path_mlflow_would_misread_exits_2_before_anything_is_written(name, named, tmp_path, monkeypatch,
                                                                               capsys):
    """`%41` in a folder's name was decoded to `A` in the default sqlite:/// URI (a traceback after the
    study folder was made), and `?` started its query (the database landed outside the storage). An
    escaped URI would not help: MLflow makes the database's folder from the URI's text as written."""
    storage = tmp_path / "outer" / name
    storage.mkdir(parents=True)
    before = tree(tmp_path)
    code, out, err = main_in_process(["--space", SMOKE, "--storage", str(storage)], monkeypatch, capsys)
    assert code == 2, out[-3000:] + err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --storage: ") and named in lines[0], err
    assert tree(tmp_path) == before  # nothing written, in the storage or beside it


def test_a_database_path_mlflow_would_misread_is_refused(tmp_path, capsys, monkeypatch, no_study_starts):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    for db in (tmp_path / "q?x" / "mlflow.db", tmp_path / "p%41" / "mlflow.db"):
        refused(["--storage", str(tmp_path / "studies"), "--mlflow-uri", f"sqlite:///{db}"], capsys, "--mlflow-uri")
    assert tree(tmp_path) == []


# what a folder's name may hold besides: each is written into the sqlite:/// URI as it is
OTHER_CHARACTERS = ["#", "'", '"', "\\", ";", " ", "é", "%zz", "%"]


@pytest.mark.parametrize("char", OTHER_CHARACTERS)
def test_the_default_record_of_a_path_with_other_characters_is_that_path(char, tmp_path):
    storage = str(tmp_path / f"a{char}b")
    assert check_record_paths(storage, None) is None
    db = os.path.join(storage, "mlflow.db")
    assert sqlite_database(f"sqlite:///{db}") == db  # run.py's default URI names the database in the storage


# A study under a path with every other character runs to the end: tests/test_records.py's ASHA study.


# --- deeply nested JSON ----------------------------------------------------------------------------------
def test_a_deeply_nested_study_json_is_one_line(tmp_path, capsys, monkeypatch, no_study_starts):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    folder = study_folder(tmp_path / "studies")
    (folder / "study.json").write_bytes(DEEP)
    line = refused(["--storage", str(tmp_path / "studies"), "--resume"], capsys, str(folder / "study.json"))
    assert "nested too deeply" in line
    assert (folder / "study.json").read_bytes() == DEEP


def test_a_deeply_nested_driver_lock_is_one_line(tmp_path, capsys, monkeypatch, no_study_starts):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "studies" / "smoke"
    folder.mkdir(parents=True)
    (folder / "driver.lock").write_bytes(DEEP)
    refused(["--storage", str(tmp_path / "studies")], capsys, str(folder / "driver.lock"))
    assert (folder / "driver.lock").read_bytes() == DEEP


def test_a_deeply_nested_snapshot_record_is_one_line(tmp_path, monkeypatch, capsys):
    folder = study_folder(tmp_path / "studies")
    (folder / "tune" / snapshots.COMPLETE).write_bytes(DEEP)
    with pytest.raises(snapshots.UnsafeSnapshot, match="not a snapshot record"):
        snapshots.restore_complete_snapshot(str(folder / "tune"))
    code, out, err = main_in_process(["--space", SMOKE, "--storage", str(tmp_path / "studies"), "--resume"],
                                     monkeypatch, capsys, until_ray=True)
    assert code == 2, out[-3000:] + err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: --resume:") and snapshots.COMPLETE in line


# --- a copied study folder -------------------------------------------------------------------------------
def test_a_copied_study_is_refused_and_can_become_a_study_of_its_own(tmp_path, capsys, monkeypatch,
                                                                     no_study_starts):  # noqa: F811
    """`cp -r studies/smoke studies2/` (or `aws s3 sync`) copies study.json: resumed, the copy found the
    original's MLflow parent run by the stored id and reconciled, finished and re-tagged its runs."""
    monkeypatch.chdir(tmp_path)
    original = study_folder(tmp_path / "studies")
    copy = tmp_path / "studies2" / "smoke"
    shutil.copytree(original, copy)
    before = tree(tmp_path)
    line = refused(["--storage", str(tmp_path / "studies2"), "--resume"], capsys, str(copy / "study.json"))
    assert str(original) in line and f"python -m study.record.identity --new-study {copy}" in line, line
    assert tree(tmp_path) == before  # refused before MLflow or anything else was touched
    code, _, err = cli_in_process(identity.main, ["--new-study", str(copy)], capsys)
    assert code == 0, err
    old, new = identity.read(str(original), "smoke"), identity.read(str(copy), "smoke")
    assert new.id != old.id and new.location == str(copy) and new.spec == old.spec
    with pytest.raises(AssertionError, match="the study started"):  # past every check: the tripwire
        run_cli.main(["--space", SMOKE, "--storage", str(tmp_path / "studies2"), "--resume"])
    with pytest.raises(AssertionError, match="the study started"):  # the original resumes as itself
        run_cli.main(["--space", SMOKE, "--storage", str(tmp_path / "studies"), "--resume"])
    code, _, err = cli_in_process(identity.main, ["--new-study", str(original)], capsys)  # no copy: kept
    assert code == 2 and "not a copy" in err and identity.read(str(original), "smoke") == old


def test_a_copied_bucket_study_is_refused(s3, tmp_path, capsys, monkeypatch, no_study_starts):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    identity.create(load_spec(SMOKE), "s3://studies/first/smoke")
    for key in ("study.json", "tune/x.json"):  # `aws s3 sync s3://studies/first s3://studies/second`
        body = b"{}" if key != "study.json" else \
            s3["client"].get_object(Bucket="studies", Key="first/smoke/study.json")["Body"].read()
        s3["client"].put_object(Bucket="studies", Key=f"second/smoke/{key}", Body=body)
    line = refused(["--storage", "s3://studies/second", "--resume"], capsys, "s3://studies/second/smoke/study.json")
    assert "s3://studies/first/smoke" in line and "--new-study" in line


def test_another_path_to_the_same_folder_is_the_same_study(tmp_path, monkeypatch, no_study_starts):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    study_folder(tmp_path / "studies")
    (tmp_path / "link").symlink_to(tmp_path / "studies")
    with pytest.raises(AssertionError, match="the study started"):
        run_cli.main(["--space", SMOKE, "--storage", str(tmp_path / "link"), "--resume"])


# --- a full disk -----------------------------------------------------------------------------------------
# The storage answers the driver's write of the snapshot record with ENOSPC, as a full disk does: an
# error of the storage's, at the one write it must hit (a disk filled for real fills at whatever write
# comes next, a trial's checkpoint as likely).
FULL_AT_COMPLETE = """
import errno, sys
from trial import storage

write = storage.write_atomic

def full(path, data):
    if path.endswith("last-complete-snapshot.json"):
        raise OSError(errno.ENOSPC, "No space left on device", path)
    return write(path, data)

storage.write_atomic = full
from study.run import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_while_a_snapshot_is_marked_complete_stops_the_study_at_once_resumable(tmp_path):
    spec = write_spec(tmp_path, **{"name": "full", "base/optim/steps": 40, "base/sparsity": None})
    storage = tmp_path / "studies"
    args = ["--space", str(spec), "--storage", str(storage)]
    env = {**ENV, "STUDY_STORAGE_WAIT_S": "600"}  # an outage's wait would outlast this test
    start = time.time()
    out = subprocess.run([sys.executable, "-c", FULL_AT_COMPLETE, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-5000:]
    assert time.time() - start < 300
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --storage: the disk under {storage / 'full' / 'tune'} is full"), out.stderr[-3000:]
    assert "--resume once there is room" in last and "did not answer" not in out.stderr
    assert 'study/run.py", line' not in out.stderr
    _, parents, _ = mlflow_runs(storage / "mlflow.db", "full")
    assert [p.info.status for p in parents] == ["KILLED"]  # stopped, resumable: not FAILED

    again = run([*args, "--resume"], env=env, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
    _, parents, children = mlflow_runs(storage / "mlflow.db", "full")
    assert [p.info.status for p in parents] == ["FINISHED"]
    assert len(children) == 4 and all(c.info.status == "FINISHED" for c in children)
    record = json.loads((storage / "full" / "tune" / snapshots.COMPLETE).read_bytes())
    assert all(base64.b64decode(v) for v in record["files"].values())


def test_a_full_disk_at_the_snapshot_record_is_named_at_once(tmp_path):
    """A real full disk (a small tmpfs) under the study, met where the driver marks a snapshot complete:
    the watch stops the study now, naming the disk, instead of waiting STUDY_STORAGE_WAIT_S for an
    answer that will not change."""
    from types import SimpleNamespace

    import pyarrow.fs as pafs

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        staged, tune = tmp_path / "staged", disk / "study" / "tune"
        staged.mkdir()
        tune.mkdir(parents=True)
        name = "experiment_state-2026-01-02_03-04-05.json"
        (staged / name).write_bytes(os.urandom(256 << 10))
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - (64 << 10)))  # 64 KiB left: the record is ~340 KiB
        controller = SimpleNamespace(experiment_state_file_name=name, _storage=SimpleNamespace(
            experiment_driver_staging_path=str(staged), experiment_fs_path=str(tune),
            storage_filesystem=pafs.LocalFileSystem()))
        watch = snapshots.StorageWatch(wait_s=600)
        assert not snapshots.mark_complete(controller, watch)
        assert watch.full and watch.lost.startswith(f"the disk under {tune} is full"), watch.lost
        assert not (tune / snapshots.COMPLETE).exists() and not list(tune.glob("*.tmp-*"))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# --- trusted storage -------------------------------------------------------------------------------------
def test_resume_refuses_a_study_folder_other_users_can_write(tmp_path, capsys, monkeypatch,
                                                             no_study_starts):  # noqa: F811
    """A resume unpickles Tune's state: whoever can write the folder runs code as the user resuming."""
    monkeypatch.chdir(tmp_path)
    storage = tmp_path / "studies"
    folder = study_folder(storage)
    (folder / "tune" / "tuner.pkl").write_bytes(b"state")
    argv = ["--storage", str(storage), "--resume"]
    for path, change in ((folder, lambda p: p.chmod(0o777)), (folder / "tune" / "tuner.pkl", lambda p: p.chmod(0o666)),
                         (folder / "tune", lambda p: os.chown(p, 65534, -1)), (storage, lambda p: p.chmod(0o777))):
        st = path.stat()
        change(path)
        try:
            line = refused(argv, capsys, f"--resume: {path} can be changed by other users")
            assert "chmod -R go-w" in line
        finally:
            path.chmod(st.st_mode & 0o7777)
            os.chown(path, st.st_uid, st.st_gid)
    storage.chmod(0o1777)  # sticky, as /tmp: others cannot rename the study folder away
    with pytest.raises(AssertionError, match="the study started"):
        run_cli.main(["--space", SMOKE, *argv])


def test_a_group_only_its_owner_is_in_may_write(tmp_path):
    import grp
    import pwd

    folder = study_folder(tmp_path / "studies")
    folder.chmod(0o775)  # the owner's own group (user private groups, umask 002)
    gid = os.stat(folder).st_gid
    if grp.getgrgid(gid).gr_mem or [u for u in pwd.getpwall() if u.pw_gid == gid and u.pw_uid != os.geteuid()]:
        pytest.skip(f"this user's group {gid} has other members here")
    assert check_resume_folder(str(folder)) is None
    assert check_resume_folder("s3://bucket/studies/smoke") is None  # a bucket's policy is not readable here
