"""A fuzzed contract for validation: every mutation of a shipped study spec, trial config or
`tasks sample` call that cannot train exits 2 naming the field, without a traceback and without
writing anything under `--storage`; mutations that can train are still accepted.

Cases come from a seeded generator over every file in search_spaces/ and search_spaces/trials/ (of
an experiment spec, a seeded draw of its mutations), so the corpus grows with the shipped files, and
from one bad value per schema field the generator does
not reach, so that every field of the trial config and study spec is named by some case's error.
Validation only: the CLIs' `main` runs in-process (a subprocess costs seconds of imports), plus a
few real subprocesses for the exit status as a shell sees it. No Ray is started.
"""

from __future__ import annotations

import copy
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from study import run as run_cli
from study import train as train_cli
from study.spec.schema import flatten  # dotted path -> value of every leaf, as the spec flattens grids
from tasks import TASKS
from tasks import __main__ as tasks_cli
from tests.support.postgres import free_port
from trial.config import load_trial_config

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted([*(ROOT / "search_spaces").glob("*.yaml"), *(ROOT / "search_spaces" / "experiments").glob("*.yaml")])
TRIALS = sorted((ROOT / "search_spaces" / "trials").glob("*.yaml"))
INF, NAN = float("inf"), float("nan")
NO_K_TASKS = {name for name, cls in TASKS.items() if not cls.uses_k}


@dataclass
class Case:
    """One mutated input: its YAML text, and the text the error must contain (None: accepted)."""

    id: str
    text: str
    field: str | None
    regex: bool = False  # `field` is a pattern (YAML errors: file:line:column)


def set_path(d: dict, path: str, value) -> dict:
    *parents, leaf = path.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value
    return d


def dump(d: dict) -> str:
    return yaml.safe_dump(d, sort_keys=False)


# --- study specs -----------------------------------------------------------------------------
def overridden(spec: dict) -> list[str]:
    """Paths a grid or search sets in every trial (a base value there is a default never used)."""
    paths = list(spec.get("grid", {}))
    for key, values in spec.get("grid", {}).items():
        for v in values:
            paths += list(flatten({key: v}))
    search = spec.get("search")
    if isinstance(search, dict):
        paths += list(search.get("params", {}))
    return paths


def free_base_paths(spec: dict) -> list[str]:
    taken = overridden(spec)
    return [p for p in flatten(spec.get("base", {}))
            if not any(p == q or p.startswith(q + ".") or q.startswith(p + ".") for q in taken)]


def is_free(spec: dict, path: str) -> bool:
    taken = overridden(spec)
    return not any(path == q or path.startswith(q + ".") or q.startswith(path + ".") for q in taken)


def add_search(spec: dict, path: str, dist: dict) -> dict:
    if not isinstance(spec.get("search"), dict):
        spec["search"] = {"trials_per_cell": 2, "params": {}}
        spec["replicas"] = 1
    spec["search"]["params"][path] = dist
    drop_path(spec.get("base", {}), path)  # a fixed value the search replaces is refused
    return spec


def drop_path(d: dict, path: str) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        d = d.get(p)
        if not isinstance(d, dict):
            return
    d.pop(leaf, None)


def case_makers(raw: dict, name: str, cases: list[Case]):
    """(bad, good): each appends a Case of a mutated deep copy of raw; bad names the field expected
    in the error, good expects the file to be accepted."""

    def bad(cls: str, field_: str, mutate) -> None:
        mutated = copy.deepcopy(raw)
        mutate(mutated)
        cases.append(Case(f"{name}-{cls}", dump(mutated), field_))

    def good(cls: str, mutate) -> None:
        mutated = copy.deepcopy(raw)
        mutate(mutated)
        cases.append(Case(f"{name}-ok-{cls}", dump(mutated), None))

    return bad, good


def base_value(spec: dict, path: str, default):
    return flatten(spec.get("base", {})).get(path, default)


