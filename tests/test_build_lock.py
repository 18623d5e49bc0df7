"""torch holds a `lock` file in an extension's build folder around every load of the extension, built
or not (DeepSpeed JIT-loads its CPU comm op in every trial process), and a process killed inside that
window (Ray kills a stopped trial's actor; the kill tests here did it) leaves it behind: every later
load waits on it forever. Trials load the op one at a time under a flock of ours and remove such a
lock; a lock a running load or build holds is left alone.

Real lock files, a real DeepSpeed load in a temporary TORCH_EXTENSIONS_DIR; nothing is mocked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from trial.session import extension_folder, remove_stale_lock

ROOT = Path(__file__).resolve().parents[1]
OP = "deepspeed_shm_comm"


def stale_lock(root: Path, name: str = OP, age_s: float = 600) -> Path:
    lock = root / name / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s,) * 2)
    return lock


def test_a_lock_nothing_holds_is_removed(tmp_path):
    lock = tmp_path / OP / "lock"
    assert not remove_stale_lock(str(lock), recheck_s=0.1)  # no lock: nothing to do
    stale_lock(tmp_path)
    assert remove_stale_lock(str(lock), recheck_s=0.1)
    assert not lock.exists()


def test_a_lock_a_running_build_holds_is_left_alone(tmp_path):
    lock = stale_lock(tmp_path, age_s=0)
    # another process holds it open, as torch's FileBaton does while it loads or builds
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(lock)!r}); print(1, flush=True); "
                               "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        assert not remove_stale_lock(str(lock), recheck_s=0.1)
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale_lock(str(lock), recheck_s=0.1)  # its holder is gone now


def test_training_starts_on_a_lock_a_killed_load_left(tmp_path):
    """Before, this hung forever (no output) inside DeepSpeed's op load; then it refused to start."""
    built = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or extension_folder()) / OP
    extensions = tmp_path / "ext"
    if (built / f"{OP}.so").exists():  # this environment's build, so the test does not build it again
        shutil.copytree(built, extensions / OP, ignore=shutil.ignore_patterns("lock", "load.flock"))
    lock = stale_lock(extensions)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    out = subprocess.run([sys.executable, "-m", "study.train", "search_spaces/trials/sparse_parity.yaml",
                          "--steps", "60"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"warning: removed {lock}, a torch extension lock" in out.stderr
    assert not lock.exists() and (extensions / OP / f"{OP}.so").exists()


def test_extension_builds_use_this_environments_ninja_and_folder(monkeypatch):
    """Two ninja versions on one build folder rebuilt DeepSpeed's op in turn (each reads the other's
    log as stale): a trial pins this environment's ninja and a build folder of its own, and leaves a
    folder the user chose alone."""
    import shutil
    import sys

    from trial.session import pin_extension_builds

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    pin_extension_builds()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == extension_folder()
    venv_bin = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(venv_bin, "ninja")):
        assert shutil.which("ninja") == os.path.join(venv_bin, "ninja")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    pin_extension_builds()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/somewhere/else"


# --- a lock this process cannot judge is never removed ---------------------------------------------------
NOBODY = 65534  # another user: the tests run as root here, and root may act as any user
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def as_nobody(code: str, *args: str, **kw) -> subprocess.Popen:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run a process as another user")
    return subprocess.Popen([*AS_NOBODY, sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HOME": "/nonexistent"}, **kw)


def test_another_users_lock_is_never_removed(tmp_path):
    """Their processes cannot be inspected: one of them may be building (a build keeps the lock open
    without touching its mtime)."""
    lock = stale_lock(tmp_path)
    os.chown(lock, NOBODY, NOBODY)
    assert not remove_stale_lock(str(lock), recheck_s=0.1)
    assert lock.exists()


@pytest.fixture
def shared():
    """A folder another user can reach (pytest's own are this user's only)."""
    folder = Path(tempfile.mkdtemp(prefix="build-lock-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_a_lock_whose_holder_cannot_be_inspected_is_left_alone(shared):
    """The lock's owner runs a holder this process may not inspect (not dumpable: its open files are
    hidden from other processes of its user); the check runs as that user too."""
    lock = stale_lock(shared, age_s=0)
    os.chown(lock.parent, NOBODY, NOBODY)
    os.chown(lock, NOBODY, NOBODY)
    holder = as_nobody("import ctypes, sys, time; f = open(sys.argv[1]); ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); "
                       "print(1, flush=True); time.sleep(60)", str(lock))
    try:
        assert holder.stdout.readline().strip() == "1", holder.stderr.read()
        check = as_nobody("import sys; from trial.session import remove_stale_lock; "
                          "print(remove_stale_lock(sys.argv[1], 0.1))", str(lock))
        out, err = check.communicate(timeout=120)
        assert check.returncode == 0 and out.strip() == "False", err
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_this_user_may_not_remove_is_no_error(shared):
    """A shared folder this user may not change (another user's build folder, made writable to read):
    the lock stays, and loading waits for it as torch would, without a traceback."""
    lock = stale_lock(shared)  # the folder stays root's
    os.chown(lock, NOBODY, NOBODY)
    check = as_nobody("import sys; from trial.session import remove_stale_lock; "
                      "print(remove_stale_lock(sys.argv[1], 0.1))", str(lock))
    out, err = check.communicate(timeout=120)
    assert check.returncode == 0 and out.strip() == "False", err
    assert lock.exists()


def test_the_default_build_folder_is_per_user(tmp_path):
    """Two users of one environment build in folders of their own."""
    mine = extension_folder()
    theirs = as_nobody("from trial.session import extension_folder; print(extension_folder())")
    out, err = theirs.communicate(timeout=120)
    assert theirs.returncode == 0, err
    assert out.strip() != mine and out.strip().startswith("/nonexistent/.cache/torch_extensions/")
    assert os.path.basename(mine) == os.path.basename(out.strip())  # one folder name per environment
