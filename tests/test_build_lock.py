"""A torch extension build killed mid-way (DeepSpeed JIT-builds its CPU comm op) leaves its `lock`
file behind, and every later build or load of that op waits on it forever. Such a lock is found
before training starts and named; a lock a running build holds is left alone.

Real lock files in a temporary TORCH_EXTENSIONS_DIR; nothing is mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trial.session import StaleBuildLock, check_build_locks

ROOT = Path(__file__).resolve().parents[1]


def stale_lock(root: Path, name: str = "deepspeed_shm_comm", age_s: float = 600) -> Path:
    lock = root / name / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s,) * 2)
    return lock


def test_a_lock_nothing_holds_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    check_build_locks()  # no lock: nothing to say
    lock = stale_lock(tmp_path)
    with pytest.raises(StaleBuildLock) as err:
        check_build_locks(recheck_s=0.1)
    message = str(err.value)
    assert str(lock) in message and f"rm {lock}" in message and "10 min ago" in message


def test_a_lock_a_running_build_holds_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = stale_lock(tmp_path, age_s=0)
    # another process holds it open, as torch's FileBaton does while it builds
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(lock)!r}); print(1, flush=True); "
                               "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        check_build_locks(recheck_s=0.1)
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(StaleBuildLock):  # its holder is gone now
        check_build_locks(recheck_s=0.1)


@pytest.mark.parametrize("command", [
    ["-m", "study.train", "search_spaces/trials/sparse_parity.yaml", "--steps", "60"],
    ["study/run.py", "--space", "search_spaces/smoke.yaml", "--storage", "{tmp}/studies"],
])
def test_training_refuses_to_start_on_a_stale_lock(tmp_path, command):
    """Before the check, both hung forever (no output) inside DeepSpeed's op build."""
    lock = stale_lock(tmp_path / "ext")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, *[c.format(tmp=tmp_path) for c in command]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"error: stale torch extension build lock {lock}" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "studies").exists()  # the study refused before writing anything


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
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    venv_bin = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(venv_bin, "ninja")):
        assert shutil.which("ninja") == os.path.join(venv_bin, "ninja")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    pin_extension_builds()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/somewhere/else"
