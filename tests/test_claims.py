"""Claims: their place in the spec, the intervals they are judged with, and the one judge's verdicts."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest

from study.claims import pooled_results, same_claims
from study.results.intervals import newcombe, wilson
from study.results.verdicts import judge
from study.spec.schema import StudySpec
from trial.metrics import SUMMARY
from trial.yaml_io import load_yaml

ROOT = Path(__file__).resolve().parents[1]

# a two-cell study of coupled addition: the claim's cell and its baseline, three seeds each
SPEC = {
    "name": "claims_test",
    "task": {"name": "addition", "params": {"train_length": 5}},
    "base": {"positional": {"encoding": "learned", "max_position": 40},
             "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
             "optim": {"steps": 10, "batch_size": 8, "warmup_steps": 1}, "eval": {"lengths": [5, 10], "samples_per_point": 256}},
    "grid": {"positional.ids": ["coupled", "random_shift"]},
    "search": None, "replicas": 3,
    "claims": [{"name": "coupled_beats_shift", "source": "Cho et al. 2024", "cell": {"ids": "coupled"},
                "baseline": {"ids": "random_shift"}, "times": 2, "effect": 0.1}],
}


def spec_with(**changes) -> StudySpec:
    data = copy.deepcopy(SPEC)
    data.update(changes)
    return StudySpec.model_validate(data)


def results(spec: StudySpec, rates: dict[str, list[float]], fit: dict[str, list[float]] | None = None,
            n: int = 256) -> pd.DataFrame:
    """results.csv rows: per cell label fragment, a run per seed with exact match `fit` at the train
    length (1.0 unless given) and `rates` at 2x."""
    rows = []
    for cell in spec.cells():
        key = next(k for k in rates if k in cell.label)
        for seed, rate in enumerate(rates[key]):
            fits = (fit or {}).get(key, [1.0] * len(rates[key]))[seed]
            ids = spec.checked_config(cell).positional.scheme.own_ids
            common = {"trial_id": f"{cell.index}-{seed}", "cell": cell.label, "seed": seed, "status": "TERMINATED",
                      "role": "search", "ids": ids, "n": n, "k": None}
            rows.append({**common, "length": 5, "exact_match": fits, "answer_token_acc": fits})
            rows.append({**common, "length": 10, "exact_match": rate, "answer_token_acc": rate})
    return pd.DataFrame(rows)


def test_wilson_and_newcombe_stay_right_at_0_and_1():
    low, high = wilson(0, 256)
    assert low == 0 and 0.01 < high < 0.02  # not the Wald interval's zero width
    low, high = wilson(256, 256)
    assert high == 1 and 0.98 < low < 0.99
    assert newcombe(4, 256, 0, 256)[0] < 0 < newcombe(40, 256, 0, 256)[0]
    low, high = newcombe(128, 256, 128, 256)
    assert low < 0 < high and abs(low + high) < 1e-12


def test_4_of_256_against_0_does_not_hold_and_40_of_256_does():
    spec = spec_with()
    weak = judge(spec, results(spec, {"coupled": [4 / 256] * 3, "random_shift": [0.0] * 3}))[0]
    assert weak.verdict == "fails", weak.line
    strong = judge(spec, results(spec, {"coupled": [40 / 256] * 3, "random_shift": [0.0] * 3}))[0]
    assert strong.verdict == "holds", strong.line
    assert "3/3 seeds where both fit" in strong.line and strong.line.startswith("claim coupled_beats_shift: holds (")


def test_the_effect_is_the_smallest_difference_that_counts():
    spec = spec_with()
    # 0.08 over 0.00 on 256 samples: the interval is above 0, but the effect asked for is 0.10
    verdict = judge(spec, results(spec, {"coupled": [0.08] * 3, "random_shift": [0.0] * 3}))[0]
    assert verdict.verdict == "fails" and all(r["low"] > 0 for r in verdict.rows)


def test_a_baseline_below_chance_is_judged_as_chance():
    # 0.57 against a baseline at 0.30 on a one-bit answer: above the baseline, not above a coin by 0.1
    rates = {"coupled": [0.57, 0.9, 0.9], "random_shift": [0.30, 0.3, 0.7]}
    spec = spec_with()
    assert judge(spec, results(spec, rates))[0].verdict == "holds"
    claim = {**SPEC["claims"][0], "chance": 0.5}
    spec = spec_with(claims=[claim])
    verdict = judge(spec, results(spec, rates))[0]
    assert verdict.verdict == "fails", verdict.line
    assert [r["judged_baseline_rate"] for r in verdict.rows] == [0.5, 0.5, 0.7]
    assert [r["reached"] for r in verdict.rows] == [False, True, True]
    assert "or chance, 0.5" in verdict.claim.rule
    from study import results_page  # the page, which shows the baseline's raw figure, says so

    assert "judged as chance" in results_page.claim_row(spec, spec.claims[0], results(spec, rates))["setup"]
    with pytest.raises(ValueError, match="chance"):  # a bound has no baseline to floor
        spec_with(claims=[{"name": "b", "cell": {"ids": "coupled"}, "at_least": 0.9, "chance": 0.5}])


def test_a_cell_that_did_not_fit_makes_its_claim_inconclusive_and_is_counted():
    spec = spec_with()
    rows = results(spec, {"coupled": [0.9] * 3, "random_shift": [0.0] * 3},
                   fit={"coupled": [1.0] * 3, "random_shift": [0.2, 0.3, 1.0]})
    verdict = judge(spec, rows)[0]
    assert verdict.verdict == "inconclusive", verdict.line
    assert "runs fit 3/3 and 1/3 (baseline)" in verdict.line


def test_one_seed_never_holds_a_claim():
    spec = spec_with(replicas=1)
    verdict = judge(spec, results(spec, {"coupled": [1.0], "random_shift": [0.0]}))[0]
    assert verdict.verdict == "inconclusive"


def test_one_seed_against_the_others_fails_the_claim():
    spec = spec_with()
    verdict = judge(spec, results(spec, {"coupled": [1.0, 1.0, 0.0], "random_shift": [0.0] * 3}))[0]
    assert verdict.verdict == "fails" and "2/3 seeds" in verdict.line


def test_a_bound_holds_on_every_seed_that_fit():
    spec = spec_with(claims=[{"name": "coupled_extrapolates", "cell": {"ids": "coupled"}, "at_least": 0.95}])
    assert judge(spec, results(spec, {"coupled": [0.97, 1.0, 0.99], "random_shift": [0] * 3}))[0].verdict == "holds"
    assert judge(spec, results(spec, {"coupled": [0.97, 0.5, 0.99], "random_shift": [0] * 3}))[0].verdict == "fails"
    unfit = judge(spec, results(spec, {"coupled": [1.0] * 3, "random_shift": [0] * 3},
                                fit={"coupled": [0.1, 0.2, 1.0], "random_shift": [1.0] * 3}))[0]
    assert unfit.verdict == "inconclusive" and "runs fit 1/3" in unfit.line


def test_a_claim_stated_after_earlier_seeds_is_judged_on_the_later_seeds_only():
    """`from_seed`: seeds 0-1 (which suggested the claim) fail it, seeds 2-3 hold it. Judged on all four
    the claim fails; from seed 2 it holds, and the page's row counts only seeds 2-3."""
    from study.results_page import claim_row

    claim = {**SPEC["claims"][0], "from_seed": 2}
    spec = spec_with(replicas=4, claims=[claim])
    rows = results(spec, {"coupled": [0.0, 0.0, 1.0, 1.0], "random_shift": [0.0] * 4})
    assert judge(spec_with(replicas=4), rows)[0].verdict == "fails"
    verdict = judge(spec, rows)[0]
    assert verdict.verdict == "holds" and {r["seed"] for r in verdict.rows} == {2, 3}, verdict.line
    assert "on seeds >= 2" in spec.claims[0].rule
    row = claim_row(spec, spec.claims[0], rows)
    assert row["fit"] == "2/2 (baseline 2/2)" and row["2x"].startswith("1.00"), row
    assert judge(spec, rows[rows.seed < 2])[0].verdict == "inconclusive"