def study_cases(path: Path, rng: random.Random) -> list[Case]:
    raw = yaml.safe_load(path.read_text())
    name = path.stem
    task = raw["task"]["name"]
    cases: list[Case] = []
    bad, good = case_makers(raw, name, cases)

    numeric = [p for p in free_base_paths(raw)
               if isinstance(base_value(raw, p, None), (int, float)) and not isinstance(base_value(raw, p, None), bool)]
    p = rng.choice(numeric)
    bad("base-non-finite", f"base.{p}", lambda s: set_path(s["base"], p, rng.choice([INF, -INF, NAN])))
    bad("grid-non-finite", "grid.optim.weight_decay",
        lambda s: s.setdefault("grid", {}).update({"optim.weight_decay": [0.0, rng.choice([INF, NAN])]}))
    bad("seed-negative", "seed", lambda s: s.update(seed=-rng.randint(1, 10**6)))
    bad("seed-huge", "seed", lambda s: s.update(seed=rng.choice([2**32, 2**70, 10**30])))
    bad("search-seed", "search.seed", lambda s: add_search(s, "model.dropout", {"choice": [0.0]})["search"].update(
        seed=rng.choice([-1, 2**40])))
    steps = base_value(raw, "optim.steps", 1000)
    for p, value in [
        ("optim.betas", rng.choice([[1.5, 2.0], [-0.1, 0.9], [0.9, 1.0]])),
        ("model.d_ff", rng.choice([0, -5])),
        ("model.dropout", rng.choice([1.0, 1.5, -0.1])),
        ("optim.lr", rng.choice([0, -1e-3])),
        ("optim.weight_decay", -rng.random()),
        ("positional.max_position", rng.choice([10**10, 2**21])),
        ("model.d_model", rng.choice([2**17, 10**9])),
        ("model.n_layers", rng.choice([10**6, 0])),
    ]:
        if is_free(raw, p):
            bad(f"base-{p}", p, lambda s, p=p, value=value: set_path(s.setdefault("base", {}), p, value))
    if is_free(raw, "optim.warmup_steps") and is_free(raw, "optim.steps"):
        bad("warmup-beyond-steps", "optim.warmup_steps",
            lambda s: set_path(s["base"], "optim.warmup_steps", steps + rng.randint(1, 10**4)))
    if is_free(raw, "model.d_model") and is_free(raw, "model.n_layers"):
        heads = base_value(raw, "model.n_heads", 4)
        def too_big(s):  # a spec's own head_dim and d_ff would keep the model small: grow them too
            model = s["base"].setdefault("model", {})
            model.update(d_model=2048 * heads, n_layers=1000)
            model.update({k: v for k, v in (("head_dim", 2048), ("d_ff", 8192 * heads)) if k in model})
        bad("model-too-big", "model.d_model", too_big)
    # a search, checked at every point it can produce
    bad("search-choice-dropout", "model.dropout",
        lambda s: add_search(s, "model.dropout", {"choice": [0.0, rng.choice([1.0, 1.5, 7])]}))
    bad("search-uniform-dropout", "model.dropout",
        lambda s: add_search(s, "model.dropout", {"uniform": [0.0, rng.choice([1.0, 1.5])]}))
    bad("search-uniform-int-field", "search.params.model.n_layers",
        lambda s: add_search(s, "model.n_layers", {rng.choice(["uniform", "loguniform"]): [1, 3]}))
    bad("search-uniform-bool-field", "search.params.positional.shift",
        lambda s: add_search(s, "positional.shift", {"uniform": [0, 1]}))
    bad("search-choice-empty", "search.params.optim.grad_clip",
        lambda s: add_search(s, "optim.grad_clip", {"choice": []}))
    bad("search-infinite-bound", "search.params.optim.grad_clip",
        lambda s: add_search(s, "optim.grad_clip", {"loguniform": [0.1, INF]}))
    bad("search-choice-nan", "search.params.optim.grad_clip",
        lambda s: add_search(s, "optim.grad_clip", {"choice": [1.0, NAN]}))
    bad("search-int-warmup", "optim.warmup_steps",
        lambda s: add_search(s, "optim.warmup_steps", {"int": [1, steps + rng.randint(1, 1000)]}))
    bad("search-choice-betas", "optim.betas",
        lambda s: add_search(s, "optim.betas", {"choice": [[0.9, 0.98], [0.9, rng.choice([1.0, 3.0])]]}))
    d_model = base_value(raw, "model.d_model", 128)
    if is_free(raw, "model.n_heads") and base_value(raw, "model.head_dim", None) is None:  # else any count fits
        bad("search-choice-heads", "model.n_heads",
            lambda s: add_search(s, "model.n_heads", {"choice": [1, next(h for h in range(3, 99) if d_model % h)]}))
    if is_free(raw, "positional.encoding"):
        bad("search-choice-encoding", "positional.encoding",
            lambda s: add_search(s, "positional.encoding", {"choice": ["learned", "bogus"]}))
    if raw.get("grid"):  # a spec of one cell has none
        grid_key = rng.choice(list(raw["grid"]))
        bad("grid-and-search", grid_key,
            lambda s: add_search(s, grid_key + rng.choice(["", ".sub"]), {"choice": [1]}))
        bad("grid-duplicate", f"grid.{grid_key}", lambda s: s["grid"][grid_key].append(rng.choice(s["grid"][grid_key])))
    bad("grid-seed", "grid.seed", lambda s: s.setdefault("grid", {}).update(seed=[0, 1]))
    bad("search-seed-param", "search.params.seed", lambda s: add_search(s, "seed", {"int": [0, 9]}))
    bad("grid-deepspeed", "grid.deepspeed.zero_stage",
        lambda s: s.setdefault("grid", {}).update({"deepspeed.zero_stage": [0, 3]}))
    # one setting, two places
    res = raw.get("resources", {})
    bad("base-deepspeed-zero", "base.deepspeed.zero_stage",
        lambda s: s["base"].update(deepspeed={"zero_stage": (res.get("zero_stage", 0) + rng.randint(1, 3)) % 4}))
    bad("base-deepspeed-bf16", "base.deepspeed.bf16",
        lambda s: s["base"].update(deepspeed={"bf16": not res.get("bf16", False)}))
    bad("base-seed", "base.seed", lambda s: s["base"].update(seed=rng.randint(0, 9)))
    bad("base-task", "base.task", lambda s: s["base"].update(task={"name": task}))
    # resources
    bad("gpus-fraction", "resources.gpus_per_worker",
        lambda s: s.setdefault("resources", {}).update(gpus_per_worker=rng.choice([1.5, 2.25])))
    bad("cpus-zero", "resources.cpus_per_worker",
        lambda s: s.setdefault("resources", {}).update(cpus_per_worker=rng.choice([0, -1, 0.00001])))
    batch = base_value(raw, "optim.batch_size", 64)
    bad("batch-split", "optim.batch_size", lambda s: s.setdefault("resources", {}).update(
        workers_per_trial=next(w for w in (3, 5, 7, 11, 13) if batch % w)))
    # names that are not a folder inside --storage
    bad("name", "name", lambda s: s.update(name=rng.choice([".", "..", "a" * 101, "a/b", "", "x y", "../up"])))
    # objective
    typo = rng.choice(["val_exactt", "accuracy", "val_exac", "VAL_EXACT", "loss_gap"])
    bad("metric-typo", "objective.metric", lambda s: s.update(objective={"metric": typo, "mode": "max"}))
    final = "loss_in_dist" if task == "lm" else "acc_in_dist"
    bad("metric-only-at-end", "objective.metric", lambda s: s.update(objective={"metric": final, "mode": "max"}))
    if task == "lm":
        bad("metric-nan-for-lm", "objective.metric",
            lambda s: (s.update(objective={"metric": "exact_in_dist", "mode": "max"}),
                       set_path(s["base"], "eval.every_steps", steps)))
    # eval.ks and eval.lengths: each value is one evaluation point, given once
    bad("ks-empty", "eval.ks", lambda s: set_path(s["base"], "eval.ks", []))
    lengths = base_value(raw, "eval.lengths", None)
    if lengths and is_free(raw, "eval.lengths"):
        bad("lengths-duplicate", "eval.lengths", lambda s: set_path(s["base"], "eval.lengths",
                                                                    [*lengths, rng.choice(lengths)]))
    # a grid or search path with an empty part sets nothing a field can name
    bad("grid-empty-path", "grid: ", lambda s: s.setdefault("grid", {}).update({rng.choice(["", "optim."]): [1, 2]}))
    bad("search-empty-path", "search.params: ", lambda s: add_search(s, rng.choice(["", ".lr"]), {"choice": [1]}))
    if task in NO_K_TASKS:
        bad("ks-without-k-axis", "eval.ks", lambda s: set_path(s["base"], "eval.ks", [1]))
    else:
        bad("ks-beyond-length", "eval.ks", lambda s: set_path(s["base"], "eval.ks", [1, 10**4]))

    claim = {"name": "c", "cell": {"no_such_factor": 1}, "at_least": 0.9}
    bad("claim-no-cell", "claims.0.cell", lambda s: s.update(claims=[claim]))
    bad("claim-two-rules", "claims.0", lambda s: s.update(claims=[{**claim, "cell": {}, "at_most": 0.1}]))
    bad("claim-metric", "claims.0.metric", lambda s: s.update(claims=[{**claim, "cell": {}, "metric": "val_lossy"}]))
    bad("claim-metric-name", "claims.0.metric", lambda s: s.update(claims=[{**claim, "cell": {}, "metric": "a b"}]))
    bad("claim-times", "claims.0.times", lambda s: s.update(claims=[{**claim, "cell": {}, "times": -1}]))

    # accepted: the platform must not refuse what can train
    good("cpus-fraction", lambda s: s.setdefault("resources", {}).update(cpus_per_worker=rng.choice([0.5, 1.5])))
    good("deepspeed-agrees", lambda s: s["base"].update(
        deepspeed={"zero_stage": res.get("zero_stage", 0), "bf16": res.get("bf16", False)}))
    if is_free(raw, "model.dropout"):  # not where the grid sets the whole model group
        good("search-dropout", lambda s: add_search(s, "model.dropout", {"uniform": [0.0, 0.2]}))
    if is_free(raw, "optim.warmup_steps"):  # not where the grid sets the whole optim group
        good("search-int-warmup", lambda s: add_search(s, "optim.warmup_steps", {"int": [0, min(20, steps)]}))
    good("name", lambda s: s.update(name="".join(rng.choice("abcXYZ019-_.") for _ in range(100)).strip(".") or "x"))
    if is_free(raw, "optim.betas"):
        good("betas", lambda s: set_path(s["base"], "optim.betas", [0.0, 0.999]))
    local_heads = max([v for p, v in flatten(raw).items() if p.endswith("id_window_heads")] +
                      [v.get("id_window_heads") or 0 for vs in raw.get("grid", {}).values() for v in vs
                       if isinstance(v, dict)] + [1])
    if is_free(raw, "model.n_heads"):
        heads = [h for h in (1, 2, 4, 8, 16) if h >= local_heads and d_model % h == 0][:2]
        good("search-heads", lambda s: add_search(s, "model.n_heads", {"choice": heads}))
    if is_free(raw, "positional.id_window_heads"):
        bad("id-window-heads", "positional.id_window_heads", lambda s: set_path(
            s["base"], "positional", {**s["base"].get("positional", {}), "id_window": 1, "id_window_heads": 64}))
    if is_free(raw, "optim.batch_size"):
        bad("batch-huge", "optim.batch_size", lambda s: set_path(s["base"], "optim.batch_size", 10**9))
    bad("name-reserved", "name", lambda s: s.update(name=rng.choice(["mlflow.db", "MLflow.DB", "mlartifacts",
                                                                    "mlflow.db-wal"])))
    if is_free(raw, "optim.steps"):  # the one report comes at the base's steps
        good("metric-at-end-single-report", lambda s: (
            s.update(objective={"metric": final, "mode": "max"}), set_path(s["base"], "eval.every_steps", steps)))
    return cases + yaml_cases(name, path.read_text(), rng)


