"""What a study reports: the selection (objective, ties within its sampling error to the first
suggested), replicas of the selected config, mean [min-max] over seeds, length vs k extrapolation kept apart; and the record a researcher
reads: MLflow's tags, parent metrics, figures and source, the UI itself in headless Chromium, and
`python -m study.report` rebuilding the report from what was stored."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pandas as pd
import pytest
import torch
import yaml
from conftest import debian_package
from test_study import BIN, ENV, MLFLOW_SERVER_ENV, ROOT, SMOKE, free_port, mlflow_runs, run, write_spec

from study.experiment.search import CellSearcher
from study.results.selection import standard_error
from study.results.tables import mean_and_range, results_frame, select, summarize_seeds
from study.spec.schema import StudySpec
from trial.host import kernels
from trial.loop import summarize


def spec_of(**changes) -> StudySpec:
    raw = json.loads(json.dumps(SMOKE))
    raw.update(changes)
    return StudySpec.model_validate(raw)


# --- the statistics, on hand-made numbers ------------------------------------------------------
def test_the_spread_over_seeds_is_mean_min_and_max():
    assert mean_and_range(pd.Series([0.8, 0.9, 1.0])) == (pytest.approx(0.9), 0.8, 1.0, 3)
    assert mean_and_range(pd.Series([0.7, None]))[::3] == (pytest.approx(0.7), 1)  # what was measured
    mean, low, high, n = mean_and_range(pd.Series([]))
    assert n == 0 and math.isnan(mean) and math.isnan(low) and math.isnan(high)


def frame(rows: list[tuple]) -> pd.DataFrame:
    """results.csv rows: (trial, cell, role, selected_from, seed, lr, val_exact, val_loss, length, k, acc)."""
    out = []
    for t, cell, role, src, seed, lr, ve, vl, length, k, acc in rows:
        out.append({"trial_id": t, "cell": cell, "role": role, "selected_from": src, "seed": seed,
                    "search.optim.lr": lr, "status": "TERMINATED", "val_exact": ve, "val_loss": vl,
                    "acc_in_dist": ve, "acc_beyond": acc, "acc_k_beyond": float("nan"), "exact_in_dist": ve,
                    "exact_beyond": acc, "length": length, "k": k, "ids": "sequential", "answer_acc": acc,
                    "exact_match": acc, "n": 32, "in_distribution": length <= 8})
    return pd.DataFrame(out)


def test_selection_breaks_a_tie_by_the_search_order_and_spreads_use_only_its_seeds():
    spec = spec_of(replicas=3)
    rows = [  # one cell: a and b tie on val_exact (b suggested first), a has the lower val_loss; c is worse
        ("a", "A", "search", None, 0, 1e-3, 1.0, 0.10, 16, 2, 0.50),
        ("b", "A", "search", None, 0, 2e-3, 1.0, 0.30, 16, 2, 0.60),
        ("c", "A", "search", None, 0, 3e-3, 0.9, 0.01, 16, 2, 0.99),
        ("b1", "A", "replica", "b", 1, 2e-3, 1.0, 0.20, 16, 2, 0.70),
        ("b2", "A", "replica", "b", 2, 2e-3, 0.9, 0.20, 16, 2, 0.80),
        ("a1", "A", "replica", "a", 1, 1e-3, 1.0, 0.20, 16, 2, 0.00),  # not of the selected config
    ]
    results = frame([(t, "train_length=8", *rest) for t, _, *rest in rows])
    results["search_index"] = results.trial_id.map({"a": 1, "b": 0, "c": 2})
    selected = select(spec, results)
    row = selected.iloc[0]
    assert (row.trial_id, row.tied, row.chosen_by, row.seeds) == ("b", 2, "first suggested", 3)
    assert (row.acc_beyond_mean, row.acc_beyond_min, row.acc_beyond_max) == (pytest.approx(0.7), 0.6, 0.8)
    summary = summarize_seeds(spec, results, selected)
    assert len(summary) == 1 and summary.seeds.iloc[0] == 3 and summary.answer_acc.iloc[0] == pytest.approx(0.7)
    assert (summary.answer_acc_min.iloc[0], summary.answer_acc_max.iloc[0]) == (0.6, 0.8)


def test_replicas_rerun_the_selected_config_with_new_seeds_after_the_search():
    spec = spec_of(replicas=3)
    searcher = CellSearcher(spec, {"workers_per_trial": 1})
    search = {f"t{i}": searcher.suggest(f"t{i}") for i in range(4)}  # 2 cells x 2 search trials
    assert {c["role"] for c in search.values()} == {"search"} and searcher.suggest("early") is None  # waits
    by_cell = {c: [t for t, cfg in search.items() if cfg["cell"] == c] for c in (0, 1)}
    low, high = by_cell[0]
    final = {"eval_records": []}  # a trial's final report holds its test grid
    searcher.on_trial_complete(low, {"val_exact": 0.9, "val_loss": 0.1, **final})
    searcher.on_trial_complete(high, {"val_exact": 1.0, "val_loss": 0.5, **final})
    replicas = [searcher.suggest(f"r{i}") for i in range(2)]
    assert [r["role"] for r in replicas] == ["replica", "replica"] and {r["cell"] for r in replicas} == {0}
    assert all(r["selected_from"] == high and r["params"] == search[high]["params"] for r in replicas)
    seeds = [search[high]["trial"]["seed"], *(r["trial"]["seed"] for r in replicas)]
    assert len(set(seeds)) == 3 and seeds == [spec.seed, spec.seed + 1, spec.seed + 2]
    assert searcher.suggest("wait") is None  # cell 1's search has not ended
    for t in by_cell[1]:
        searcher.on_trial_complete(t, None, error=True)  # nothing to replicate there
    assert searcher.suggest("done") == "FINISHED"


def test_acc_beyond_is_length_extrapolation_only():
    cfg = __import__("trial.config", fromlist=["TrialConfig"]).TrialConfig.model_validate(
        yaml.safe_load((ROOT / "search_spaces/trials/sparse_parity.yaml").read_text()))
    L, K = cfg.task_instance.train_length, cfg.task_instance.train_k
    recs = [{"length": L, "k": K, "ids": "sequential", "answer_acc": 1.0, "exact_match": 1.0, "in_distribution": True},
            {"length": 2 * L, "k": K, "ids": "sequential", "answer_acc": 0.8, "exact_match": 0.8, "in_distribution": False},
            {"length": 2 * L, "k": K + 1, "ids": "sequential", "answer_acc": 0.0, "exact_match": 0.0,
             "in_distribution": False},
            {"length": L, "k": K + 1, "ids": "sequential", "answer_acc": 0.2, "exact_match": 0.2, "in_distribution": False}]
    out = summarize(recs, cfg)
    assert out["acc_beyond"] == pytest.approx(0.8) and out["acc_k_beyond"] == pytest.approx(0.1)


# --- a study's record -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicated")
    spec = write_spec(tmp, **{"name": "replicated", "replicas": 2, "base/sparsity": None})
    storage = tmp / "studies"
    out = run(["--space", str(spec), "--storage", str(storage)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return {"out": out, "storage": storage, "db": storage / "mlflow.db", "tmp": tmp}


@pytest.mark.slow
def test_the_study_reports_replicas_selection_and_intervals(replicated):
    out, study = replicated["out"].stdout, replicated["storage"] / "replicated"
    results = pd.read_csv(study / "results.csv")
    trials = results.drop_duplicates("trial_id")
    assert len(trials) == 2 * (2 + 1) and (trials.role == "replica").sum() == 2
    selected = pd.read_csv(study / "selected.csv")
    n = SMOKE["base"]["eval"]["val_samples"]
    for row in selected.itertuples():  # the best in-distribution objective, ties within its error to the first
        search = trials[(trials.cell == row.cell) & (trials.role == "search")]
        top = search.val_exact.max()
        tied = search[[top - v <= math.hypot(standard_error(v, n), standard_error(top, n)) for v in search.val_exact]]
        assert row.trial_id == tied.sort_values("search_index").trial_id.iloc[0] and row.seeds == 2
        assert row.tied == len(tied) and row.chosen_by == ("objective" if len(tied) == 1 else "first suggested")
        seeds = trials[(trials.trial_id == row.trial_id) | (trials.selected_from == row.trial_id)].seed
        assert sorted(seeds) == [0, 1]
    summary = pd.read_csv(study / "summary.csv")
    assert (summary.seeds == 2).all()
    assert (summary.answer_acc_min <= summary.answer_acc).all() and (summary.answer_acc <= summary.answer_acc_max).all()
    assert {"accuracy_vs_length.png", "accuracy_by_task_params_train_length.png"} <= {p.name for p in study.iterdir()}
    # the terminal: progress lines, no Tune tables, the selection and where to look
    assert "finished train_length=8" in out and "trials done" in out and "== Status ==" not in out
    assert "selected per cell" in out and "seed(s)" in out
    assert "/mlflow ui --backend-store-uri" in out and "runs?workflowType=machine_learning" in out


@pytest.mark.slow
def test_the_mlflow_record_reads_without_a_guide(replicated):
    client, parents, children = mlflow_runs(replicated["db"], "replicated")
    exp = client.get_experiment_by_name("replicated")
    assert "name: replicated" in exp.tags["mlflow.note.content"]  # description and spec on the experiment
    parent = parents[0]
    assert parent.data.params["grid.task.params.train_length"] == "[8, 12]" and "optim.lr" in str(parent.data.params)
    assert {"cell0/acc_beyond", "cell1/acc_in_dist", "cell0/seeds"} <= set(parent.data.metrics)
    assert len(parent.data.tags["mlflow.source.git.commit"]) == 40
    selected = pd.read_csv(replicated["storage"] / "replicated" / "selected.csv")
    for c in children:
        tags = c.data.tags
        assert tags["role"] in ("search", "replica") and tags["mlflow.source.git.commit"]
        assert (tags["selected"] == "true") == (tags["tune.trial_id"] in set(selected.trial_id))
        assert "acc_at_len24/k2" in c.data.metrics
        assert tags["host.kernels"] == kernels(torch.device("cpu"))  # the path its numbers were computed on
        assert "accuracy_vs_length.png" in {a.path for a in client.list_artifacts(c.info.run_id)}
    assert parent.data.metrics["cell0/seeds"] == 2


@pytest.mark.slow
def test_warm_processes_run_every_trial_in_one_and_record_their_times(replicated):
    """Warm processes (the default; tests/test_warm_processes.py): one trial at a time (the smoke spec's
    resources), Tune keeps a finished trial's actor for the next, so all 6 ran in the first one's
    process; each trial's start-up and step times, and the study's share in steps, are recorded."""
    from test_warm_processes import trial_pids

    assert len(trial_pids(str(replicated["storage"] / "replicated"))) == 1
    assert "time: " in replicated["out"].stdout and "trial slot" in replicated["out"].stdout
    _, parents, children = mlflow_runs(replicated["db"], "replicated")
    assert 0 < parents[0].data.metrics["time/in_steps_share"] <= 1.05
    assert len(children) == 6
    for c in children:
        m = c.data.metrics
        assert m["time/train_s"] > 0 and m["time/eval_s"] > 0
        assert 0 < m["startup/from_schedule_s"] < 900 and m["startup/total_s"] <= m["startup/from_schedule_s"]
        assert not any(k.endswith("_at") for k in m)  # wall-clock stamps are not metrics


@pytest.mark.slow
def test_report_rebuilds_from_the_folder_and_from_mlflow(replicated):
    study = replicated["storage"] / "replicated"
    for source, extra in ((str(study), []), ("replicated", ["--mlflow-uri", f"sqlite:///{replicated['db']}"])):
        out_dir = replicated["tmp"] / f"rebuilt-{len(extra)}"
        proc = subprocess.run([str(BIN / "python"), "-m", "study.report", source, "--out", str(out_dir), *extra],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for name in ("selected.csv", "summary.csv"):
            pd.testing.assert_frame_equal(pd.read_csv(out_dir / name), pd.read_csv(study / name))
        assert (out_dir / "accuracy_vs_length.png").exists() and "selected per cell" in proc.stdout
        for name in ("accuracy_vs_length.png", "accuracy_vs_length.pdf"):  # the figures too, byte for byte
            assert (out_dir / name).read_bytes() == (study / name).read_bytes(), name


def chromium() -> str:
    """Debian's chromium: found, or installed with apt-get (the test setup), else the test skips."""
    return debian_package("chromium", lambda: shutil.which("chromium") or shutil.which("chromium-browser"))


