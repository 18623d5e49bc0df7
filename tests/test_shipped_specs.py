"""The platform's own study specs (search_spaces/*.yaml) run for real, shrunk to a few steps: a spec's
trials must train and its study must finish, which `--dry-run` alone does not show. The experiment
specs (search_spaces/experiments/) are loaded and dry-run by the fast tier (tests/test_study.py and
tests/test_claims.py); what their studies do end to end, the platform's specs and the claim study of
tests/test_claim_study.py already run, so a new experiment adds no minutes here.

A spec is shrunk only in size: a few steps (a searched warmup too) and evaluation samples, a tiny
model of the same head count, one CPU worker, the first two values of a factor that is not the
positional scheme (every scheme is kept, since each builds a different model), and where the spec
searches, one search trial per cell and at most one replica of its config (where it has replicas,
they run). The task, the schemes, the search, the scheduler, ZeRO stage and bf16, and the analyses stay
as shipped. A Hugging Face corpus (`hf:`, nothing may be downloaded here) becomes the stdlib corpus:
the hub loader is tested on local data in tests/test_lm_task.py.

All specs run as studies in one driver process, so they share one local Ray (about 10 s of start-up
saved per spec), and each runs one trial at a time: a study's trial processes are most of its cost
(torch, DeepSpeed), and one instead of two cut the CPU time by a third (docs/speed.md); the smoke
studies of the other tests run two at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import yaml
from test_study import ENV, ROOT, mlflow_runs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # beyond its run's own 1,500 s bound

SHIPPED = sorted(p for p in (ROOT / "search_spaces").glob("*.yaml") if p.stem != "smoke")  # smoke: test_study
assert not any(p.parent.name == "experiments" for p in SHIPPED)


def shrink(spec: dict) -> dict:
    spec = json.loads(json.dumps(spec))
    spec["name"] = f"shrunk_{spec['name']}"
    base = spec.setdefault("base", {})
    searched = spec["search"].get("params", {}) if isinstance(spec.get("search"), dict) else {}
    few = {"steps": 4, "batch_size": 4}
    if "optim" in spec.get("grid", {}):  # the grid sets whole optim groups: shrink each of them
        spec["grid"]["optim"] = [{**o, **few, "warmup_steps": 0} for o in spec["grid"]["optim"]]
    else:
        base["optim"] = {**base.get("optim", {}), **few}
        if "optim.warmup_steps" in searched:  # still searched, within the few steps
            searched["optim.warmup_steps"] = {"choice": [0, 2]}
        else:
            base["optim"]["warmup_steps"] = 0
    ev = base.setdefault("eval", {})
    ev.update(every_steps=2, samples_per_point=4, val_samples=4, batch_size=4)
    if "track" in ev:
        ev.update(track=ev["track"][:1], track_samples=4)
    if "select" in ev:
        ev["select"].update(lengths=ev["select"]["lengths"][:1], samples=4)
    for key in ("lengths", "ks"):
        if key in ev:
            ev[key] = ev[key][:2]
    if "model" in spec.get("grid", {}):  # the grid sets whole model groups: shrink each of them
        spec["grid"]["model"] = [{**m, "d_model": 8 * m.get("n_heads", 2), "n_layers": 1} for m in spec["grid"]["model"]]
    else:
        heads = base.get("model", {}).get("n_heads", 2)
        base["model"] = {**base.get("model", {}), "d_model": 8 * heads, "n_layers": 1}
    for section in ("sparsity", "loss_gap"):  # the analyses: two targets, a short context, small k
        if section in base:
            base[section]["targets"] = 2
            if "long_context" in base[section]:
                base[section].update(long_context=48, short_context=16)
    if "k_max" in base.get("sparsity", {}):
        base["sparsity"]["k_max"] = 2
    if "loss_gap" in base:
        base["loss_gap"].update(ks=[1, 2], sparse_k=2)
    params = spec["task"].setdefault("params", {})
    if str(params.get("corpus", "")).startswith("hf:"):
        for key in ("hf_config", "hf_split"):
            params.pop(key, None)
        params.update(corpus="stdlib", max_bytes=400_000)
    spec["grid"] = {path: values if path.startswith("positional") else values[:2]
                    for path, values in spec.get("grid", {}).items()}
    if isinstance(spec.get("search"), dict):
        spec["search"]["trials_per_cell"] = 1
        spec["replicas"] = min(spec.get("replicas", 1), 2)
    else:
        spec["replicas"] = 1
    spec["resources"] = {**spec.get("resources", {}), "workers_per_trial": 1, "cpus_per_worker": 1,
                         "gpus_per_worker": 0, "max_concurrent_trials": 1}
    return spec


def test_every_shipped_spec_runs_shrunk(tmp_path):
    specs = []
    for path in SHIPPED:
        shrunk = tmp_path / path.name
        shrunk.write_text(yaml.safe_dump(shrink(yaml.safe_load(path.read_text()))))
        specs.append(str(shrunk))
    storage = tmp_path / "studies"
    driver = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        from study.run import main
        codes = {{}}
        for spec in {specs!r}:
            codes[spec] = main(["--space", spec, "--storage", {str(storage)!r}])
        print("EXIT CODES " + json.dumps(codes), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=1500)
    tail = out.stdout[-6000:] + out.stderr[-6000:]
    assert out.returncode == 0 and "EXIT CODES" in out.stdout, tail
    codes = json.loads(out.stdout.split("EXIT CODES ", 1)[1].splitlines()[0])
    assert codes == {s: 0 for s in specs}, tail
    for path in SHIPPED:
        raw = shrink(yaml.safe_load(path.read_text()))
        results = pd.read_csv(storage / raw["name"] / "results.csv")
        selected = pd.read_csv(storage / raw["name"] / "selected.csv")
        cells = 1
        for values in raw["grid"].values():
            cells *= len(values)
        assert selected.cell.nunique() == cells, path.name  # every cell ran and has a selection
        per_cell = raw["search"]["trials_per_cell"] + raw["replicas"] - 1 if isinstance(raw.get("search"), dict) \
            else raw["replicas"]
        assert results.trial_id.nunique() == cells * per_cell, path.name
        if "select" in raw["base"].get("eval", {}):  # eval.select: the grid of both checkpoints, in both records
            assert set(results.checkpoint) == {"last", "best"}, path.name
            _, _, children = mlflow_runs(storage / "mlflow.db", raw["name"])
            assert children and all({"best/step", "best/exact_beyond"} <= set(c.data.metrics) and
                                    any(k.startswith("best/exact_len/") for k in c.data.metrics)
                                    for c in children), path.name
