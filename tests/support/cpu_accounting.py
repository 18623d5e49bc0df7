"""Each test's CPU, its subprocesses and Ray's daemons included, for work on the suite's minutes.

    TEST_CPU_OUT=/tmp/cpu .venv/bin/python -m pytest -p tests.support.cpu_accounting [args]

Each test process (each pytest-xdist worker) moves itself into a cpuacct cgroup of its own, which
everything it starts inherits, however it detaches (Ray's daemons start their own sessions), so a
test's CPU is the group's usage over its run; `time` sees only what the test waits for. Writes
`<TEST_CPU_OUT>_<worker>.tsv`: CPU seconds, wall seconds, test id. Needs a writable cgroup v1
cpuacct hierarchy (root on most Linux hosts); without one it says so and measures nothing.
"""

from __future__ import annotations

import os
import time

import pytest

HIERARCHY = "/sys/fs/cgroup/cpuacct"


def _usage(group: str) -> float:
    with open(os.path.join(group, "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def pytest_configure(config):
    out = os.environ.get("TEST_CPU_OUT")
    if not out:
        raise pytest.UsageError("tests.support.cpu_accounting: set TEST_CPU_OUT (where the per-test TSVs go)")
    worker = getattr(config, "workerinput", {}).get("workerid", "main")  # not the environment: a test's own pytest inherits it
    group = os.path.join(HIERARCHY, f"pytest-{os.getppid()}-{worker}")
    try:
        os.makedirs(group, exist_ok=True)
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        print(f"cpu_accounting: no cpuacct group here ({e}); nothing measured")
        return
    config._cpu_accounting = (group, open(f"{out}_{worker}.tsv", "a"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    found = getattr(item.config, "_cpu_accounting", None)
    if found is None:
        yield
        return
    group, out = found
    cpu, wall = _usage(group), time.time()
    yield
    out.write(f"{_usage(group) - cpu:.2f}\t{time.time() - wall:.2f}\t{item.nodeid}\n")
    out.flush()


def pytest_unconfigure(config):
    """Back to the root group, and the group removed (where nothing is left in it)."""
    found = getattr(config, "_cpu_accounting", None)
    if found is None:
        return
    group, out = found
    out.close()
    try:
        with open(os.path.join(HIERARCHY, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(group)
    except OSError:
        pass