# --- YAML itself -------------------------------------------------------------------------------
# nine anchors, each a list of nine aliases of the one before: 9**9 values once expanded
ALIAS_BOMB = "".join(f"{a}: &{a} [{', '.join([f'*{p}' if p else '{}'] * 9)}]\n"
                     for p, a in zip(["", *"abcdefgh"], "abcdefghi"))


def yaml_cases(name: str, text: str, rng: random.Random) -> list[Case]:
    where = r"\.yaml:\d+:\d+: "
    broken = rng.choice(["oops: [1, 2\n", "oops: {a: 1\n", "oops: 'open\n", "oops: a: b\n", "\t- tab\n", "@x\n"])
    cases = [
        Case(f"{name}-yaml-malformed", text + broken, where, regex=True),
        Case(f"{name}-yaml-two-documents", text + "---\n" + text, where, regex=True),
        Case(f"{name}-yaml-deep", text + "deep: " + "[" * (n := rng.randint(60, 20000)) + "]" * n + "\n",
             where + r"deep\.0\.0.*nested deeper", regex=True),
    ]
    data = yaml.safe_load(text)
    key = rng.choice(list(data))
    cases.append(Case(f"{name}-yaml-duplicate-top", text + f"{key}: null\n", where + re.escape(f"{key}: duplicate key"),
                      regex=True))
    lines = dump(data).splitlines(keepends=True)
    def parent_of(i: int) -> str:
        return next(lines[j].split(":")[0] for j in range(i, -1, -1) if not lines[j].startswith(" "))

    nested = [(i, line) for i, line in enumerate(lines) if re.match(r"  [A-Za-z_]\w*: \S", line)
              and isinstance(data.get(parent_of(i)), dict)]  # a key of a mapping, not of a list's item (claims)
    i, line = rng.choice(nested)
    parent = parent_of(i)
    nested_key = line.strip().split(":")[0]
    cases.append(Case(f"{name}-yaml-duplicate-nested", "".join(lines[:i + 1] + [line] + lines[i + 1:]),
                      where + re.escape(f"{parent}.{nested_key}: duplicate key"), regex=True))
    cases.append(Case(f"{name}-yaml-alias-bomb", text + ALIAS_BOMB, where + r".*aliases expand", regex=True))
    return cases


