"""MLflow at scale for a person: a study of N trials recorded into the `mlflow server` at
`--tracking-uri`, read back by `search_runs` and on the UI's runs page in headless Chromium
(docs/cluster.md, "A 1,000-trial study in the UI").

Start a scratch server yourself (PGPASSWORD in its environment), then point the benchmark at it:
    mlflow server --backend-store-uri postgresql+psycopg2://mlflow@127.0.0.1/mlflow --workers 1 &
    python -m benchmarks.mlflow_ui --tracking-uri http://127.0.0.1:5000 --runs 1000 --json FILE
    python -m benchmarks.mlflow_ui --tracking-uri URL --from-sqlite studies/mlflow.db --experiment NAME ...

A new experiment there is filled as study/record/mlflow/recorder.py fills one (synthetic_study), or
copied from a real study's SQLite store (sqlite_study); the page is dumped as opened, sorted and
filtered (page_figures) and clicked through (browse_figures). The keys under "mlflow_ui" in the JSON,
and the figures: docs/cluster.md. tests/test_mlflow_postgres.py starts PostgreSQL and a server.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import html
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from study.record.mlflow.experiment import PARENT_TAG
from study.record.mlflow.recorder import TRIAL_TAG

THREADS, WINDOW = 4, "1280,4000"

# --- a study-shaped record: the default study's trials (sparse parity, train_k x positional) --------
POSITIONAL = [("nope", "sequential"), ("learned", "random_shift"), ("rope", "sequential"), ("alibi", "sequential")]
CELLS = [{"task.params.train_k": k, "positional.encoding": e, "positional.ids": i} for k in (2, 4) for e, i in POSITIONAL]
CONFIG = {"deepspeed.bf16": "False", "deepspeed.zero_stage": "0", "model.d_model": "64", "model.n_heads": "4",
          "model.n_layers": "2", "optim.batch_size": "64", "optim.steps": "1500", "optim.warmup_steps": "100",
          "positional.max_position": "48", "sparsity.k_max": "8", "sparsity.targets": "128",
          "task.name": "sparse_parity", "task.params.min_length": "4", "task.params.train_length": "20"}
REPORTS = (250, 500, 750, 1000, 1250, 1500)  # a trial's report steps; the evaluation points: lengths x k
LENGTHS, KS = (10, 20, 30, 40), (1, 2, 3, 4, 5, 6)
EVERY = ["loss", "lm_loss", "lr", "time/train_s", "time/eval_s"]  # the loop's, besides the catalogue's
STARTUP = [f"startup/{s}_s" for s in ("imports", "distributed", "task", "model", "engine", "data", "restore",
                                      "first_step", "total", "from_schedule")]
SPARSITY = [f"sparsity/{s}" for s in ("k_match", "k_mean", "k_median", "k_p90", "k_planted_median", "precision",
                                      "recall", "seconds_per_1k_targets", "targets", "targets_counted",
                                      "targets_flat", "unrecovered")]
SOURCE = {"mlflow.source.name": "study/run.py", "mlflow.source.type": "LOCAL", "mlflow.source.git.commit": "0" * 40,
          "code.dirty": "false"}


def synthetic_study(n: int, seed: int = 0) -> tuple[dict, list[dict]]:
    """(parent, children), each {"name", "tags", "params", "metrics": [(key, value, step)], "start",
    "end"}: what study/record/mlflow/recorder.py records of a study of len(CELLS) cells and n trials."""
    from study.record.mlflow.trial_runs import extrapolation_metrics
    from trial.metrics import CATALOGUE

    rng = random.Random(seed)
    every = EVERY + [m.name for m in CATALOGUE if m.when == "every" and not m.name.endswith("/*")]
    end = SPARSITY + [m.name for m in CATALOGUE if m.when == "end" and "/" not in m.name
                      and not m.name.startswith("loss_") and m.name not in ("answer_acc", "exact_match", "id_match")]
    t0 = int(time.time() * 1000) - n * 2000 - 3_600_000
    trial_ids = set()
    while len(trial_ids) < n:
        trial_ids.add(f"{rng.getrandbits(32):08x}")
    children = []
    for i, trial_id in enumerate(sorted(trial_ids, key=lambda _: rng.random())):
        cell, replica, lr = CELLS[i % len(CELLS)], i >= n * 3 // 4, str(10 ** rng.uniform(-3.3, -2.3))
        label = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in cell.items())
        params = {**CONFIG, "optim.lr": lr, "search.optim.lr": lr, "seed": str(1 + i % 3 if replica else 0),
                  **{k: str(v) for k, v in cell.items()}}
        tags = {TRIAL_TAG: trial_id, "cell": label, "role": "replica" if replica else "search",
                "selected": str(i < len(CELLS)).lower(), **SOURCE, **{f"factor.{k}": str(v) for k, v in cell.items()},
                "checkpoint": f"s3://YOUR-BUCKET/studies/scale/tune/cell{i % len(CELLS)}-{trial_id}/checkpoint_000005"}
        skill = rng.random()
        metrics = [(key, rng.random() * skill * (j + 1) / len(REPORTS) if "acc" in key or "exact" in key
                    else rng.uniform(0.1, 2.0), step) for j, step in enumerate(REPORTS) for key in every]
        metrics += [(key, rng.uniform(0.05, 5.0), REPORTS[0]) for key in STARTUP]
        metrics += [(key, rng.random() * skill, REPORTS[-1]) for key in end]
        records = [{"length": length, "k": k, "ids": "sequential", "answer_acc": skill * rng.random(),
                    "exact_match": skill * rng.random()} for length in LENGTHS for k in KS]
        metrics += [(m.key, m.value, m.step) for m in extrapolation_metrics(records, 0)]
        start = t0 + i * 2000
        children.append({"name": f"{label} #{trial_id[-5:]}", "tags": tags, "params": params, "metrics": metrics,
                         "start": start, "end": start + 60_000})
    params = {"grid.task.params.train_k": "[2, 4]", "grid.positional": json.dumps(
        [{"encoding": e, "ids": i} for e, i in POSITIONAL]), "search.optim.lr": '{"loguniform": [0.0005, 0.005]}',
        "search.sampler": "tpe", "search.trials_per_cell": str(max(1, n * 3 // 4 // len(CELLS))),
        "objective": "max val_exact (ties: lower val_loss)", "replicas": "3", "cells": str(len(CELLS)),
        "task": "sparse_parity", "seed": "0"}
    selected = ["acc_beyond", "acc_in_dist", "acc_k_beyond", "exact_beyond", "exact_in_dist", "val_exact", "val_loss",
                "seeds", *(f"sparsity/{s}" for s in ("k_match", "k_median", "k_p90", "precision", "recall", "targets_flat"))]
    metrics = [(f"cell{c}/{key}", rng.random(), 0) for c in range(len(CELLS)) for key in selected]
    metrics += [("time/in_steps_share", 0.93, 0), ("time/trials_in_steps_s", 1033.0, 0), ("time/wall_since_ray_s", 558.0, 0)]
    tags = {PARENT_TAG: "true", "mlflow.note.content": f"a synthetic study of {n} trials", **SOURCE,
            "study.id": f"{rng.getrandbits(128):032x}", "study.location": "s3://YOUR-BUCKET/studies/scale"}
    parent = {"name": "scale", "params": params, "metrics": metrics, "tags": tags, "start": t0 - 1000,
              "end": t0 + n * 2000 + 120_000}
    return parent, children


def sqlite_study(db: str, experiment: str, n: int | None = None) -> tuple[dict, list[dict]]:
    """A real study's record in a SQLite MLflow store, as synthetic_study gives one: the parent run
    with the most (active) children in the experiment, and its children, the first n by start time.
    Read-write (`mode=rw` never creates the file): a study killed mid-write leaves a hot journal, which
    a read-only connection cannot roll back."""
    con = sqlite3.connect(f"file:{db}?mode=rw", uri=True, timeout=30)
    try:
        found = con.execute("SELECT experiment_id FROM experiments WHERE name = ?", (experiment,)).fetchone()
        if found is None:
            names = [r[0] for r in con.execute("SELECT name FROM experiments")]
            raise SystemExit(f"error: --experiment: no experiment {experiment!r} in {db} (there: {', '.join(names)})")
        runs = {r[0]: {"name": r[1], "status": r[2], "start": r[3], "end": r[4], "tags": {}, "params": {}, "metrics": []}
                for r in con.execute("SELECT run_uuid, name, status, start_time, end_time FROM runs "
                                     "WHERE experiment_id = ? AND lifecycle_stage = 'active'", found)}

        def rows(table: str, columns: str, ids: list[str]):
            return con.execute(f"SELECT run_uuid, {columns} FROM {table} WHERE run_uuid IN "
                               f"({','.join('?' * len(ids))})", ids)

        for run_id, key, value in rows("tags", "key, value", list(runs)):
            runs[run_id]["tags"][key] = value
        parent_of = {r: run["tags"].pop("mlflow.parentRunId", None) for r, run in runs.items()}
        counts = {p: list(parent_of.values()).count(p) for p in set(parent_of.values()) if p in runs}
        if not counts:
            raise SystemExit(f"error: experiment {experiment!r} in {db} has no parent run with children")
        parent_id = max(counts, key=counts.get)
        keep = [parent_id, *sorted((r for r, p in parent_of.items() if p == parent_id),
                                   key=lambda r: runs[r]["start"] or 0)[:n]]
        for run_id, key, value in rows("params", "key, value", keep):
            runs[run_id]["params"][key] = value
        for run_id, key, value, step, ts, nan in rows("metrics", "key, value, step, timestamp, is_nan", keep):
            runs[run_id]["metrics"].append((key, float("nan") if nan else value, step, ts))
    finally:
        con.close()
    for run_id in keep:
        runs[run_id]["tags"].pop("mlflow.runName", None)
    return runs[parent_id], [runs[r] for r in keep[1:]]


# --- through the server --------------------------------------------------------------------------
def record_run(client: MlflowClient, experiment_id: str, run: dict, parent_id: str | None = None) -> str:
    """One run as the tracker records it: create_run with its tags, log_batch, then its status."""
    tags = {**run["tags"], **({"mlflow.parentRunId": parent_id} if parent_id else {})}
    run_id = client.create_run(experiment_id, start_time=run["start"], tags=tags, run_name=run["name"]).info.run_id
    params = [Param(k, str(v)[:6000]) for k, v in sorted(run["params"].items())]
    metrics = [Metric(m[0], m[1], m[3] if len(m) > 3 else run["start"] + 40 * m[2], m[2]) for m in run["metrics"]]
    while params or metrics:  # log_batch takes at most 100 params and 1000 values in all
        batch_params, params = params[:100], params[100:]
        cut = 1000 - len(batch_params)
        client.log_batch(run_id, metrics=metrics[:cut], params=batch_params)
        metrics = metrics[cut:]
    if (run.get("status") or "FINISHED") != "RUNNING":
        client.set_terminated(run_id, run.get("status") or "FINISHED", end_time=run["end"])
    return run_id


def fill(url: str, parent: dict, children: list[dict], experiment: str) -> dict:
    client = MlflowClient(url)
    experiment_id = client.create_experiment(experiment)
    parent_id = record_run(client, experiment_id, parent)
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        child_ids = list(pool.map(lambda run: record_run(client, experiment_id, run, parent_id), children))
    return {"experiment_id": experiment_id, "parent_id": parent_id, "child_ids": child_ids}


def search_figures(url: str, ids: dict, repeats: int = 3) -> dict:
    """`MlflowClient.search_runs`, every page, the median of `repeats`: in pages of 1000 (the
    client's default) and of 100 (the UI's), the first page of 100, the children by their tag."""
    client, exp = MlflowClient(url), ids["experiment_id"]

    def all_runs(page: int, filter_string: str = "") -> tuple[int, int]:  # (runs, pages)
        runs = pages = 0
        token = None
        while pages == 0 or token:
            found = client.search_runs([exp], filter_string, max_results=page, page_token=token)
            runs, pages, token = runs + len(found), pages + 1, found.token
        return runs, pages

    def timed(fn) -> tuple[float, object]:  # (the median seconds, the last result)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times), 3), out

    out = {}
    out["search_runs_s"], (out["search_runs_runs"], out["search_runs_pages"]) = timed(lambda: all_runs(1000))
    out["search_runs_page100_s"], (out["search_runs_page100_runs"], out["search_runs_page100_pages"]) = \
        timed(lambda: all_runs(100))
    out["search_runs_first_page100_s"], _ = timed(lambda: client.search_runs([exp], max_results=100))
    out["children_search_s"], (out["children_search_runs"], _) = timed(
        lambda: all_runs(1000, f"tags.`mlflow.parentRunId` = '{ids['parent_id']}'"))
    return out


# --- the runs page, dumped -----------------------------------------------------------------------
def chromium() -> str:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome") or \
        sys.exit("error: no chromium on PATH (Debian/Ubuntu: apt-get install chromium): the page needs a browser")


def seen(dom: str, ids: dict, names: list[str]) -> dict:
    """What a page shows: its "N matching runs", the runs with a row in the DOM (ag-grid's row-id
    is the run id), the child names in its text, and whether it offers "Load more"."""
    text = html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)))
    matching = re.findall(r"(\d+) matching runs?", text)
    rows = set(re.findall(r'row-id="([0-9a-f]{32})"', dom))
    return {"matching_runs": int(matching[-1]) if matching else None, "child_rows": len(rows & set(ids["child_ids"])),
            "parent_row": ids["parent_id"] in rows, "child_names": sum(1 for name in names if name in text),
            "load_more": "Load more" in text}


def page_figures(browser: str, url: str, ids: dict, names: list[str], budget_ms: int) -> dict:
    """The runs page in Chromium's `--dump-dom` after `--virtual-time-budget` (wall time with
    Chromium's start), as opened, sorted by a metric, filtered to the children. The UI fetches runs
    100 at a time ("Load more"), plus the parent of children it got, and "N matching runs" counts
    what it loaded. In its default order (start time) it nests children under their parent,
    collapsed, filtered or not (neither the URL nor a shared view can expand them); sorted by a
    metric the table is flat. It renders the rows in view only (a 1280x4000 window here)."""
    base = f"{url}/#/experiments/{ids['experiment_id']}/runs?workflowType=machine_learning"
    views = {"page": base,
             "sorted": base + "&orderByKey=" + urllib.parse.quote("metrics.`val_exact`") + "&orderByAsc=false",
             "filtered": base + "&searchFilter=" + urllib.parse.quote(f"tags.mlflow.parentRunId = '{ids['parent_id']}'")}
    out = {"page_url": base, "virtual_time_budget_ms": budget_ms, "window": WINDOW}
    for view, link in views.items():
        start = time.perf_counter()
        dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WINDOW}",
                              f"--virtual-time-budget={budget_ms}", "--dump-dom", link],
                             capture_output=True, text=True, timeout=300, check=False).stdout
        out[f"{view}_wall_s"] = round(time.perf_counter() - start, 2)
        out.update({f"{view}_{k}": v for k, v in seen(dom, ids, names).items()})
    return out


# --- a person at the runs page: expand the study, "Load more" until every run is there ------------
MORE = 'button[data-component-id$="loadmorerowrenderer.tsx_20"]'
EXPAND = '[row-id="{}"] button[data-component-id$="runnamecellrenderer.tsx_46"]'  # a parent run's expander
CLICK_JS = "(() => {{ const b = document.querySelector('{}'); if (b) b.click(); return !!b; }})()"
STATE_JS = """(() => {
  // scrolled to the bottom, where the "Load more" row is (the table renders the rows in view only)
  document.querySelectorAll('.ag-body-viewport').forEach(v => { v.scrollTop = v.scrollHeight; });
  const m = [...(document.body ? document.body.innerText : "").matchAll(/(\\d+) matching runs?/g)].pop();
  const more = document.querySelector('MORE');
  const rows = new Set([...document.querySelectorAll('[row-id]')].map(e => e.getAttribute('row-id')));
  return JSON.stringify({matching: m ? +m[1] : null, more: !!more,
                         busy: !!(more && more.getAttribute('loading') === 'true'), rows: [...rows]});
})()""".replace("MORE", MORE)


async def _browse(port: int, url: str, ids: dict, timeout: float) -> dict:
    import aiohttp  # Ray's dashboard depends on it: here wherever Ray is

    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json") as r:
            target = next(t for t in await r.json() if t["type"] == "page")
        async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            counter = iter(range(1, 1 << 30))

            async def call(method: str, **params) -> dict:
                n = next(counter)
                await ws.send_json({"id": n, "method": method, "params": params})
                while (msg := await ws.receive_json()).get("id") != n:
                    pass
                return msg.get("result", {})

            async def evaluate(expression: str):
                got = await call("Runtime.evaluate", expression=expression, returnByValue=True)
                if "exceptionDetails" in got:
                    raise RuntimeError(f"the runs page: {got['exceptionDetails']}")
                return got.get("result", {}).get("value")

            async def state() -> dict:  # none yet while the page is (re)loading
                got = await evaluate(STATE_JS)
                return json.loads(got) if got else {"matching": None, "more": False, "busy": False, "rows": []}

            async def until(pred, what: str) -> tuple[float, dict]:
                start, end = time.perf_counter(), time.time() + timeout
                while not pred(st := await state()):
                    if time.time() > end:
                        raise RuntimeError(f"the runs page: no {what} within {timeout:.0f} s (last: "
                                           f"{ {k: v for k, v in st.items() if k != 'rows'} })")
                    await asyncio.sleep(0.05)
                return time.perf_counter() - start, st

            children, out = set(ids["child_ids"]), {}
            start = time.perf_counter()
            await call("Page.navigate", url=url)
            _, st = await until(lambda s: s["matching"] is not None and not s["busy"] and ids["parent_id"] in s["rows"],
                                "table with the study's run")
            out["open_s"] = round(time.perf_counter() - start, 2)
            out["open_matching_runs"], out["open_child_rows"] = st["matching"], len(children & set(st["rows"]))
            if not await evaluate(CLICK_JS.format(EXPAND.format(ids["parent_id"]))):
                raise RuntimeError("the runs page: the study's run has no expander")
            wait, _ = await until(lambda s: children & set(s["rows"]), "child rows after expanding")
            await asyncio.sleep(0.5)  # the rows rendered, all of them
            st = await state()
            out["expand_s"], out["expanded_child_rows"] = round(wait, 2), len(children & set(st["rows"]))
            load_start, each = time.perf_counter(), []
            while st["matching"] < len(children) + 1:  # a person scrolls down and clicks "Load more"
                _, st = await until(lambda s: s["more"] and not s["busy"],
                                    f"Load more button with {st['matching']} of {len(children) + 1} runs loaded")
                before = st["matching"]
                await evaluate(CLICK_JS.format(MORE))
                wait, st = await until(lambda s, b=before: s["matching"] != b and not s["busy"], "runs after Load more")
                each.append(round(wait, 2))
            out["load_more_clicks"], out["load_more_each_s"] = len(each), each
            out["load_all_s"] = round(time.perf_counter() - load_start, 2)
            out["all_matching_runs"], out["to_every_run_s"] = st["matching"], round(time.perf_counter() - start, 2)
            return out


def browse_figures(browser: str, url: str, ids: dict, timeout: float = 120) -> dict:
    """Open the runs page (open_s: until the table shows the study's run and "N matching runs"),
    expand the study's run (expand_s, expanded_child_rows), then "Load more" until the UI has every
    run (load_more_clicks, load_more_each_s: a click to its runs in the table, load_all_s,
    all_matching_runs; to_every_run_s from opening the page): wall time, not virtual."""
    link = f"{url}/#/experiments/{ids['experiment_id']}/runs?workflowType=machine_learning"
    profile = tempfile.mkdtemp(prefix="mlflow-ui-chromium-")
    proc = subprocess.Popen([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WINDOW}",
                             "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file, deadline = Path(profile) / "DevToolsActivePort", time.time() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.time() > deadline or proc.poll() is not None:
                return {"browse_error": "chromium did not open its DevTools port"}
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        return {f"browse_{k}": v for k, v in asyncio.run(_browse(port, link, ids, timeout)).items()}
    except Exception as e:  # noqa: BLE001 (the other figures stand without these)
        return {"browse_error": f"{type(e).__name__}: {e}"}
    finally:
        if proc.poll() is None:  # Chromium and its children (its own process group)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


# --- the benchmark -----------------------------------------------------------------------------------
def version(cmd: str) -> str:
    try:
        out = subprocess.run([cmd, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    return (out.strip().splitlines() or ["?"])[-1]


def server_version(url: str) -> str | None:
    """The MLflow version the server at `url` answers on /version; None where nothing answers /health."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10):
            pass
    except OSError:
        return None
    try:
        with urllib.request.urlopen(f"{url}/version", timeout=10) as r:
            return r.read().decode().strip()[:40]
    except OSError:
        return "?"


def run_benchmark(url: str, runs: int | None, from_sqlite: str | None = None, experiment: str | None = None,
                  repeats: int = 3, budget_ms: int = 30000, browse: bool = True, server: str = "") -> dict:
    """The figures for the `mlflow server` at `url` (described by `server`, for the JSON), into an
    experiment of its own there, named for the source and the time."""
    import mlflow

    browser = chromium()
    if from_sqlite:
        (parent, children), source = sqlite_study(from_sqlite, experiment, runs), f"{from_sqlite} experiment {experiment}"
    else:
        (parent, children), source = synthetic_study(runs or 1000), "synthetic"
    k = max(1, len(children))
    out = {"source": source, "children": len(children), "runs": len(children) + 1,
           "params_per_child": round(sum(len(c["params"]) for c in children) / k, 1),
           "tags_per_child": round(sum(len(c["tags"]) + 2 for c in children) / k, 1),  # + runName, parentRunId
           "metric_keys_per_child": round(sum(len({m[0] for m in c["metrics"]}) for c in children) / k, 1),
           "metric_values_per_child": round(sum(len(c["metrics"]) for c in children) / k, 1),
           "cpus": os.cpu_count(), "load_avg_1m_before": round(os.getloadavg()[0], 2), "mlflow": mlflow.__version__,
           "chromium": version(browser), "tracking_uri": url, "server": server or "not described (--server)",
           "server_mlflow": server_version(url),
           "experiment": f"{parent['name']}-mlflow_ui-{time.strftime('%Y%m%d-%H%M%S')}-{random.getrandbits(16):04x}"}
    start = time.perf_counter()
    ids = fill(url, parent, children, out["experiment"])
    out["fill_s"] = round(time.perf_counter() - start, 1)
    out["fill_ms_per_run"] = round(1000 * out["fill_s"] / (len(children) + 1), 1)
    out.update(search_figures(url, ids, repeats))
    out.update(page_figures(browser, url, ids, [c["name"] for c in children], budget_ms))
    if browse:
        out.update(browse_figures(browser, url, ids))
    out["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    return out


def print_summary(r: dict) -> None:
    def g(*keys):
        return " / ".join((" ".join(map(str, v)) or "-") if isinstance(v, list) else str(v) for v in map(r.get, keys))

    print(f"mlflow_ui: {g('children')} child runs + 1 ({g('source')}; a child's params / tags / metric keys / values: "
          f"{g('params_per_child', 'tags_per_child', 'metric_keys_per_child', 'metric_values_per_child')}); MLflow "
          f"{g('mlflow')} (server {g('server_mlflow')}), {g('chromium')}; load "
          f"{g('load_avg_1m_before', 'load_avg_1m_after')}")
    print(f"  server {g('tracking_uri')}: {g('server')}; experiment {g('experiment')}")
    print(f"  fill {g('fill_s')} s; search_runs of {g('search_runs_runs')} runs {g('search_runs_s')} s (pages of 100: "
          f"{g('search_runs_page100_s')} s, the first {g('search_runs_first_page100_s')} s); children "
          f"{g('children_search_s')} s")
    for view in ("page", "sorted", "filtered"):
        print(f"  {view}: {g(view + '_wall_s')} s, \"{g(view + '_matching_runs')} matching runs\", child rows / names "
              f"{g(view + '_child_rows', view + '_child_names')}, study row / Load more "
              f"{g(view + '_parent_row', view + '_load_more')}")
    print("  clicking through: " + (g("browse_error") if "browse_error" in r else
          f"open {g('browse_open_s')} s (\"{g('browse_open_matching_runs')} matching runs\"), expand "
          f"{g('browse_expand_s')} s ({g('browse_expanded_child_rows')} child rows), Load more x"
          f"{g('browse_load_more_clicks')} ({g('browse_load_more_each_s')} s) to \"{g('browse_all_matching_runs')} "
          f"matching runs\", {g('browse_to_every_run_s')} s after opening"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tracking-uri", required=True, metavar="URL",
                   help="the `mlflow server` to measure, http://HOST:PORT (a new experiment is left there)")
    p.add_argument("--server", default="", metavar="TEXT",
                   help="what that server is, for the JSON and the summary: its backend store, workers, versions")
    p.add_argument("--runs", type=int, help="child runs (synthetic: default 1000; --from-sqlite: the first N)")
    p.add_argument("--from-sqlite", metavar="DB", help="copy a real study from this SQLite MLflow store")
    p.add_argument("--experiment", metavar="NAME", help="with --from-sqlite: the study's experiment")
    p.add_argument("--repeats", type=int, default=3, help="search_runs timings: the median of this many")
    p.add_argument("--virtual-time-budget", type=int, default=30000, metavar="MS", help="for the dumped pages")
    p.add_argument("--no-browse", action="store_true", help="skip the clicked-through page (DevTools protocol)")
    p.add_argument("--json", metavar="FILE", help="write the figures under \"mlflow_ui\" (other keys kept)")
    args = p.parse_args(argv)
    if args.from_sqlite and not args.experiment:
        p.error("--from-sqlite needs --experiment")
    url = args.tracking_uri.rstrip("/")
    if not url.startswith(("http://", "https://")):
        p.error(f"--tracking-uri: {url!r} is not an `mlflow server` (http://HOST:PORT)")
    if server_version(url) is None:
        p.error(f"--tracking-uri: no MLflow server answers at {url}/health")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # no "View run at" per run
    r = run_benchmark(url, args.runs, args.from_sqlite, args.experiment, args.repeats, args.virtual_time_budget,
                      not args.no_browse, args.server)
    print_summary(r)
    if args.json:
        data = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        Path(args.json).write_text(json.dumps({**data, "mlflow_ui": r}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