def test_from_seed_keeps_a_searchs_selection_and_judges_its_later_replicas():
    """With a search every searched trial runs on the spec's seed (0): the config is selected on them
    all, then only its replicas on seeds >= from_seed judge the claim."""
    claim = {**SPEC["claims"][0], "from_seed": 1}
    spec = spec_with(replicas=3, claims=[claim], search={"params": {"optim.lr": {"loguniform": [1e-3, 1e-2]}}, "trials_per_cell": 1})
    rows = results(spec, {"coupled": [0.0, 1.0, 1.0], "random_shift": [0.0] * 3})
    first = rows.groupby("cell").trial_id.transform("first")  # each cell's seed-0 trial was its search
    rows = rows.assign(role=(rows.seed == 0).map({True: "search", False: "replica"}),
                       selected_from=first.where(rows.seed > 0), **{column: 1.0 for column in SUMMARY})
    verdict = judge(spec, rows)[0]
    assert verdict.verdict == "holds" and {r["seed"] for r in verdict.rows} == {1, 2}, verdict.line


def test_pooled_studies_pair_seeds_within_each_study():
    one = spec_with(replicas=1)
    a = results(one, {"coupled": [0.5], "random_shift": [0.0]})
    b = results(one, {"coupled": [0.6], "random_shift": [0.0]}).assign(seed=1)
    assert judge(one, a.assign(study="a"))[0].verdict == "inconclusive"  # one seed alone
    pooled = pooled_results([one, spec_with(replicas=1, seed=1)], [a, b], ["a", "b"])
    assert judge(one, pooled)[0].verdict == "holds"  # a seed from each study: two runs