# --- trial configs -------------------------------------------------------------------------------
def trial_cases(path: Path, rng: random.Random) -> list[Case]:
    raw = yaml.safe_load(path.read_text())
    name = f"trials-{path.stem}"
    task = raw["task"]["name"]
    cases: list[Case] = []
    bad, good = case_makers(raw, name, cases)

    numeric = [p for p, v in flatten(raw).items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    p = rng.choice(numeric)
    bad("non-finite", p, lambda c: set_path(c, p, rng.choice([INF, -INF, NAN])))
    steps = raw["optim"]["steps"]
    for p, value in [
        ("seed", rng.choice([-1, 2**32, 2**70])),
        ("optim.betas", rng.choice([[1.5, 2.0], [0.9, 1.0], [-0.5, 0.9]])),
        ("model.d_ff", rng.choice([0, -5])),
        ("model.dropout", rng.choice([1.0, 1.5])),
        ("optim.warmup_steps", steps + rng.randint(1, 1000)),
        ("positional.max_position", rng.choice([10**10, 2**21])),
        ("model.d_model", 2**17),
        ("deepspeed.zero_stage", rng.choice([4, -1])),
        ("deepspeed.compile", rng.choice(["max-autotune", "sometimes", 2])),
        ("eval.ks", []),
        ("eval.lengths", [*raw["eval"]["lengths"], raw["eval"]["lengths"][0]]),
    ]:
        bad(p, p, lambda c, p=p, value=value: set_path(c, p, value))
    def too_big(c):  # a config's own head_dim and d_ff would keep the model small: grow them too
        heads = c["model"].get("n_heads", 4)
        c["model"].update(d_model=2048 * heads, n_layers=1000)
        c["model"].update({k: v for k, v in (("head_dim", 2048), ("d_ff", 8192 * heads)) if k in c["model"]})
    bad("model-too-big", "model.n_layers", too_big)
    if task in NO_K_TASKS:
        bad("ks-without-k-axis", "eval.ks", lambda c: set_path(c, "eval.ks", [1, 2]))
    good("betas", lambda c: set_path(c, "optim.betas", [0.0, 0.999]))
    good("seed-max", lambda c: c.update(seed=2**32 - 1))
    good("warmup-equals-steps", lambda c: set_path(c, "optim.warmup_steps", steps))
    return cases + yaml_cases(name, path.read_text(), rng)


# --- every field of the schemas: one bad value each, spread over the shipped files -----------------
# The generators above draw their mutations from what each file sets; these name the rest, so that
# `test_every_schema_field_is_named_by_a_case` holds: no field of TrialConfig (its groups and
# analysis sections) or of StudySpec goes unfuzzed. Each entry: (the field the error must name, a
# mutation of a file's dict). Values are bad for any shipped file, so the file is picked in turn.
def _positional(c: dict, **kw) -> None:
    c["positional"] = {**c.get("positional", {}), **kw}


def _trial_field_mutations() -> list[tuple[str, object]]:
    def put(path, value):
        return lambda c: set_path(c, path, value)

    def section(name, **kw):  # replaces an analysis section: its other fields take their defaults
        return lambda c: c.update({name: kw})

    def heads_that_do_not_divide(c):  # with its own head_dim any count fits, so the config loses it
        d_model = c["model"]["d_model"]
        c["model"].pop("head_dim", None)
        c["model"]["n_heads"] = next(h for h in range(3, 99) if d_model % h)

    return [
        ("task.name", put("task.name", "no_such_task")),
        ("task.params.no_such_param", put("task.params.no_such_param", 1)),
        ("positional.encoding", put("positional.encoding", "sinusoidal")),
        ("positional.ids", put("positional.ids", "absolute")),
        ("positional.shift", put("positional.shift", "sometimes")),
        ("positional.pose_chunks", put("positional.pose_chunks", 0)),
        ("optim.length_groups", put("optim.length_groups", 0)),
        ("per_position.samples", section("per_position", samples=0)),
        ("positional.position_loss_weight", put("positional.position_loss_weight", -1.0)),
        # a PPC head option on ids that have no position head (the cross-field check)
        ("positional.position_target",
         lambda c: _positional(c, ids="random_shift", position_target="pointer")),
        ("positional.id_window", put("positional.id_window", -1)),
        # id-local heads without the window they use (the cross-field check)
        ("positional.id_window_heads", lambda c: _positional(c, id_window=None, id_window_heads=1)),
        # two-sided buckets on an encoding without T5's bias (the cross-field check)
        ("positional.t5_buckets", put("positional.t5_buckets", "two_sided")),
        ("positional.init_std", put("positional.init_std", 0)),
        ("positional.frozen", put("positional.frozen", "sometimes")),
        ("positional.abacus", put("positional.abacus", "sometimes")),
        # Abacus's options without the Abacus embedding they shape (the cross-field check)
        ("positional.abacus_norm", put("positional.abacus_norm", True)),
        ("positional.abacus_offset", put("positional.abacus_offset", "step")),
        ("positional.abacus_max_offset", put("positional.abacus_max_offset", -1)),
        ("positional.abacus_init_std", put("positional.abacus_init_std", 0)),
        ("task.train_set_size", put("task.train_set_size", 0)),
        ("deepspeed.data_workers", put("deepspeed.data_workers", -2)),
        ("model.n_heads", heads_that_do_not_divide),
        ("model.embed_init_std", put("model.embed_init_std", 0)),
        ("model.norm", put("model.norm", "batch")),
        ("model.attn_scale", put("model.attn_scale", "cube")),
        ("model.head_dim", put("model.head_dim", 0)),
        ("model.init", put("model.init", "xavier")),
        ("model.norm_position", put("model.norm_position", "post")),
        ("model.ffn", put("model.ffn", "swiglu")),
        ("model.tie_embeddings", put("model.tie_embeddings", "sometimes")),
        ("model.output", put("model.output", "decoder")),
        ("model.loops", put("model.loops", "per_token")),
        ("model.loop_factor", lambda c: c["model"].update(loops="per_length", loop_factor=0)),
        # the per-length rule's offset on a fixed count of passes (the cross-field check)
        ("model.loop_offset", lambda c: c["model"].update(loops=2, loop_offset=-1)),
        ("optim.min_lr_ratio", put("optim.min_lr_ratio", 1.5)),
        ("data_seed", put("data_seed", -1)),
        ("optim.lr", put("optim.lr", 0)),
        ("optim.weight_decay", put("optim.weight_decay", -0.1)),
        ("optim.steps", put("optim.steps", 0)),
        ("optim.batch_size", put("optim.batch_size", 0)),
        ("optim.grad_clip", put("optim.grad_clip", -1.0)),
        ("deepspeed.bf16", put("deepspeed.bf16", "sometimes")),
        # a test length whose ids do not fit (the cross-field check)
        ("eval.lengths", lambda c: c["eval"].update(lengths=[c["positional"]["max_position"] * 4])),
        ("eval.samples_per_point", put("eval.samples_per_point", 0)),
        ("eval.batch_size", put("eval.batch_size", 0)),
        ("eval.val_samples", put("eval.val_samples", 0)),
        ("eval.every_steps", put("eval.every_steps", 0)),
        # a tracked or selection length whose ids do not fit (the cross-field check)
        ("eval.track", lambda c: c["eval"].update(track=[c["positional"]["max_position"] * 4])),
        ("eval.track_samples", put("eval.track_samples", 0)),
        ("eval.select.lengths", lambda c: c["eval"].update(select={"lengths": [c["positional"]["max_position"] * 4]})),
        ("eval.select.metric", lambda c: c["eval"].update(select={"lengths": c["eval"]["lengths"][:1],
                                                                  "metric": "accuracy"})),
        ("eval.select.samples", lambda c: c["eval"].update(select={"lengths": c["eval"]["lengths"][:1], "samples": 0})),
        ("loss_gap.long_context", section("loss_gap", long_context=1)),
        ("loss_gap.short_context", section("loss_gap", short_context=300)),  # not below long_context 256
        ("loss_gap.ks", section("loss_gap", ks=[1, 500])),  # beyond long_context - short_context
        ("loss_gap.method", section("loss_gap", method="bogus")),
        ("loss_gap.targets", section("loss_gap", targets=0)),
        ("loss_gap.rows_per_batch", section("loss_gap", rows_per_batch=0)),
        ("loss_gap.min_gap", section("loss_gap", min_gap=-0.5)),
        ("loss_gap.sparse_k", section("loss_gap", ks=[1, 2], sparse_k=4)),  # not one of ks
        ("sparsity.method", section("sparsity", method="bogus")),
        ("sparsity.ablation", section("sparsity", ablation="bogus")),
        ("sparsity.targets", section("sparsity", targets=0)),
        ("sparsity.k_max", section("sparsity", k_max=0)),
        ("sparsity.recover", section("sparsity", recover=1.5)),
        ("sparsity.min_gap", section("sparsity", min_gap=-1.0)),
        ("sparsity.draws", section("sparsity", draws=0)),
        ("sparsity.short_context", section("sparsity", short_context=-1)),
        ("sparsity.long_context", section("sparsity", long_context=1)),
        ("sparsity.length", section("sparsity", length=0)),
        ("sparsity.k", section("sparsity", k=0)),
        ("sparsity.rows_per_batch", section("sparsity", rows_per_batch=0)),
    ]


def _study_field_mutations() -> list[tuple[str, object]]:
    def put(path, value):
        return lambda s: set_path(s, path, value)

    def in_search(key, value):
        return lambda s: add_search(s, "model.dropout", {"choice": [0.0]})["search"].update({key: value})

    return [
        ("description", put("description", ["not", "text"])),
        ("task.name", put("task.name", "no_such_task")),
        ("task.params.no_such_param", put("task.params.no_such_param", 1)),
        ("task.train_set_size", put("task.train_set_size", -5)),
        ("base", put("base", "not a mapping")),
        ("grid.optim.lr", lambda s: s.setdefault("grid", {}).update({"optim.lr": 0.001})),  # not a list
        ("search.trials_per_cell", in_search("trials_per_cell", 0)),
        ("search.sampler", in_search("sampler", "grid")),
        ("objective.mode", lambda s: s.update(objective={**s.get("objective", {}), "mode": "maximize"})),
        ("objective.extrapolation",
         lambda s: s.update(objective={**s.get("objective", {}), "extrapolation": "sometimes"})),
        ("scheduler.type", put("scheduler.type", "hyperband")),
        ("scheduler.grace_period", lambda s: s.update(scheduler={"type": "asha", "grace_period": 0})),
        ("scheduler.reduction_factor", lambda s: s.update(scheduler={"type": "asha", "reduction_factor": 1})),
        ("replicas", put("replicas", 0)),
        ("resources.workers_per_trial", put("resources.workers_per_trial", 0)),
        ("resources.zero_stage", put("resources.zero_stage", 5)),
        ("resources.bf16", put("resources.bf16", "sometimes")),
        ("resources.max_concurrent_trials", put("resources.max_concurrent_trials", 0)),
        ("resources.max_failures", put("resources.max_failures", -1)),
        ("resources.warm_processes", put("resources.warm_processes", "sometimes")),
    ]


def field_cases(paths: list[Path], mutations: list[tuple[str, object]], prefix: str) -> list[Case]:
    cases = []
    for i, (field_, mutate) in enumerate(mutations):
        path = paths[i % len(paths)]
        raw = copy.deepcopy(yaml.safe_load(path.read_text()))
        mutate(raw)
        cases.append(Case(f"{prefix}{path.stem}-field-{field_}", dump(raw), field_))
    return cases


# --- tasks sample ----------------------------------------------------------------------------
def sample_cases(rng: random.Random) -> list[tuple[str, list[str], str | None]]:
    from tasks import TASKS

    cases = []
    for name in sorted(TASKS):
        if name == "lm":
            continue  # loads a corpus; its CLI is tested in test_lm_task.py
        cases += [
            (f"{name}-seed", [name, "--seed", str(-rng.randint(1, 10**9))], "seed"),
            (f"{name}-length", [name, "--length", str(rng.choice([10**7, 10**10, 2**62]))], "length"),
            (f"{name}-count", [name, "--length", "8", "--count", str(rng.choice([10**6, 10**9]))], "count"),
            (f"{name}-count-zero", [name, "--count", str(rng.choice([0, -3]))], "count"),
            (f"{name}-train-length", [name, "--param", f"train_length={10**8}"], "train_length"),
        ]
        if name in NO_K_TASKS:
            cases.append((f"{name}-k", [name, "--length", "8", "--k", str(rng.randint(1, 8))], "k"))
            cases.append((f"{name}-ok", [name, "--length", "6", "--count", "3", "--seed", "5"], None))
        else:
            cases.append((f"{name}-k-beyond", [name, "--length", "4", "--k", str(rng.randint(5, 9))], "k"))
            cases.append((f"{name}-ok", [name, "--length", "6", "--k", "2", "--count", "3", "--seed", "5"], None))
    return cases


RNG = random.Random(20240613)
# Every mutation of the platform's own specs (search_spaces/*.yaml); of each experiment spec, a draw
# of EXPERIMENT_DRAWS of them, seeded by its name. What is fuzzed is the validator: one mutation takes
# the same path on most of 37 specs (2,400 dry runs, two minutes of the fast tier), and the draw
# still reaches each experiment's own structure (grids of groups, linked factors, claims).
EXPERIMENT_DRAWS = 12


def drawn(path: Path, cases: list[Case]) -> list[Case]:
    if path.parent.name != "experiments":
        return cases
    return random.Random(path.stem).sample(cases, min(EXPERIMENT_DRAWS, len(cases)))


STUDY_CASES = [c for spec in SPECS for c in drawn(spec, study_cases(spec, RNG))]
TRIAL_CASES = [c for trial in TRIALS for c in trial_cases(trial, RNG)]
SAMPLE_CASES = sample_cases(RNG)
# after the seeded draws, which they leave as they were
STUDY_CASES += field_cases(SPECS, _study_field_mutations(), "")
TRIAL_CASES += field_cases(TRIALS, _trial_field_mutations(), "trials-")


def schema_fields(model, prefix: str = "") -> list[str]:
    """Dotted paths of every field of a pydantic model, into its groups (a field whose type is a
    model, or an optional one) down to their leaves; dicts and lists of models are leaves."""
    import types
    import typing

    from pydantic import BaseModel

    from trial.analyses import REGISTERED

    fields = []
    for name, info in model.model_fields.items():
        if name == "analyses":  # the registered analyses' sections, each under its own name
            for section, cls in REGISTERED.items():
                fields += schema_fields(cls, f"{prefix}{section}.")
            continue
        ann = info.annotation
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        options = typing.get_args(ann) if union else (ann,)
        groups = [t for t in options if isinstance(t, type) and issubclass(t, BaseModel)]
        for group in groups:
            fields += schema_fields(group, f"{prefix}{name}.")
        if not groups:
            fields.append(prefix + name)
    return fields


def named_fields(cases: list[Case], study: bool) -> set[str]:
    """The fields the cases' expected errors name. A study spec's `base.`, `grid.` and
    `search.params.` fields are trial-config fields there (the spec validates each trial config)."""
    names = set()
    for case in cases:
        if case.field is None or case.regex:
            continue
        names.add(case.field)
        if study:
            for prefix in ("base.", "grid.", "search.params."):
                if case.field.startswith(prefix):
                    names.add(case.field.removeprefix(prefix))
    return names


def unnamed(fields: list[str], names: set[str]) -> list[str]:
    return [f for f in fields if not any(n == f or n.startswith(f + ".") for n in names)]


def test_every_schema_field_is_named_by_a_case():
    """Each leaf of TrialConfig (task, positional, model, optim, deepspeed, eval, loss_gap, sparsity)
    and of StudySpec is what some bad case's error must name: a field whose validation regresses
    (a bound dropped, an error that names the wrong field) fails a case. Removing the only case of a
    field, or adding a field with none, fails here."""
    from study.spec.schema import StudySpec
    from trial.config import TrialConfig

    trial_fields, study_fields = schema_fields(TrialConfig), schema_fields(StudySpec)
    # the walk reaches the groups and the analysis sections (a broken walk would check nothing)
    assert {"positional.id_window", "eval.lengths", "loss_gap.sparse_k", "sparsity.recover",
            "deepspeed.bf16"} <= set(trial_fields)
    assert {"search.seed", "resources.max_failures", "objective.metric"} <= set(study_fields)
    study_named = named_fields(STUDY_CASES, study=True)
    assert not unnamed(trial_fields, study_named | named_fields(TRIAL_CASES, study=False)), "trial config"
    assert not unnamed(study_fields, study_named), "study spec"
    # the corpus grows with the shipped files: each of them is mutated
    assert SPECS and TRIALS
    assert all(any(c.id.startswith(f"{p.stem}-") for c in STUDY_CASES) for p in SPECS)
    assert all(any(c.id.startswith(f"trials-{p.stem}-") for c in TRIAL_CASES) for p in TRIALS)


def check_message(case: Case, err: str) -> None:
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert (re.search(case.field, err) if case.regex else case.field in err), (case.field, err)


@pytest.mark.timeout(60)  # each takes well under a second; an alias bomb would take hours
@pytest.mark.parametrize("case", STUDY_CASES, ids=lambda c: c.id)
def test_study_spec_mutation(case: Case, tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(case.text)
    storage = tmp_path / "storage"
    code = run_cli.main(["--space", str(spec), "--storage", str(storage), "--dry-run"])
    out, err = capsys.readouterr()
    if case.field is None:
        assert code == 0, err
        assert "cell 0:" in out
    else:
        assert code == 2, f"accepted:\n{case.text}\n{out}"
        check_message(case, err)
    assert not storage.exists()


@pytest.mark.timeout(60)  # each takes well under a second; an alias bomb would take hours
@pytest.mark.parametrize("case", TRIAL_CASES, ids=lambda c: c.id)
def test_trial_config_mutation(case: Case, tmp_path, capsys):
    trial = tmp_path / "trial.yaml"
    trial.write_text(case.text)
    if case.field is None:
        load_trial_config(str(trial))
        return
    # --out into a missing folder: should the config be accepted, the run still stops before training
    code = train_cli.main([str(trial), "--out", str(tmp_path / "missing" / "eval.csv")])
    _, err = capsys.readouterr()
    assert code == 2
    assert "--out" not in err, f"accepted:\n{case.text}"
    check_message(case, err)


@pytest.mark.parametrize("case", SAMPLE_CASES, ids=lambda c: c[0])
def test_tasks_sample_mutation(case, capsys):
    _, argv, param = case
    code = tasks_cli.main(["sample", *argv])
    out, err = capsys.readouterr()
    if param is None:
        assert code == 0 and len(out.splitlines()) == 3, err
    else:
        assert code == 2 and err.startswith(f"error: {param}: "), err


def test_a_search_is_checked_at_every_combination_of_its_points(tmp_path, capsys):
    """Each value is fine with the others' first values; 48 model dims and 32 heads together are not."""
    spec = yaml.safe_load((ROOT / "search_spaces" / "smoke.yaml").read_text())
    for path, dist in {"model.d_model": {"choice": [64, 48]}, "model.n_heads": {"choice": [4, 32]}}.items():
        add_search(spec, path, dist)
    path = tmp_path / "spec.yaml"
    path.write_text(dump(spec))
    assert run_cli.main(["--space", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "search.params: at {" in err and "'model.d_model': 48" in err and "model.n_heads: 32" in err, err


def test_out_into_a_missing_folder_is_refused_before_training(tmp_path, capsys):
    trial = str(ROOT / "search_spaces" / "trials" / "sparse_parity.yaml")
    assert train_cli.main([trial, "--steps", "60", "--out", str(tmp_path / "missing" / "eval.csv")]) == 2
    assert capsys.readouterr().err.startswith("error: --out: no folder")


def test_int_search_distribution_is_usable():
    """The documented `int: [low, high]` (a field named `int` once shadowed the builtin)."""
    from study.spec.schema import Distribution

    assert Distribution.model_validate({"int": [5, 20]}).points() == [5, 20]


# --- a few as a shell sees them: exit status 2, no traceback, nothing under --storage -----------
# one per kind of refusal (the YAML, the plan, a command's flag); the fields each names are the
# in-process cases above
def test_real_processes_exit_2_without_a_traceback(tmp_path):
    smoke = yaml.safe_load((ROOT / "search_spaces" / "smoke.yaml").read_text())
    storage = tmp_path / "storage"
    bad_spec = tmp_path / "dup.yaml"
    bad_spec.write_text(dump(smoke) + "name: other\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text((ROOT / "search_spaces" / "trials" / "sparse_parity.yaml").read_text() + "x: " + "[" * 10**4 + "]" * 10**4)
    huge = tmp_path / "huge.yaml"  # valid, but the local Ray could never start a trial
    huge.write_text(dump({**smoke, "resources": {**smoke["resources"], "cpus_per_worker": 4096}}))
    runs = [
        ([str(ROOT / "study" / "run.py"), "--space", str(bad_spec), "--storage", str(storage)], "dup.yaml:"),
        ([str(ROOT / "study" / "run.py"), "--space", str(huge), "--storage", str(storage)],
         "resources.cpus_per_worker"),
        (["-m", "study.train", str(deep)], "deep.yaml:"),
        (["-m", "tasks", "sample", "copy", "--length", str(10**12)], "length"),
    ]
    for args, named in runs:
        out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (args, out.stdout[-2000:], out.stderr[-2000:])
        assert named in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not storage.exists()


# --- flags and environment: the same contract for what is around the spec ----------------------------
# study/spec/preflight.py. Every case runs study/run.py's `main` in-process without --dry-run (so the
# network checks run too), with the study's start replaced by a tripwire: a flag that gets past the
# checks fails the test at once instead of starting Ray. Cases come from the same seeded generator.
SECRETS = ("AKIAEXAMPLEKEY0000000", "wJalrXUtnFEMI-not-a-real-secret", "hunter2-s3cret")


@dataclass
class FlagCase:
    """Flags (and environment) around a valid spec that must be refused naming `named`. `make`
    turns tmp_path into (argv, env); `secret`: a string that must not be echoed."""

    id: str
    make: object
    named: str
    secret: str | None = None


def _unwritable(tmp_path: Path, rng: random.Random) -> Path:
    """A folder this process cannot create anything in: a read-only folder, or (root ignores
    permissions) a pseudo-filesystem that refuses new entries."""
    import os

    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    return Path("/sys")


def flag_cases(rng: random.Random) -> list[FlagCase]:
    cases: list[FlagCase] = []

    def case(id_, named, secret=None):
        def register(make):
            cases.append(FlagCase(id_, make, named, secret))
            return make
        return register

    # --cluster: malformed, a list, empty, a scalar, an alias bomb, node types that are no mapping
    cluster_texts = {
        "malformed": rng.choice(["available_node_types: {a: 1\n", "x: [1, 2\n", "a: b: c\n", "\t- tab\n"]),
        "list": rng.choice(["- a\n- b\n", "[1, 2, 3]\n", "- available_node_types: {}\n"]),
        "empty": rng.choice(["", "\n\n", "# only a comment\n", "---\n"]),
        "scalar": rng.choice(["hello\n", "42\n", "null\n"]),
        "alias-bomb": ALIAS_BOMB,
        "node-types-list": "available_node_types: [gpu, cpu]\n",
        "resources-text": "available_node_types:\n  gpu: {resources: {CPU: many, GPU: 1}, max_workers: 1}\n",
        "max-workers-negative": "available_node_types:\n  gpu: {resources: {CPU: 8, GPU: 1}, max_workers: -3}\n",
    }
    for kind, text in cluster_texts.items():
        @case(f"cluster-{kind}", "--cluster")
        def _(tmp, text=text):
            path = tmp / "cluster.yaml"
            path.write_text(text)
            return ["--cluster", str(path)], {}

    @case("cluster-missing", "--cluster")
    def _(tmp):
        return ["--cluster", str(tmp / "no-such-cluster.yaml")], {}

    # --storage: a file, under a file, an unwritable folder, a file: URI of another host, a query
    # string, credentials
    @case("storage-is-a-file", "--storage")
    def _(tmp):
        (tmp / "afile").write_text("x")
        return ["--storage", str(tmp / "afile")], {}

    @case("storage-under-a-file", "--storage")
    def _(tmp):
        (tmp / "afile").write_text("x")
        return ["--storage", str(tmp / "afile" / "sub" / "studies")], {}

    @case("storage-unwritable-folder", "--storage")
    def _(tmp):
        return ["--storage", str(_unwritable(tmp, rng))], {}

    @case("storage-in-an-unwritable-folder", "--storage")
    def _(tmp):
        return ["--storage", str(_unwritable(tmp, rng) / "studies")], {}

    @case("storage-file-uri-of-a-host", "--storage")
    def _(tmp):
        return ["--storage", f"file://{rng.choice(['otherhost', 'example.com'])}{tmp}/studies"], {}

    for scheme in ("s3", "gs"):
        query = rng.choice(["region=us-west-2", "endpoint_override=127.0.0.1:9000", "scheme=http&region=x"])

        @case(f"storage-{scheme}-query-string", "--storage")
        def _(tmp, scheme=scheme, query=query):
            return ["--storage", f"{scheme}://bucket/studies?{query}"], {}

        key, secret = rng.choice(SECRETS[:1]), rng.choice(SECRETS[1:])

        @case(f"storage-{scheme}-credentials", "--storage", secret)
        def _(tmp, scheme=scheme, key=key, secret=secret):
            return ["--storage", f"{scheme}://{key}:{secret}@bucket/studies"], {}

    # --mlflow-uri: nothing answers, something that is not MLflow answers, credentials, a SQLite
    # store whose folder cannot be made
    @case("mlflow-nothing-answers", "--mlflow-uri")
    def _(tmp):
        return ["--mlflow-uri", f"http://127.0.0.1:{free_port()}"], {}

    @case("mlflow-not-a-tracking-server", "--mlflow-uri")
    def _(tmp):
        return ["--mlflow-uri", _not_mlflow_server()], {}

    @case("mlflow-credentials", "--mlflow-uri", SECRETS[2])
    def _(tmp):
        return ["--mlflow-uri", f"http://user:{SECRETS[2]}@127.0.0.1:{free_port()}"], {}

    @case("mlflow-sqlite-under-a-file", "--mlflow-uri")
    def _(tmp):
        (tmp / "afile").write_text("x")
        return ["--mlflow-uri", f"sqlite:///{tmp}/afile/mlflow.db"], {}

    @case("mlflow-file-store", "--mlflow-uri")
    def _(tmp):
        return ["--mlflow-uri", rng.choice([str(tmp / "mlruns"), f"file://{tmp}/mlruns", "./mlruns"])], {}

    @case("mlflow-sqlite-unwritable", "--mlflow-uri")
    def _(tmp):
        return ["--mlflow-uri", f"sqlite:///{_unwritable(tmp, rng)}/new/mlflow.db"], {}

    # --address / RAY_ADDRESS: nothing answers (a GCS or a Ray client address), not an address,
    # credentials
    @case("address-nothing-answers", "--address")
    def _(tmp):
        return ["--address", f"{rng.choice(['127.0.0.1', 'localhost'])}:{free_port()}"], {}

    @case("address-ray-client-nothing-answers", "--address")
    def _(tmp):
        return ["--address", f"ray://127.0.0.1:{free_port()}"], {}

    @case("address-not-an-address", "--address")
    def _(tmp):
        return ["--address", rng.choice(["somewhere", "http://127.0.0.1:8265", "127.0.0.1:99999", ":6379"])], {}

    @case("address-credentials", "--address", SECRETS[2])
    def _(tmp):
        return ["--address", f"ray://admin:{SECRETS[2]}@127.0.0.1:{free_port()}"], {}

    @case("ray-address-env-nothing-answers", "RAY_ADDRESS")
    def _(tmp):
        return [], {"RAY_ADDRESS": f"127.0.0.1:{free_port()}"}

    return cases


_SERVERS: list = []


def _not_mlflow_server() -> str:
    """An HTTP server on 127.0.0.1 that answers every request with 404 (a web server, not MLflow)."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _SERVERS.append(server)
    return f"http://127.0.0.1:{server.server_address[1]}"


FLAG_CASES = flag_cases(RNG)


@pytest.fixture
def no_study_starts(monkeypatch):
    """A tripwire in place of the study: reaching it means a bad flag got through."""
    from study.experiment import tuning

    def tripwire(*args, **kwargs):
        raise AssertionError("the study started: the flags were not refused")

    monkeypatch.setattr(tuning, "run_study", tripwire)
    monkeypatch.setattr(tuning, "start_ray", tripwire)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.mark.parametrize("case", FLAG_CASES, ids=lambda c: c.id)
def test_bad_flag_or_environment(case: FlagCase, tmp_path, capsys, monkeypatch, no_study_starts):
    import time

    storage = tmp_path / "storage"
    argv, env = case.make(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if "--storage" not in argv:
        argv = [*argv, "--storage", str(storage)]
    monkeypatch.chdir(tmp_path)  # the default SQLite store of a bucket study would go to ./studies
    t0 = time.time()
    code = run_cli.main(["--space", str(ROOT / "search_spaces" / "smoke.yaml"), *argv])
    elapsed = time.time() - t0
    out, err = capsys.readouterr()
    assert code == 2, f"accepted: {argv} {env}\n{out}\n{err}"
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert case.named in err.splitlines()[0], (case.named, err)
    if case.secret:
        assert case.secret not in out + err, err
    assert elapsed < 20, f"refused only after {elapsed:.0f} s"
    assert not storage.exists() and not (tmp_path / "studies").exists()
    assert not list(tmp_path.glob("**/.preflight-*"))


def test_the_flag_corpus_covers_every_kind():
    kinds = {c.named for c in FLAG_CASES}
    assert {"--cluster", "--storage", "--mlflow-uri", "--address", "RAY_ADDRESS"} <= kinds
    assert len(FLAG_CASES) >= 25


def test_a_file_uri_is_the_local_folder_it_names(tmp_path, capsys):
    """`--storage file:///new-dir` is a folder like `/new-dir`: accepted, made where the path says
    (the probe of a real run: tests/test_preflight.py), and the tracking store goes beside it."""
    from trial import storage as store

    folder = tmp_path / "new" / "dir"
    for uri in (f"file://{folder}", f"file://localhost{folder}", f"file://{folder}/"):
        assert store.absolute(uri) == str(folder)
        assert not store.is_uri(store.absolute(uri))
    assert run_cli.main(["--space", str(ROOT / "search_spaces" / "smoke.yaml"), "--storage", f"file://{folder}",
                         "--dry-run"]) == 0
    assert not folder.exists()  # a dry run writes nothing


def test_a_query_string_is_refused_where_the_bucket_exists(s3, tmp_path, capsys, monkeypatch, no_study_starts):
    """The probe object alone cannot tell: a real bucket (an S3 API on 127.0.0.1) takes it, and the
    study's folders would then be joined after the query (`s3://b/p?region=x/smoke/tune`)."""
    monkeypatch.chdir(tmp_path)
    uri = f"s3://{s3['bucket']}/q?region={RNG.choice(['us-east-1', 'eu-west-1'])}"
    code = run_cli.main(["--space", str(ROOT / "search_spaces" / "smoke.yaml"), "--storage", uri])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --storage: ") and "query string" in err, err
    assert not s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix="q").get("Contents")


def test_a_query_string_stays_at_the_end_of_a_joined_uri():
    from trial import storage as store

    assert store.join("s3://b/p?region=x", "study", "tune") == "s3://b/p/study/tune?region=x"
    assert store.join("s3://b/p/", "study") == "s3://b/p/study"


def test_storage_errors_do_not_echo_credentials():
    from trial import storage as store

    uri = f"s3://{SECRETS[0]}:{SECRETS[1]}@no-such-bucket-here/p"
    assert store.redact(uri) == "s3://***@no-such-bucket-here/p"
    with pytest.raises(store.StorageError) as e:
        store.resolve(f"nosuchscheme://{SECRETS[0]}:{SECRETS[1]}@bucket/p")
    assert SECRETS[0] not in str(e.value) and SECRETS[1] not in str(e.value)


@pytest.mark.parametrize("spelling", ["local", "LOCAL", " Local ", "'local'", ""])
def test_local_in_any_spelling_is_the_embedded_ray(spelling, monkeypatch):
    from study.spec.preflight import check_address, ray_address

    assert ray_address(spelling) is None and check_address(spelling) is None
    monkeypatch.setenv("RAY_ADDRESS", spelling)
    assert ray_address(None) is None and check_address(None) is None
    import os

    assert "RAY_ADDRESS" not in os.environ  # nothing started from here reads it as a cluster


@pytest.mark.timeout(60)
def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path, capsys):
    spec = tmp_path / "bomb.yaml"
    spec.write_text((ROOT / "search_spaces" / "smoke.yaml").read_text() + ALIAS_BOMB)
    storage = tmp_path / "storage"
    assert run_cli.main(["--space", str(spec), "--storage", str(storage), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert re.match(r"error: .*bomb\.yaml:\d+:\d+: .*alias", err), err
    assert not storage.exists()


@pytest.mark.parametrize("name", ["mlflow.db", "MLflow.db", "mlflow.db-journal", "mlartifacts"])
def test_a_study_may_not_be_named_like_what_its_storage_holds(name, tmp_path, capsys):
    spec = yaml.safe_load((ROOT / "search_spaces" / "smoke.yaml").read_text())
    path = tmp_path / "spec.yaml"
    path.write_text(dump({**spec, "name": name}))
    storage = tmp_path / "storage"
    assert run_cli.main(["--space", str(path), "--storage", str(storage)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "name:" in err and "Traceback" not in err, err
    assert not storage.exists()


def _mlflow_store(tmp_path: Path) -> str:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    client.create_run(client.create_experiment("exp"))  # a run without a checkpoint tag
    return uri


@pytest.mark.parametrize("cli", ["study.sparsity", "study.loss_gap"])
def test_mlflow_run_unknown_or_unusable(cli, tmp_path, capsys):
    import importlib

    main = importlib.import_module(cli).main
    uri = _mlflow_store(tmp_path)
    capsys.readouterr()  # MLflow's lines about making the store
    out = tmp_path / "out"
    for run_id, named in [("0123456789abcdef0123456789abcdef", "--mlflow-run"), ("not-a-run", "--mlflow-run")]:
        assert main(["--mlflow-run", run_id, "--mlflow-uri", uri, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {named}") and run_id in err and "Traceback" not in err, err
    # a store that does not exist is not made (an empty one would say "no such run")
    missing = tmp_path / "missing" / "mlflow.db"
    assert main(["--mlflow-run", "abc", "--mlflow-uri", f"sqlite:///{missing}", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: --mlflow-uri") and not missing.parent.exists()
    assert not out.exists()
