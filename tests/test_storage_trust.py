"""Storage and the driver: what a study reads back from its storage on --resume is not
trusted with paths, the driver lock's takeover is atomic, and a bucket study whose local disk fills
says so. Real parts: a folder, a real S3 API (moto's server on 127.0.0.1), real processes."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import bucket_keys
from test_study import ENV, ROOT, main_in_process, mlflow_runs, run, write_spec

from study.experiment import snapshots

SESSION = "2026-01-02_03-04-05"
STATE = f"experiment_state-{SESSION}.json"


def complete_record(files: dict[str, bytes], session: str = SESSION) -> bytes:
    return json.dumps({"session": session,
                       "files": {k: base64.b64encode(v).decode() for k, v in files.items()}}).encode()


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- 8. a resume does not write where the storage says ------------------------------------------------
@pytest.mark.parametrize("name", ["../../escaped.json", "/tmp/escaped.json", "sub/experiment_state-x.json",
                                  "experiment_state-2026-01-02_03-04-05.json/../../escaped.json",
                                  f"searcher-state-{SESSION}.pkl\n", "escaped.json"])
def test_a_snapshot_record_naming_another_file_is_refused_before_anything_is_written(tmp_path, name):
    tune = tmp_path / "study" / "tune"
    tune.mkdir(parents=True)
    (tune / STATE).write_bytes(b"old")
    (tune / snapshots.COMPLETE).write_bytes(complete_record({STATE: b"new", name: b"pwned"}))
    before = tree(tmp_path)
    with pytest.raises(snapshots.UnsafeSnapshot) as refused:
        snapshots.restore_complete_snapshot(str(tune))
    assert repr(name)[1:-1][:40] in str(refused.value) and snapshots.COMPLETE in str(refused.value)
    assert tree(tmp_path) == before  # not even the legitimate file was put back


def test_a_snapshot_record_whose_session_is_not_a_session_is_refused(tmp_path):
    """The session decides which state files a resume deletes (those of later sessions): "" would be
    older than all of them."""
    tune = tmp_path / "tune"
    tune.mkdir()
    (tune / STATE).write_bytes(b"kept")
    (tune / snapshots.COMPLETE).write_bytes(complete_record({}, session=""))
    with pytest.raises(snapshots.UnsafeSnapshot, match="session"):
        snapshots.restore_complete_snapshot(str(tune))
    assert (tune / STATE).read_bytes() == b"kept"


def test_a_good_snapshot_record_is_still_put_back(tmp_path):
    tune = tmp_path / "tune"
    tune.mkdir()
    later = "experiment_state-2027-01-01_00-00-00.json"
    (tune / STATE).write_bytes(b"torn")
    (tune / later).write_bytes(b"incomplete session")
    (tune / snapshots.COMPLETE).write_bytes(complete_record({STATE: b"whole"}))
    assert sorted(snapshots.restore_complete_snapshot(str(tune))) == sorted([STATE, later])
    assert (tune / STATE).read_bytes() == b"whole" and not (tune / later).exists()


def test_a_bucket_snapshot_record_naming_another_key_is_refused(s3):
    tune = "s3://studies/tampered/study/tune"
    s3["client"].put_object(Bucket="studies", Key=f"tampered/study/tune/{STATE}", Body=b"old")
    s3["client"].put_object(Bucket="studies", Key=f"tampered/study/tune/{snapshots.COMPLETE}",
                            Body=complete_record({STATE: b"new", "../../other-study/tune/x.json": b"pwned"}))
    with pytest.raises(snapshots.UnsafeSnapshot, match=r"\.\./\.\./other-study"):
        snapshots.restore_complete_snapshot(tune)
    assert sorted(bucket_keys(s3, "tampered/")) == [f"tampered/study/tune/{k}" for k in sorted([STATE, snapshots.COMPLETE])]
    assert s3["client"].get_object(Bucket="studies", Key=f"tampered/study/tune/{STATE}")["Body"].read() == b"old"


def test_resume_with_a_tampered_snapshot_exits_2_naming_the_file_and_changes_nothing(tmp_path, monkeypatch, capsys):
    from study.record import identity
    from study.spec.schema import load_spec

    spec = write_spec(tmp_path, name="tampered")
    storage = tmp_path / "studies"
    study_dir = storage / "tampered"
    identity.create(load_spec(str(spec)), str(study_dir))
    (study_dir / "tune").mkdir()
    (study_dir / "tune" / STATE).write_bytes(b"old")
    (study_dir / "tune" / snapshots.COMPLETE).write_bytes(
        complete_record({STATE: b"new", "../../escaped.json": b"pwned"}))
    before = tree(tmp_path)
    code, out, err = main_in_process(["--space", str(spec), "--storage", str(storage), "--resume"], monkeypatch,
                                     capsys, until_ray=True)  # a tripwire in place of Ray: refused before it
    assert code == 2, out[-3000:] + err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: --resume:") and "../../escaped.json" in line and snapshots.COMPLETE in line, line
    after = tree(tmp_path)
    assert not any("escaped" in k for k in after)
    db = storage / "mlflow.db"  # the driver may open its store before it resumes: it records nothing
    assert {k: v for k, v in after.items() if k != "studies/mlflow.db"} == before  # no state file, no lock left
    assert not db.exists() or mlflow_runs(db, "tampered")[2] == [] and mlflow_runs(db, "tampered")[1] == []


# --- 6. the driver lock: atomic takeover, liveness that containers sharing a host name do not fool --------
KILLED_HOLDER = """
import os, signal, sys
from study.experiment.lock import driver_lock
with driver_lock(sys.argv[1]):
    print("holding", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a driver killed: its lock stays behind
"""
RACER = """
import sys, time
from study.experiment.lock import StudyLocked, driver_lock
start = float(sys.argv[2])
while time.time() < start:  # every racer tries at the same moment
    pass
try:
    with driver_lock(sys.argv[1]):
        print("won", flush=True)
        time.sleep(float(sys.argv[3]))  # held while the others try
except StudyLocked as e:
    print("refused:", e, flush=True)
"""


def python(code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env={**ENV, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def leave_a_killed_drivers_lock(study_dir: str, env: dict | None = None) -> dict:
    proc = python(KILLED_HOLDER, study_dir, env=env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and "holding" in out, err
    return json.loads(lock_bytes(study_dir))


def lock_bytes(study_dir: str) -> bytes:
    from trial import storage

    return storage.read_bytes(storage.join(study_dir, "driver.lock"))


def race(study_dir: str, env: dict | None = None, racers: int = 4, rounds: int = 3) -> None:
    """Kill a driver, then start `racers` resumes at one moment, `rounds` times: exactly one wins each."""
    for _ in range(rounds):
        leave_a_killed_drivers_lock(study_dir, env)
        start = time.time() + 3
        procs = [python(RACER, study_dir, str(start), "4", env=env) for _ in range(racers)]
        outs = [p.communicate(timeout=120) for p in procs]
        won = [p.pid for p, (out, _) in zip(procs, outs) if out.startswith("won")]
        refused = [out for out, _ in outs if out.startswith("refused:")]
        assert len(won) == 1 and len(refused) == racers - 1, outs
        # (which holder a loser names is not checked: one that reads the record before the winner
        # rewrites it names the killed driver, seen once under load)


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_two_takeovers_of_a_killed_drivers_folder_lock_racing_exactly_one_wins(tmp_path):
    (tmp_path / "study").mkdir()  # run.py makes it before it locks
    race(str(tmp_path / "study"))
    assert not (tmp_path / "study" / "driver.lock").exists()  # the winner released it


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_two_takeovers_of_a_killed_drivers_bucket_lock_racing_exactly_one_wins(s3):
    race("s3://studies/raced/study", s3["env"])
    assert "raced/study/driver.lock" not in bucket_keys(s3, "raced/")


def a_dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("where", ["folder", "bucket"])
@pytest.mark.parametrize("holder", ["another container, same host name", "no boot id (unknown)"])
def test_a_lock_whose_holder_cannot_be_seen_from_here_is_not_taken_over(where, holder, tmp_path, request):
    """Containers sharing a host name each have a pid namespace of their own: a pid that is dead here
    may be a live driver there. A holder this process cannot look up is taken to be alive."""
    import socket

    from study.experiment.lock import StudyLocked, driver_lock, this_driver
    from trial import storage

    study_dir = str(tmp_path / "study") if where == "folder" else "s3://studies/unseen/study"
    if where == "bucket":
        request.getfixturevalue("s3")
    record = {**this_driver(), "host": socket.gethostname(), "pid": a_dead_pid()}
    if holder.startswith("another container"):
        record["pid_ns"] = "pid:[1]"
    else:
        del record["boot_id"], record["pid_ns"]
    data = json.dumps(record).encode()
    storage.write_atomic(storage.join(study_dir, "driver.lock"), data)
    with pytest.raises(StudyLocked, match=rf"pid {record['pid']} on {socket.gethostname()}.*delete the lock file"):
        with driver_lock(study_dir):
            pytest.fail("took over the lock of a driver it cannot see")
    assert lock_bytes(study_dir) == data  # left as it was

    record.update(this_driver(), pid=a_dead_pid())  # the same holder, seen from its own container: dead, taken over
    storage.write_atomic(storage.join(study_dir, "driver.lock"), json.dumps(record).encode())
    with driver_lock(study_dir):
        assert json.loads(lock_bytes(study_dir))["pid"] == os.getpid()


# --- 10b. a bucket study whose local disk fills says so ---------------------------------------------
@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_a_bucket_study_whose_local_disk_is_full_is_a_clear_error(s3, tmp_path):
    """The study lives in a bucket, but the driver stages on its own disk: Ray's session (Tune's
    experiment state, the trials' checkpoints before upload) and temporary files, under TMPDIR here a
    nearly full tmpfs. The study ends with one error line naming that disk, --storage and --resume,
    exit 1, and no traceback of the driver (Ray may still print a trial's unhandled error as it shuts
    down); the bucket holds no report."""
    import tempfile

    disk = Path(tempfile.mkdtemp(prefix="full", dir="/tmp"))  # short: Ray's socket paths are limited
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - (256 << 10)))  # 256 KiB left
        (tmp_path / "cwd").mkdir()
        out = run(["--space", str(ROOT / "search_spaces" / "smoke.yaml"), "--storage", "s3://studies/full"],
                  env={**ENV, **s3["env"], "TMPDIR": str(disk)}, cwd=tmp_path / "cwd", timeout=600)
        assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, out.stderr[-12000:]
        assert errors[0].startswith("error: --storage: the local disk under") and str(disk) in errors[0], errors
        assert "is full" in errors[0] and "--resume" in errors[0], errors
        assert 'study/run.py", line' not in out.stderr, out.stderr[-3000:]  # the driver did not crash
        assert not any(k.endswith("results.csv") for k in bucket_keys(s3, "full/"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        disk.rmdir()
