"""What one trial leaves in its MLflow run besides Tune's metrics: its evaluation points as metrics
and a table, its accuracy-by-length figure, and the tables and figures of its analyses.

The evaluation points' metrics: `acc_len/k{K}` (and `exact_len`, `loss_len`) with the test length as the step,
so MLflow's chart of it is the extrapolation curve; the same accuracy as flat `acc_at_len{N}/k{K}`
keys, which the runs table can show side by side, for at most 8 lengths x 4 k (evenly spaced, the
shortest and longest among them): a run's metrics stay bounded as the points grow. With `eval.select`
the points are also scored for the best checkpoint: the same keys under `best/`. Every point is
always in `eval/records.csv` (its `checkpoint` column: last, best).
"""

from __future__ import annotations

import io
import math

from mlflow.entities import Metric


def log_final_artifacts(client, run_id: str, result: dict, trial_config: dict) -> None:
    """The tables, figures and kernel-path tag of a trial's last report (none in earlier reports)."""
    if isinstance(result.get("host/kernels"), str):  # a path, not a quantity: a tag, searchable
        client.set_tag(run_id, "host.kernels", result["host/kernels"])
    records = result.get("eval_records")
    if records:
        client.log_text(run_id, records_csv(records), "eval/records.csv")
        log_trial_plot(client, run_id, [r for r in records if r.get("checkpoint", "last") == "last"], trial_config)
    log_analyses(client, run_id, result, trial_config)


def log_trial_plot(client, run_id: str, records: list[dict], trial_config: dict) -> None:
    import tempfile

    from study.results.figures import plot_trial, vector_copy
    from study.results.tables import train_sizes

    train_length, _ = train_sizes(trial_config["task"])
    with tempfile.TemporaryDirectory() as tmp:  # at the root: the compare view shows common artifacts
        png = plot_trial(records, train_length, f"{tmp}/accuracy_vs_length.png", trial_config)
        client.log_artifact(run_id, png)
        client.log_artifact(run_id, vector_copy(png))

def log_analyses(client, run_id: str, result: dict, trial_config: dict) -> None:
    """Each analysis's tables and figures under its name (`sparsity/targets.csv`), as it writes them."""
    import tempfile

    from study.results.figures import trial_title
    from trial.analyses import REGISTERED, table_key

    for name, analysis in REGISTERED.items():
        tables = {t: result[table_key(name, t)] for t in analysis.tables if result.get(table_key(name, t))}
        if not tables or not trial_config.get(name):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            analysis.model_validate(trial_config[name]).write_artifacts(tables, tmp, trial_title(trial_config))
            client.log_artifacts(run_id, tmp, name)


def extrapolation_metrics(records: list[dict], now: int) -> list[Metric]:
    """The evaluation points as MLflow metrics: per k and id mode a curve over length (one key each), and flat
    `acc_at_len{N}/k{K}` keys for at most FLAT_LENGTHS x FLAT_KS cells of the model's own ids, so a
    run's metric count stays bounded as the points grow (every point is in eval/records.csv). The
    best checkpoint's records (eval.select) give the same keys under `best/`."""
    last = [r for r in records if r.get("checkpoint", "last") == "last"]
    best = [r for r in records if r.get("checkpoint") == "best"]
    out = _point_metrics(last, now)
    if best:
        out += [Metric(f"best/{m.key}", m.value, m.timestamp, m.step) for m in _point_metrics(best, now)]
    return out


def _point_metrics(records: list[dict], now: int) -> list[Metric]:
    primary = records[0]["ids"]  # the model's own ids come first (PPC: predicted)
    out = []
    for r in records:
        suffix = "" if r["ids"] == primary else f"/{r['ids']}"
        k = "all" if r["k"] is None else r["k"]
        for key, value in (("acc_len", r["answer_acc"]), ("exact_len", r["exact_match"]),
                           ("token_acc_len", r.get("answer_token_acc")), ("loss_len", r.get("loss"))):
            if value is not None and math.isfinite(value):
                out.append(Metric(f"{key}/k{k}{suffix}", value, now, int(r["length"])))
    # flat keys that say their length: the runs table shows a metric's last step only, which for
    # acc_len/k{K} is the longest length with nothing saying so
    own = [r for r in records if r["ids"] == primary]
    lengths = evenly_spaced(sorted({int(r["length"]) for r in own}), FLAT_LENGTHS)
    ks = evenly_spaced(sorted({r["k"] for r in own if r["k"] is not None}), FLAT_KS)
    for r in own:
        if int(r["length"]) in lengths and (r["k"] is None or r["k"] in ks) and math.isfinite(r["answer_acc"]):
            k = "all" if r["k"] is None else r["k"]
            out.append(Metric(f"acc_at_len{int(r['length'])}/k{k}", r["answer_acc"], now, 0))
    return out


FLAT_LENGTHS, FLAT_KS = 8, 4  # flat acc_at_len keys: at most 32 per run, however many points


def evenly_spaced(values: list, n: int) -> list:
    """At most n of the sorted values, evenly spaced, the first and the last among them."""
    if len(values) <= n:
        return values
    return [values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)]


def is_metric(key: str, value) -> bool:
    if key in ("step", "training_iteration", "timestamp", "time_this_iter_s", "time_total_s",
               "pid", "done", "iterations_since_restore", "time_since_restore") or key.endswith("_at"):
        return False  # Tune's bookkeeping; *_at: wall-clock times, not quantities to plot
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def records_csv(records: list[dict]) -> str:
    import pandas as pd

    buf = io.StringIO()
    pd.DataFrame(records).to_csv(buf, index=False)
    return buf.getvalue()