def test_studies_of_one_spec_run_a_seed_at_a_time_pool_but_never_on_a_shared_seed():
    parts = [spec_with(replicas=1, seed=s) for s in (0, 1, 2)]
    frames = [results(p, {"coupled": [0.5], "random_shift": [0.0]}).assign(seed=s) for s, p in enumerate(parts)]
    pooled = pooled_results(parts, frames, ["s0", "s1", "s2"])
    assert sorted(pooled.seed.unique()) == [0, 1, 2] and judge(parts[0], pooled)[0].verdict == "holds"
    with pytest.raises(ValueError, match="s1: seed 0 is also s0's"):
        pooled_results(parts[:2], [frames[0], frames[0]], ["s0", "s1"])
    with pytest.raises(ValueError, match="differs in base.optim.steps"):
        other = spec_with(base={**SPEC["base"], "optim": {**SPEC["base"]["optim"], "steps": 20}}, seed=1)
        pooled_results([parts[0], other], frames[:2], ["s0", "s1"])


@pytest.mark.parametrize("claim, field", [
    ({"name": "x", "cell": {"ids": "nonsense"}, "at_least": 0.9}, "claims.0.cell"),
    ({"name": "x", "cell": {"ids": "coupled"}, "baseline": {"ids": "coupled"}}, "claims.0.baseline"),
    ({"name": "x", "cell": {"ids": "coupled"}}, "exactly one of baseline"),
    ({"name": "x", "cell": {"ids": "coupled"}, "at_least": 0.9, "at_most": 0.1}, "exactly one of baseline"),
    ({"name": "x", "cell": {}, "at_least": 0.9}, "picks 2 cells"),
    ({"name": "x", "cell": {"ids": "coupled"}, "at_least": 1.5}, "claims.0.at_least"),
])
def test_a_bad_claim_is_refused_naming_its_field(claim, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        spec_with(claims=[claim])


def test_a_linked_factor_sets_its_paths_together_and_names_the_cell_by_the_first():
    base = copy.deepcopy(SPEC["base"])
    del base["eval"]["lengths"]
    spec = spec_with(task={"name": "addition"}, base=base, grid={"train_range": [
        {"task.params.train_length": 4, "eval.lengths": [4, 8]},
        {"task.params.train_length": 6, "eval.lengths": [6, 12]}]},
        claims=[{"name": "longer", "cell": {"train_length": 6}, "baseline": {"train_length": 4}}])
    assert [c.label for c in spec.cells()] == ["train_length=4", "train_length=6"]
    configs = [spec.checked_config(c) for c in spec.cells()]
    assert [c.eval.lengths for c in configs] == [[4, 8], [6, 12]]
    with pytest.raises(ValueError, match="linked factor"):
        spec_with(grid={"train_range": [5, 8]})
    with pytest.raises(ValueError, match=r"task\.params\.train_length: also set by grid\.train_range"):
        spec_with(grid={"train_range": [{"task.params.train_length": 4}]})
    with pytest.raises(ValueError, match=r"grid\.train_range\.seed"):
        spec_with(grid={"train_range": [{"seed": 1}]})


def test_the_shipped_experiments_carry_claims_that_pick_their_cells():
    for path in sorted((ROOT / "search_spaces" / "experiments").glob("*.yaml")):
        spec = StudySpec.model_validate(load_yaml(str(path), "a study spec"))
        for claim in spec.claims:
            spec.claim_cells(claim)  # raises when a claim names no cell


def test_the_results_page_row_of_a_claim_counts_the_runs_that_fit_and_extrapolate():
    from study import results_page

    spec = spec_with(claims=[{"name": "coupled_extrapolates", "cell": {"ids": "coupled"}, "at_least": 0.95,
                              "setup": "a test", "published": "a paper: 1.00"}])
    runs = results(spec, {"coupled": [0.97, 1.0, 0.5], "random_shift": [0] * 3},
                   fit={"coupled": [1.0, 1.0, 0.9], "random_shift": [1.0] * 3}).assign(study="a")
    row = results_page.claim_row(spec, spec.claims[0], runs)
    assert row["verdict"] == "**holds**" and row["fit"] == "2/3" and row["extrapolate"] == "2/2", row
    # the figure is over the runs that fit: the third (0.5 beyond) did not, and says nothing
    assert row["2x"].startswith("0.98 [0.97-1.00] (") and row["published"] == "a paper: 1.00", row
    assert results_page.claim_row(spec, spec.claims[0], None)["verdict"] == "not run here"
    unfit = results(spec, {"coupled": [0.0, 0.2, 0.4], "random_shift": [0] * 3},
                    fit={"coupled": [0.5] * 3, "random_shift": [1.0] * 3}).assign(study="a")
    row = results_page.claim_row(spec, spec.claims[0], unfit)  # none fit: every run's figure, marked
    assert row["2x"].startswith("0.20 [0.00-0.40] (exact_match, ") and row["2x"].endswith("; no run fit)"), row
    assert row["fit"] == "0/3" and row["extrapolate"] == "0/0", row
    # a comparison's row counts its baseline's runs that fit too: an inconclusive row says why
    spec = spec_with()
    runs = results(spec, {"coupled": [1.0] * 3, "random_shift": [0.5, 0.5, 0.25]},
                   fit={"coupled": [1.0] * 3, "random_shift": [0.9, 0.9, 1.0]}).assign(study="a")
    row = results_page.claim_row(spec, spec.claims[0], runs)
    assert row["verdict"] == "**inconclusive**" and row["fit"] == "3/3 (baseline 1/3)", row
    # and shows its baseline's figure beside the cell's, over the baseline's runs that fit
    assert row["2x"].startswith("1.00 against 0.25 (") and "no baseline run fit" not in row["2x"], row
    runs = results(spec, {"coupled": [1.0] * 3, "random_shift": [0.5, 0.5, 0.25]},
                   fit={"coupled": [1.0] * 3, "random_shift": [0.9] * 3}).assign(study="a")
    row = results_page.claim_row(spec, spec.claims[0], runs)  # no baseline run fit: every one of its runs
    assert row["2x"].startswith("1.00 against 0.42 [0.25-0.50] (") and row["2x"].endswith("; no baseline run fit)"), row


def test_a_seed_is_added_to_the_committed_runs_once():
    """The judge keys runs by (study, seed): a study on a seed another committed study holds is refused
    (it would count twice); the same study added again replaces its rows."""
    from study.results_page import beside

    old = pd.DataFrame({"study": ["a/x", "a/x", "b/x"], "seed": [0, 1, 2], "exact_match": [1.0, 0.5, 0.0]})
    again = beside(old, pd.DataFrame({"seed": [0, 1], "exact_match": [0.9, 0.9]}).assign(study="a/x"), "a/x", "runs.csv")
    assert sorted(again.seed) == [0, 1, 2] and again[again.study == "a/x"].exact_match.tolist() == [0.9, 0.9]
    more = beside(old, pd.DataFrame({"seed": [3], "exact_match": [1.0]}).assign(study="c/x"), "c/x", "runs.csv")
    assert sorted(more.seed) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"--add: c/x: seed 2 is already in runs.csv \(study b/x\)"):
        beside(old, pd.DataFrame({"seed": [2, 3], "exact_match": [1.0, 1.0]}).assign(study="c/x"), "c/x", "runs.csv")