def rendered(browser: str, url: str) -> str:
    """The page's text after its JavaScript ran (headless, no GPU, no sandbox: a root container)."""
    import re

    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000",
                          "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


@pytest.mark.slow
def test_the_mlflow_ui_shows_the_selected_runs_in_headless_chromium(replicated):
    browser = chromium()
    port = free_port()
    # one web worker, no job runner (MLflow's default: 4 workers, a job runner and 7 huey consumers, each
    # importing MLflow, on 2 cores; the page is the same)
    server = subprocess.Popen([str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{replicated['db']}",
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], env=MLFLOW_SERVER_ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "mlflow server did not come up"
                time.sleep(1)
        client, parents, children = mlflow_runs(replicated["db"], "replicated")
        exp_id = parents[0].info.experiment_id
        chosen = [c for c in children if c.data.tags["selected"] == "true"]
        # the runs table (the link the study prints), filtered by the tag: the study's run and its
        # selected children match
        runs = rendered(browser, f"{base}/#/experiments/{exp_id}/runs?workflowType=machine_learning&searchFilter="
                        + urllib.parse.quote("tags.selected = 'true'"))
        assert "replicated" in runs and f"{len(chosen) + 1} matching runs" in runs, runs[-2000:]
        # comparing the selected runs: their names and the selected tag
        ids = urllib.parse.quote(json.dumps([c.info.run_id for c in chosen]))
        compare = rendered(browser, f"{base}/#/compare-runs?runs={ids}&experiments="
                           + urllib.parse.quote(json.dumps([exp_id])))
        assert all(c.info.run_name in compare for c in chosen), compare[-2000:]
        assert "selected " + " ".join(["true"] * len(chosen)) in compare
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_full_tie_goes_to_the_trial_suggested_first_not_to_a_random_id():
    spec = spec_of()
    rows = [("zz", "train_length=8", "search", None, 0, 1e-3, 1.0, 0.0, 16, 2, 0.5),
            ("aa", "train_length=8", "search", None, 0, 2e-3, 1.0, 0.0, 16, 2, 0.9)]
    results = frame(rows).assign(search_index=[0, 1])  # zz was suggested first; ids are random uuids
    assert select(spec, results).trial_id.tolist() == ["zz"]
    assert select(spec, results.assign(search_index=[1, 0])).trial_id.tolist() == ["aa"]


def test_a_trial_stopped_early_is_counted_but_never_selected():
    """ASHA stops a trial before its final report: it has a last validation (here the best of its
    cell) but no test grid. It keeps a row in results.csv, as STOPPED, and neither the searcher nor
    the report selects it."""
    spec = spec_of(replicas=2)
    searcher = CellSearcher(spec, {"workers_per_trial": 1})
    search = {f"t{i}": searcher.suggest(f"t{i}") for i in range(4)}
    done, stopped = [t for t, cfg in search.items() if cfg["cell"] == 0]
    searcher.on_trial_complete(done, {"val_exact": 0.5, "val_loss": 0.9, "eval_records": []})
    searcher.on_trial_complete(stopped, {"val_exact": 1.0, "val_loss": 0.1})  # no final report
    replica = searcher.suggest("r0")
    assert replica["role"] == "replica" and replica["selected_from"] == done

    trials = [{"trial_id": t, "config": search[t], "status": status, "metrics": metrics} for t, status, metrics in (
        (done, "TERMINATED", {"val_exact": 0.5, "val_loss": 0.9, "eval_records": [
            {"length": 8, "k": 1, "ids": "own", "in_distribution": True, "answer_acc": 0.5, "exact_match": 0.5}]}),
        (stopped, "STOPPED", {"val_exact": 1.0, "val_loss": 0.1}))]
    results = results_frame(spec, trials)
    assert set(results.trial_id) == {done, stopped}
    row = results[results.trial_id == stopped].iloc[0]
    assert row.status == "STOPPED" and pd.isna(row.length) and row.val_exact == 1.0
    assert list(select(spec, results).trial_id) == [done]


def test_results_rows_follow_the_plan_not_the_order_tune_returns_trials_in():
    """A resume restores Tune's trials in another order; results.csv must not change with it."""
    spec = spec_of(replicas=2)
    searcher = CellSearcher(spec, {"workers_per_trial": 1})
    configs = {f"t{i}": searcher.suggest(f"t{i}") for i in range(4)}
    trials = [{"trial_id": t, "config": c, "status": "TERMINATED", "metrics": {"val_exact": 1.0, "val_loss": 0.1,
               "eval_records": [{"length": n, "k": 1, "ids": "own", "answer_acc": 1.0} for n in (8, 16)]}}
              for t, c in configs.items()]
    planned = results_frame(spec, trials)
    for order in (trials[::-1], trials[1:] + trials[:1]):
        pd.testing.assert_frame_equal(results_frame(spec, order), planned)
    assert list(planned.cell.drop_duplicates()) == [c.label for c in spec.cells()]


def test_flat_length_metrics_stay_bounded_as_the_grid_grows():
    """A 40-length x 10-k grid gives at most 8 x 4 flat acc_at_len keys, the shortest and longest
    lengths and the smallest and largest k among them; the curves keep every cell."""
    from study.record.mlflow.trial_runs import extrapolation_metrics

    records = [{"length": n, "k": k, "ids": "predicted", "answer_acc": 0.5, "exact_match": 0.5}
               for n in range(10, 410, 10) for k in range(1, 11)]
    records += [{**r, "ids": "coupled"} for r in records]
    metrics = extrapolation_metrics(records, now=0)
    flat = {m.key for m in metrics if m.key.startswith("acc_at_len")}
    assert len(flat) == 8 * 4
    assert {"acc_at_len10/k1", "acc_at_len400/k10", "acc_at_len10/k10", "acc_at_len400/k1"} <= flat
    curves = [m for m in metrics if m.key == "acc_len/k3"]
    assert sorted(m.step for m in curves) == list(range(10, 410, 10))  # the curve keeps every length
    assert {m.key for m in metrics if m.key.endswith("/coupled")} >= {"acc_len/k1/coupled"}
