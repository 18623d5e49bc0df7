"""A checkpoint's local staging folder: removed after use, and after its process was killed."""

import os
import signal
import subprocess
import sys

from trial.staging import checkpoint_staging, remove_abandoned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRITER = """
import sys, time
from trial.staging import checkpoint_staging
with checkpoint_staging(sys.argv[1]) as folder:
    open(folder + "/weights", "w").write("x" * 1000)
    print(folder, flush=True)
    time.sleep(120)
"""


def test_a_checkpoint_folder_holds_only_the_checkpoint_and_goes_when_done(tmp_path):
    with checkpoint_staging(str(tmp_path)) as folder:
        assert os.listdir(folder) == []  # the lock file is beside it, so it is not reported with it
        assert remove_abandoned(str(tmp_path)) == []  # in use
        assert os.path.isdir(folder)
    assert os.listdir(tmp_path) == []


def test_what_a_killed_writer_left_is_removed_and_a_live_writers_folder_is_not(tmp_path):
    """SIGKILL, as an OOM kill or Ray killing a stopped trial's actor: no Python cleanup runs."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                env=env) for _ in range(2)]
    try:
        killed, alive = (w.stdout.readline().strip() for w in writers)
        assert os.path.exists(os.path.join(killed, "weights")) and os.path.exists(os.path.join(alive, "weights"))
        assert remove_abandoned(str(tmp_path)) == []

        writers[0].send_signal(signal.SIGKILL)
        writers[0].wait(timeout=30)
        assert os.path.exists(killed)  # left behind: TemporaryDirectory would have kept it for good

        assert remove_abandoned(str(tmp_path)) == [os.path.dirname(killed)]
        assert not os.path.exists(os.path.dirname(killed))
        assert os.path.exists(os.path.join(alive, "weights"))
    finally:
        for w in writers:
            w.kill()
            w.wait(timeout=30)
    assert remove_abandoned(str(tmp_path)) == [os.path.dirname(alive)]
    assert os.listdir(tmp_path) == []