def test_a_runs_own_metric_is_judged_against_a_bound_on_every_run():
    claim = {"name": "t4", "cell": {"ids": "coupled"}, "metric": "loss_gap/recovered_median/k4", "at_least": 0.5}
    spec = spec_with(claims=[claim])
    rows = results(spec, {"coupled": [0.0] * 3, "random_shift": [0.0] * 3})
    rows["loss_gap/recovered_median/k4"] = rows.seed.map({0: 0.7, 1: 0.6, 2: 0.55})
    verdict = judge(spec, rows)[0]
    assert verdict.verdict == "holds" and "reached on 3/3 runs" in verdict.line, verdict.line
    rows["loss_gap/recovered_median/k4"] = rows.seed.map({0: 0.7, 1: 0.6, 2: 0.45})
    assert judge(spec, rows)[0].verdict == "fails"
    with pytest.raises(ValueError, match="judged against a bound"):
        spec_with(claims=[{**claim, "at_least": None, "baseline": {"ids": "random_shift"}}])


def test_a_part_run_on_other_seeds_is_added_to_its_experiments_committed_runs():
    """`python -m study.results_page --add` files a study run with `--set seed=S --set replicas=1
    --set name=...` under the experiment spec it is a part of, so the page pools the parts."""
    from study import results_page
    from study.spec.schema import load_spec

    path = ROOT / "search_spaces" / "experiments" / "coupling_train_range_16k.yaml"
    data = load_spec(str(path)).model_dump(mode="json")
    part = StudySpec.model_validate({**data, "name": "coupling_train_range_16k_s1", "seed": 1, "replicas": 1})
    assert results_page.experiment_of(part) == "coupling_train_range_16k"
    other = copy.deepcopy(data)
    other["base"]["optim"]["steps"] = 8000
    assert results_page.experiment_of(StudySpec.model_validate({**other, "name": "mine"})) == "mine"


