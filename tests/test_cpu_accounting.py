"""tests/support/cpu_accounting.py: a test's CPU counts what it started and did not wait for (a
daemon, as Ray's are), which `time` and pytest's durations cannot see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cpu_accounting import HIERARCHY

ROOT = Path(__file__).resolve().parents[1]

BURNS_IN_A_DAEMON = '''
import subprocess, sys, time
from pathlib import Path

def test_burn(tmp_path):
    done = tmp_path / "done"
    burn = f"import time; t = time.process_time()\\nwhile time.process_time() - t < 1.0: pass\\nopen({str(done)!r}, 'w')"
    # detached and never waited for: its CPU reaches no rusage of this process
    subprocess.Popen([sys.executable, "-c", burn], start_new_session=True)
    while not done.exists():
        time.sleep(0.05)

def test_idle():
    time.sleep(0.3)
'''


@pytest.mark.skipif(not os.access(HIERARCHY, os.W_OK), reason=f"{HIERARCHY} is not writable here (not root, or no cgroup v1)")
def test_a_daemons_cpu_is_counted_to_the_test_that_started_it(tmp_path):
    (tmp_path / "test_burn.py").write_text(BURNS_IN_A_DAEMON)
    out = tmp_path / "cpu"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.cpu_accounting", "-n", "0", "-q",
                          "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_burn.py")],
                         cwd=ROOT, env={**os.environ, "TEST_CPU_OUT": str(out), "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {line.split("\t")[2].split("::")[-1]: float(line.split("\t")[0])
            for line in Path(f"{out}_main.tsv").read_text().splitlines()}
    assert rows["test_burn"] >= 0.9, rows
    assert rows["test_idle"] < 0.5, rows
