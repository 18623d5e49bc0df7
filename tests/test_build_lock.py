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
import time
from pathlib import Path

from trial.session import remove_stale_lock

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
    built = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")) / OP
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
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    venv_bin = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(venv_bin, "ninja")):
        assert shutil.which("ninja") == os.path.join(venv_bin, "ninja")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    pin_extension_builds()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/somewhere/else"