def test_a_curve_reads_each_run_beyond_training_only_where_that_run_fit():
    """docs/coupling.md's curve: a run with no row at its train length is not taken for the next run,
    and runs are told apart by study and seed."""
    from study import results_page
    from study.spec.schema import load_spec

    spec = load_spec(str(ROOT / "search_spaces" / "experiments" / "coupling_train_range_16k.yaml"))
    cell = spec.cells()[0]
    train = spec.checked_config(cell).task_instance.train_length
    rows = []
    for study, seed, fit, beyond in (("a/x", 0, None, 0.1), ("a/x", 1, 1.0, 0.9), ("b/x", 2, 0.5, 0.3)):
        for times, exact in ((1, fit), (2, beyond), (3, beyond)):
            if exact is not None:
                rows.append({"study": study, "seed": seed, "cell": cell.label, "status": "TERMINATED",
                             "length": times * train, "checkpoint": "last", "exact_match": exact})
    line = results_page.curve(spec, pd.DataFrame(rows), None).splitlines()[2]
    assert line.startswith(f"| `{cell.label}` | 1/3 | 0.75 [0.50-1.00] | 0.90 | "), line


def test_a_baseline_at_a_k_beyond_training_is_read_for_its_fit_at_the_k_it_trained_on():
    """T1 compares k_test 2 with k_test 4 on a model trained on at most 2 planted bits: k_test 4 is
    beyond its training at any length, so whether the run fits is read at k 2, where it trained."""
    from study.spec.schema import load_spec

    data = load_spec(str(ROOT / "search_spaces" / "default.yaml")).model_dump(mode="json")
    spec = StudySpec.model_validate({**data, "search": None, "replicas": 2})
    claim = spec.claims[0]
    cell = spec.claim_cells(claim)[0]
    cfg = spec.checked_config(cell)
    train = cfg.task_instance.train_length
    rows = []
    for seed in (0, 1):
        common = {"trial_id": f"t{seed}", "cell": cell.label, "seed": seed, "status": "TERMINATED", "role": "search",
                  "ids": cfg.positional.scheme.own_ids, "n": 256}
        for length, k, exact in ((train, 2, 1.0), (train, 4, 0.3), (2 * train, 2, 1.0), (2 * train, 4, 0.5)):
            rows.append({**common, "length": length, "k": k, "exact_match": exact, "answer_acc": exact})
    verdict = judge(spec, pd.DataFrame(rows))[0]
    assert verdict.verdict == "holds" and "runs fit 2/2 and 2/2 (baseline)" in verdict.line, verdict.line


def test_studies_that_state_other_claims_are_judged_only_with_the_claims_named():
    """A study run before a claim was added to its spec stores fewer claims: pooled with a later one,
    which claims are judged must not hang on the order the studies are named in."""
    one, two = spec_with(), spec_with(seed=1)
    same_claims([one, two], ["a", "b"])  # the same claims: nothing to say
    later = spec_with(claims=[*SPEC["claims"], {**SPEC["claims"][0], "name": "added_later", "effect": 0.2}])
    for order in ([one, later], [later, one]):
        with pytest.raises(ValueError, match=r"states other claims than .* \(added_later\); give --space"):
            same_claims(order, ["first", "second"])
    stricter = spec_with(claims=[{**SPEC["claims"][0], "effect": 0.3}])
    with pytest.raises(ValueError, match="stated otherwise"):
        same_claims([one, stricter], ["a", "b"])
