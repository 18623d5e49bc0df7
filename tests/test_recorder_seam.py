"""The record is one seam (study/record/recorder.py): a recorder of the test's own, registered by one
line, receives every event of a real smoke study (real Ray, DeepSpeed, Optuna) in order, and the
study that calls it never loads the MLflow recorder nor names MLflow. MLflow's recorder has every method of the protocol."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
from test_study import ENV, ROOT

# The test's recorder: it keeps each event in memory and, once the study finished, writes them out
# for the test to read (the study runs in a process of its own, as a user's does).
DRIVER = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, {root!r})
    from study.record.recorder import RECORDERS, Lookups
    from study import run

    class MemoryRecorder(Lookups):  # the events alone: the look-ups keep their defaults
        errors = (OSError,)

        def __init__(self, spec, uri, study_dir, identity):
            self.events = []

        def _event(self, name, trial=None, **what):
            self.events.append({{"event": name, "trial": trial.trial_id if trial else None,
                                 "cell": trial.cell if trial else None, **what}})

        def study_started(self): self._event("study_started")
        def trial_started(self, trial): self._event("trial_started", trial, role=trial.role)
        def trial_result(self, trial, result):
            self._event("trial_result", trial, step=result.get("step"), final="eval_records" in result)
        def trial_checkpoint(self, trial, uri): self._event("trial_checkpoint", trial, uri=uri)
        def trial_done(self, trial, result): self._event("trial_done", trial)
        def trial_error(self, trial, reason): self._event("trial_error", trial, reason=reason)
        def snapshot_stored(self): self._event("snapshot_stored")
        def flush(self, wait_s=None): pass
        def reconcile(self, terminated, known): self._event("reconcile", terminated=sorted(terminated)); return []
        def selection(self, selected): self._event("selection", trials=sorted(selected.trial_id))
        def claims_judged(self, verdicts): self._event("claims_judged", verdicts=[v["name"] for v in verdicts])
        def study_finished(self, status, metrics=None, files=None):
            self._event("study_finished", status=status, files=sorted(files or {{}}))
            with open(os.environ["EVENTS"], "w") as f:
                json.dump(self.events, f)
        def where(self): return ["record: in memory"]

    sys.modules["memory_recorder"] = sys.modules[__name__]
    RECORDERS["memory"] = "memory_recorder:MemoryRecorder"  # the one line that registers it
    code = run.main(sys.argv[1:])
    # Ray's usage telemetry imports mlflow itself (to count its own MLflow callbacks): what must stay
    # out is the platform's MLflow recorder
    print("mlflow recorder imported:", any(m.startswith("study.record.mlflow") for m in sys.modules))
    sys.exit(code)
''')


@pytest.mark.slow
def test_a_recorder_of_its_own_receives_every_event_of_a_study_in_order(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT)))
    events_file = tmp_path / "events.json"
    out = subprocess.run([sys.executable, str(driver), "--space", str(ROOT / "search_spaces" / "smoke.yaml"),
                          "--storage", str(tmp_path / "studies"), "--recorder", "memory",
                          "--set", "resources.max_concurrent_trials=2"], cwd=tmp_path,
                         env={**ENV, "EVENTS": str(events_file)}, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "record: in memory" in out.stdout
    assert "mlflow recorder imported: False" in out.stdout, "the study loaded its MLflow recorder while recording elsewhere"
    assert not (tmp_path / "studies" / "mlflow.db").exists()

    events = json.loads(events_file.read_text())
    names = [e["event"] for e in events]
    assert names[0] == "study_started" and names[-3:] == ["reconcile", "selection", "study_finished"], names
    results = pd.read_csv(tmp_path / "studies" / "smoke" / "results.csv", dtype={"trial_id": str})
    trials = set(results.trial_id)
    assert len(trials) == 4  # 2 cells x 2 searched trials
    for trial in trials:
        mine = [(i, e) for i, e in enumerate(events) if e["trial"] == trial]
        kinds = [e["event"] for _, e in mine]
        assert kinds[0] == "trial_started" and kinds[-1] == "trial_done", (trial, kinds)
        steps = [e["step"] for _, e in mine if e["event"] == "trial_result"]
        assert steps == sorted(steps) and len(steps) >= 3, (trial, steps)  # every 20 of 60 steps
        assert [e["final"] for _, e in mine if e["event"] == "trial_result"][-1]  # the last holds the grid
        assert any(e["event"] == "trial_checkpoint" and e["uri"] for _, e in mine)
        done = mine[-1][0]
        assert "snapshot_stored" in names[done:], "a finished trial was never followed by a stored snapshot"
    assert "trial_error" not in names
    assert set(events[-3]["terminated"]) == trials
    selected = pd.read_csv(tmp_path / "studies" / "smoke" / "selected.csv", dtype={"trial_id": str})
    assert sorted(events[-2]["trials"]) == sorted(selected.trial_id) and len(selected) == 2  # one per cell
    finished = events[-1]
    assert finished["status"] == "FINISHED" and "marker" in finished["files"], finished


def test_mlflow_implements_every_event_of_the_protocol():
    """The MLflow recorder answers each of the protocol's methods with the same parameters."""
    from study.record.mlflow.recorder import MlflowRecorder
    from study.record.recorder import RECORDERS, Lookups, Recorder, recorder_class

    assert recorder_class("mlflow") is MlflowRecorder and RECORDERS["mlflow"].endswith(":MlflowRecorder")
    wanted = {n: f for cls in (Recorder, Lookups) for n, f in vars(cls).items()
              if callable(f) or isinstance(f, (classmethod, staticmethod))}
    wanted = {n: f for n, f in wanted.items() if not n.startswith("_")}
    assert {"study_started", "trial_result", "trial_done", "snapshot_stored", "selection", "claims_judged",
            "study_finished", "stored_study", "check_flags"} <= set(wanted)
    for name, proto in wanted.items():
        ours = getattr(MlflowRecorder, name, None)
        assert ours is not None, f"MlflowRecorder has no {name}"
        proto_fn = proto.__func__ if isinstance(proto, (classmethod, staticmethod)) else proto
        ours_fn = getattr(ours, "__wrapped__", ours)
        ours_fn = getattr(ours_fn, "__func__", ours_fn)
        assert list(inspect.signature(ours_fn).parameters) == list(inspect.signature(proto_fn).parameters), name
    assert isinstance(MlflowRecorder.errors, tuple) and MlflowRecorder.errors
    with pytest.raises(KeyError, match="--recorder"):
        recorder_class("nowhere")
    # a recorder of the events alone answers the look-ups with defaults that say what it cannot do
    assert Lookups.check_flags(None, "studies", True) is None and Lookups.cluster_warning(None, None, "s") is None
    with pytest.raises(LookupError, match="keeps no study"):
        Lookups.stored_study("uri", "smoke", "/tmp")


def test_the_code_that_calls_the_recorder_never_names_mlflow():
    """The study's experiment and the Tune adapter speak to a Recorder only."""
    for module in ("study/experiment/tuning.py", "study/experiment/recording.py", "study/record/recorder.py"):
        source = (ROOT / module).read_text()
        imports = [line for line in source.splitlines() if line.lstrip().startswith(("import ", "from "))]
        assert not [line for line in imports if "mlflow" in line.lower()], (module, imports)
