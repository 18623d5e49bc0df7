"""benchmarks/schemes.py and benchmarks/field_claims.py: the schemes table compares only cells that
fit; each claim of the field trains the cells of its own recipe and is judged at its own train
length; the claims' verdicts and tables are written into the docs. From made-up rows: nothing trains."""

import json

import pandas as pd
import pytest

from benchmarks.field_claims import FIELD_CLAIMS, check_field_claims, claim_jobs, judge
from benchmarks.schemes import LITERATURE, main, scheme_of, scheme_table
from trial.config import TrialConfig

CLAIM = {c.name: c for c in FIELD_CLAIMS}


def rows_of(task, train_length, by_scheme, fit=None, spec="schemes_randomized_published"):
    """A row per scheme, seed and length (1x, 2x, 3x) of `spec`'s runs: `by_scheme` maps a scheme to
    its exact match at 2x and 3x per seed, `fit` to its exact match at the train length (1.0 when not
    given)."""
    return [{"spec": spec, "scheme": scheme, "task": task, "seed": seed, "data_seed": None, "length": n,
             "train_length": train_length, "exact_match": exact if n > train_length else (fit or {}).get(scheme, 1.0),
             "answer_token_acc": 0.5 + exact / 2 if n > train_length else (fit or {}).get(scheme, 1.0)}
            for scheme, by_seed in by_scheme.items()
            for seed, exact in enumerate(by_seed) for n in (train_length, 2 * train_length, 3 * train_length)]


RANDOMIZED, SEQUENTIAL = "learned, randomized, encoder", "learned, sequential, encoder"  # the reversal claims'


class Trained(Exception):
    """Raised with the jobs the command would train, in place of training them."""


@pytest.fixture
def jobs_not_trained(monkeypatch):
    """The command stops where it would train, raising Trained(jobs)."""
    import benchmarks.schemes as schemes

    def run_jobs(jobs, *args):
        raise Trained(jobs)

    monkeypatch.setattr(schemes, "run_jobs", run_jobs)


def reversal(randomized, sequential, fit=(1.0, 1.0), spec="schemes_randomized_encoder"):
    return pd.DataFrame(rows_of("reverse", 8, {RANDOMIZED: randomized, SEQUENTIAL: sequential},
                                {RANDOMIZED: fit[0], SEQUENTIAL: fit[1]}, spec))


def test_the_schemes_table_compares_only_cells_that_fit_and_claims_need_every_seed():
    """"Which scheme extrapolates where": a row per scheme, a column per task,
    2x / 3x and the runs that reach 0.95 at 2x; a cell below 0.95 exact at the train length reads
    "did not fit" and fails every claim that needs it; a claim that one scheme beats another holds
    only when every seed's paired difference is above two standard errors of it (one sample in 256 is
    not a result); a claim whose cells were not run in its recipe's spec is not judged; a run that
    did not fit is left out of the table beyond the train length, and counted."""
    random_ = {"positional.encoding": "learned", "positional.ids": "randomized", "positional.max_position": 96,
               "task.name": "reverse"}
    assert scheme_of(random_) == "learned, randomized" and scheme_of({"positional.abacus": True}).endswith("abacus")
    assert scheme_of(random_, {"model": {"output": "encoder"}}) == "learned, randomized, encoder"

    good = reversal((1.0, 0.5, 0.97), (0.0, 0.0, 0.0))
    text = scheme_table(good, train_length=8)
    randomized = next(line for line in text.splitlines() if line.startswith("| learned, randomized"))
    assert "0.82 / 0.82 (2/3)" in randomized and LITERATURE[RANDOMIZED] in randomized
    tokens = scheme_table(good, train_length=8, metric="answer_token_acc")
    assert f"| {RANDOMIZED} | 0.91 / 0.91 |" in tokens and f"| {SEQUENTIAL} | 0.50 / 0.50 |" in tokens
    assert judge(CLAIM["randomized_reversal_exact"], good, 256)[0] is True
    assert judge(CLAIM["randomized_reversal_tokens"], good, 256)[0] is True
    assert judge(CLAIM["coupled_multiplication"], good, 256) == (None, "not run")
    elsewhere = reversal((1.0, 0.5, 0.97), (0.0, 0.0, 0.0), spec="schemes_by_task")  # not the claim's recipe
    assert judge(CLAIM["randomized_reversal_exact"], elsewhere, 256) == (None, "not run")
    lines, failures = check_field_claims(good, 256)
    assert failures == [] and "claim coupled_multiplication: not run  [Cho et al. 2024]" in lines  # not a failure
    one_seed_below = reversal((1.0, 0.5, 0.0), (0.0, 0.0, 0.1))  # the mean is above, one seed is not
    holds, figures = judge(CLAIM["randomized_reversal_exact"], one_seed_below, 256)
    assert holds is False and "paired difference 0.47 [-0.10-1.00]" in figures and "on 2/3 runs" in figures
    by_a_sample = reversal((0.04, 0.03, 1 / 256), (0.0, 0.0, 0.0))  # above on every seed, by one sample on one
    holds, figures = judge(CLAIM["randomized_reversal_exact"], by_a_sample, 256)
    assert holds is False and "above 2 standard errors (n=256) on 2/3 runs where both fit (of 3)" in figures
    assert judge(CLAIM["randomized_reversal_exact"], by_a_sample, 25_600)[0] is True  # 100 samples of 25,600
    one_unfit = by_a_sample.copy()  # the run won by one sample did not fit: it is left out of the pairs
    one_unfit.loc[(one_unfit.scheme == RANDOMIZED) & (one_unfit.seed == 2) & (one_unfit.length == 8),
                  "exact_match"] = 0.9
    holds, figures = judge(CLAIM["randomized_reversal_exact"], one_unfit, 256)
    assert holds is True and "on 2/2 runs where both fit (of 3)" in figures
    one_unfit.loc[(one_unfit.scheme == SEQUENTIAL) & (one_unfit.seed == 1) & (one_unfit.length == 8),
                  "exact_match"] = 0.9
    assert judge(CLAIM["randomized_reversal_exact"], one_unfit, 256)[0] is False  # one pair left: too few
    partly = good.copy()  # a run that did not fit is left out beyond the train length, and said so
    partly.loc[(partly.scheme == RANDOMIZED) & (partly.seed == 2) & (partly.length == 8), "exact_match"] = 0.84
    assert f"| {RANDOMIZED} | 0.75 / 0.75 (1/2); 1 of 3 runs did not fit (0.84) |" in scheme_table(partly, 8)
    unfit = reversal((1.0, 0.5, 0.97), (0.0, 0.0, 0.0), fit=(1.0, 0.40))
    assert f"| {SEQUENTIAL} | did not fit (0.40) |" in scheme_table(unfit, 8)
    holds, figures = judge(CLAIM["randomized_reversal_exact"], unfit, 256)
    assert holds is False and figures == f"{SEQUENTIAL} did not fit (0.40 exact at 8)"
    assert any("did not fit" in f for f in check_field_claims(unfit, 256)[1])


def test_the_schemes_docs_keep_a_table_per_set_of_tasks(tmp_path):
    """`--docs` of a run over other tasks adds its table beside the earlier one (same steps and seeds)
    instead of replacing it; from saved runs, so nothing trains."""
    docs = tmp_path / "schemes.md"
    docs.write_text("# schemes\n")
    for task in ("reverse", "duplicate"):
        cells = [f"encoding=learned,ids={ids},max_position=96,name={task}" for ids in ("sequential", "randomized")]
        rows = [{"spec": "schemes_by_task", "cell": cell, "seed": 0, "data_seed": None, "checkpoint": "last",
                 "length": n, "k": None, "ids": "sequential", "own_ids": True, "exact_match": 1.0 if n == 8 else 0.0,
                 "answer_token_acc": 0.5} for cell in cells for n in (8, 16, 24)]
        saved = tmp_path / f"{task}.json"
        saved.write_text(json.dumps({"seeds": [0], "rows": rows}))
        assert main(["--cells", *cells, "--seeds", "0", "--steps", "6000", "--from-json", str(saved),
                     "--docs", str(docs)]) in (0, 1)  # 1: the claim fails on these made-up rows
    text = docs.read_text()
    assert "<!-- generated: schemes_by_task reverse steps 6000 seeds 0 -->" in text
    assert "<!-- generated: schemes_by_task duplicate steps 6000 seeds 0 -->" in text


def test_saved_runs_of_other_seeds_are_an_error_that_names_the_seeds_they_hold(tmp_path, capsys):
    """`--from-json` of runs at seeds 9-11 without `--seeds 9 10 11` matches nothing: exit 2 with the
    seeds the files hold, not a traceback; a file that is not there is exit 2 too."""
    cell = "encoding=learned,ids=sequential,max_position=96,name=reverse"
    rows = [{"spec": "schemes_by_task", "cell": cell, "seed": 9, "length": n, "k": None, "ids": "sequential",
             "own_ids": True, "exact_match": 1.0, "answer_token_acc": 1.0} for n in (8, 16)]
    saved = tmp_path / "runs.json"
    saved.write_text(json.dumps({"seeds": [9], "rows": rows}))
    assert main(["--cells", cell, "--from-json", str(saved)]) == 2
    assert capsys.readouterr().err.strip().endswith("the files hold seeds [9] (give them with --seeds)")
    assert main(["--cells", cell, "--from-json", str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err.startswith("error: --from-json: ")


def test_an_encoders_cells_are_their_own_rows_beside_the_decoders():
    """The same scheme and task read at once by an encoder is another model: it is another row of
    the table, and a run of both specs trains both (cells are run once per scheme, task and seed)."""
    from benchmarks.coupling import jobs_for
    from benchmarks.field_claims import SPACES

    rows = {(scheme_of(j["factors"], j["trial"]), j["trial"]["task"]["name"])
            for spec in ("schemes_randomized_published", "schemes_randomized_encoder")
            for j in jobs_for(SPACES / f"{spec}.yaml", [0], None, None)[0]}
    assert len(rows) == 8 and ("learned, randomized, encoder", "duplicate") in rows
    assert ("learned, sequential", "reverse") in rows


def test_cells_the_tables_cannot_tell_apart_run_once_and_the_command_says_which(tmp_path, jobs_not_trained, capsys):
    """Two cells that differ only where the tables do not look (here the id range) are one scheme on
    one task: the second is not trained, and a line names it and the cell it runs as."""
    import yaml

    from benchmarks.field_claims import SPACES

    spec = yaml.safe_load((SPACES / "schemes_randomized_encoder.yaml").read_text())
    spec["grid"] = {"positional": [{"encoding": "learned", "ids": "randomized", "max_position": n} for n in (64, 128)]}
    path = tmp_path / "two_ranges.yaml"
    path.write_text(yaml.safe_dump(spec))

    with pytest.raises(Trained) as trained:
        main([str(path), "--seeds", "0", "1"])
    assert [(j["cell"], j["trial"]["seed"]) for j in trained.value.args[0]] == [
        ("encoding=learned,ids=randomized,max_position=64", 0), ("encoding=learned,ids=randomized,max_position=64", 1)]
    said = [line for line in capsys.readouterr().out.splitlines() if "runs once" in line]
    assert said == [f"{spec['name']} encoding=learned,ids=randomized,max_position=128: runs once, as {spec['name']} "
                    "encoding=learned,ids=randomized,max_position=64 (one row of the tables: learned, randomized, "
                    "encoder on reverse)"]


def test_each_claim_trains_the_cells_of_its_own_recipe_once():
    """The claims' cells: Abacus and its baseline from the spec that trains them on 1-10 digits, the
    reversal claims sharing their runs of an encoder, the longest trials first."""
    jobs, train_lengths = claim_jobs(FIELD_CLAIMS, [12, 13], None)
    cells = [(j["spec"], scheme_of(j["factors"]), j["trial"]["task"]["name"], j["trial"]["optim"]["steps"])
             for j in jobs if j["trial"]["seed"] == 12]
    assert sorted(cells) == [
        ("schemes_abacus_train10", "learned, random_shift", "addition", 8_000),
        ("schemes_abacus_train10", "nope, sequential, abacus", "addition", 8_000),
        ("schemes_multiplication_coupled", "learned, coupled", "multiplication", 12_000),
        ("schemes_randomized_encoder", "learned, randomized", "reverse", 24_000),
        ("schemes_randomized_encoder", "learned, sequential", "reverse", 24_000),
        ("schemes_randomized_published", "learned, randomized", "duplicate", 12_000),
        ("schemes_randomized_published", "learned, sequential", "duplicate", 12_000)]
    assert len(jobs) == 2 * len(cells)
    assert [j["spec"] for j in jobs[:2]] == ["schemes_abacus_train10"] * 2  # the longest: 4 layers of d 256
    assert train_lengths == {"schemes_abacus_train10": 10, "schemes_multiplication_coupled": 5,
                             "schemes_randomized_encoder": 8, "schemes_randomized_published": 8}
    assert {j["trial"]["model"]["output"] for j in jobs if j["trial"]["task"]["name"] == "reverse"} == {"encoder"}
    # mixed precision only where it pays (d 256 x 4 layers; docs/speed.md): the 2-layer cells stay fp32
    assert {j["spec"]: j["trial"]["deepspeed"]["bf16"] for j in jobs} == {
        "schemes_abacus_train10": "mixed", "schemes_multiplication_coupled": False,
        "schemes_randomized_encoder": False, "schemes_randomized_published": False}
    # length groups where a third of a padded batch is padding (docs/speed.md, P7); multiplication's is a sixth
    assert {j["spec"]: TrialConfig.model_validate(j["trial"]).optim.length_groups for j in jobs} == {
        "schemes_abacus_train10": 4, "schemes_multiplication_coupled": 1,
        "schemes_randomized_encoder": 4, "schemes_randomized_published": 4}
    only, _ = claim_jobs([CLAIM["randomized_duplication_tokens"]], [12], None)
    assert {j["trial"]["task"]["name"] for j in only} == {"duplicate"} and len(only) == 2


def saved_claim_runs(path, claims, abacus_at_2x):
    """Made-up runs of `claims`' cells at seeds 0 and 1, as `--json` keeps them: every cell fits, the
    Abacus cell scores `abacus_at_2x` beyond the train length and every other cell 0.0."""
    jobs, train_lengths = claim_jobs(claims, [0, 1], None)
    rows = [{"spec": j["spec"], "cell": j["cell"], "seed": j["trial"]["seed"], "data_seed": None, "checkpoint": "last",
             "length": n, "k": None, "ids": "sequential", "own_ids": True,
             "exact_match": 1.0 if n == train_lengths[j["spec"]] else (
                 abacus_at_2x if "abacus" in j["cell"] or "randomized" in j["cell"] else 0.0),
             "answer_token_acc": 1.0} for j in jobs for n in j["trial"]["eval"]["lengths"]]
    series = [{"spec": j["spec"], "cell": j["cell"], "seed": j["trial"]["seed"], "step": 100, "track/loss": 1.0}
              for j in jobs]
    path.write_text(json.dumps({"seeds": [0, 1], "rows": rows, "series": series}))
    return path


def test_claims_are_judged_at_their_own_train_length_and_written_into_the_docs(tmp_path, capsys):
    """Addition (train <= 10, judged at 20) and reversal (train <= 8, judged at 16) in one run: each
    claim at its own 2x, a table per train length, and the verdicts as a docs block; exit 0 when every
    claim holds, 1 when one fails."""
    claims = [CLAIM["abacus_addition"], CLAIM["randomized_reversal_exact"]]
    names = [c.name for c in claims]
    docs = tmp_path / "schemes.md"
    docs.write_text("# schemes\n")
    saved = saved_claim_runs(tmp_path / "runs.json", claims, abacus_at_2x=0.9)
    kept = tmp_path / "kept.json"
    assert main(["--claims", *names, "--seeds", "0", "1", "--from-json", str(saved), "--docs", str(docs),
                 "--json", str(kept)]) == 0
    out = capsys.readouterr().out
    # the rewritten file keeps each trial's tracked series beside the rows
    assert json.loads(kept.read_text())["series"] == json.loads(saved.read_text())["series"]
    assert "claim abacus_addition: holds" in out and "at 20, paired difference 0.90" in out
    assert "claim randomized_reversal_exact: holds" in out and "at 16, paired difference 0.90" in out
    text = docs.read_text()
    assert "<!-- generated: claims abacus_addition randomized_reversal_exact seeds 0 1 -->" in text
    assert "- claim abacus_addition: holds (exact_match: nope, sequential, abacus 0.90" in text
    assert "<!-- generated: claims addition (lsb_first, unpadded) steps 8000 seeds 0 1 -->" in text
    assert "<!-- generated: claims reverse steps 24000 seeds 0 1 -->" in text and "train <= 8" in text
    saved = saved_claim_runs(tmp_path / "runs.json", claims, abacus_at_2x=0.0)
    assert main(["--claims", *names, "--seeds", "0", "1", "--from-json", str(saved)]) == 1
    assert "claim failed: claim abacus_addition: fails" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # a claim's cells are its own: not picked by hand too
        main(["--claims", "abacus_addition", "--cells", "name=reverse"])
    assert exit_.value.code == 2 and "--claims trains the claims' own cells" in capsys.readouterr().err


def test_the_command_alone_checks_all_but_the_claims_on_request(tmp_path, capsys):
    """A claim on request (duplication, at chance in both schemes at this scale) trains only when named:
    the command alone trains the other claims' cells, judges them, and says how to ask for it."""
    assert [c.name for c in FIELD_CLAIMS if c.on_request] == ["randomized_duplication_tokens"]
    default = [c for c in FIELD_CLAIMS if not c.on_request]
    saved = saved_claim_runs(tmp_path / "runs.json", default, abacus_at_2x=0.9)  # no duplication runs in it
    assert main(["--seeds", "0", "1", "--from-json", str(saved)]) == 1  # multiplication's 0.0 fails
    out = capsys.readouterr().out
    for claim in default:
        assert f"claim {claim.name}: holds" in out or f"claim {claim.name}: fails" in out
    assert "claim randomized_duplication_tokens: not run (on request: --claims randomized_duplication_tokens)" in out
    assert out.count("claim randomized_duplication_tokens") == 1  # not also judged


def test_bf16_sets_the_precision_of_every_cell_it_trains(jobs_not_trained):
    """`--bf16 false` reruns the Abacus claim's mixed-precision cells in fp32 (as its earlier figures
    were measured); any other value is refused before a trial starts."""
    with pytest.raises(Trained) as trained:
        main(["--claims", "abacus_addition", "--seeds", "0", "--bf16", "false"])
    assert [j["trial"]["deepspeed"]["bf16"] for j in trained.value.args[0]] == [False, False]
    with pytest.raises(Trained) as trained:
        main(["--claims", "abacus_addition", "--seeds", "0"])
    assert [j["trial"]["deepspeed"]["bf16"] for j in trained.value.args[0]] == ["mixed", "mixed"]
    with pytest.raises(SystemExit) as refused:
        main(["--claims", "abacus_addition", "--seeds", "0", "--bf16", "sometimes"])
    assert refused.value.code == 2


def test_a_table_rebuilt_from_saved_runs_says_how_each_run_trained(tmp_path, capsys):
    """Runs keep their recipe (steps, lr, precision) on their rows: a table rebuilt with `--from-json`
    names it per scheme, with the seeds of each where seeds trained apart, whatever the rebuilding
    command's --steps / --bf16 say; rows saved without it (older files) take the command's."""
    claim = CLAIM["abacus_addition"]
    data = json.loads(saved_claim_runs(tmp_path / "runs.json", [claim], abacus_at_2x=0.9).read_text())
    new = [{**r, "steps": 8000, "lr": 3e-4, "bf16": "mixed"} for r in data["rows"] if r["seed"] == 1]
    (tmp_path / "new.json").write_text(json.dumps({"seeds": [1], "rows": new}))
    (tmp_path / "old.json").write_text(json.dumps({"seeds": [0], "rows": [r for r in data["rows"] if r["seed"] == 0]}))
    assert main(["--claims", claim.name, "--seeds", "0", "1", "--steps", "4000", "--bf16", "false",
                 "--from-json", str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 0
    abacus = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| nope, sequential, abacus"))
    assert abacus.endswith("| 4,000 steps, lr 0.0003, fp32 (seed 0); 8,000 steps, lr 0.0003, bf16 mixed (seed 1) |")
    assert main(["--claims", claim.name, "--seeds", "1", "--from-json", str(tmp_path / "new.json")]) == 0
    abacus = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| nope, sequential, abacus"))
    assert abacus.endswith("| 8,000 steps, lr 0.0003, bf16 mixed |")  # one recipe: no seeds to tell apart


def test_a_trained_run_saves_its_recipe_on_every_row_and_the_hosts_matmul_rates(tmp_path, capsys):
    """A real trial in a spawned worker (1 layer of d 32, 4 steps): each row it saves names the
    steps, learning rate and precision it trained with, as `--from-json` reads them back; the file and
    the output give the host's one-thread matmul rates, which a trial's time follows."""
    from benchmarks.coupling import jobs_for, run_jobs
    from benchmarks.field_claims import SPACES

    jobs, _ = jobs_for(SPACES / "smoke.yaml", [3], None, ["train_length=8"])
    jobs[0]["trial"]["optim"].update(steps=4, warmup_steps=1, lr=2e-3)
    jobs[0]["trial"]["eval"].update(every_steps=4, lengths=[8])
    rows, *_, host = run_jobs(jobs[:1], 1, str(tmp_path / "runs.json"), [3])
    data = json.loads((tmp_path / "runs.json").read_text())
    saved = data["rows"]
    assert rows and saved == rows
    assert {(r["steps"], r["lr"], r["bf16"]) for r in saved} == {(4, 2e-3, False)}
    assert data["host"] == host and set(host) == {"fp32", "bf16"} and min(host.values()) > 0
    assert f"at {host['fp32']:.0f} GFLOP/s in fp32, {host['bf16']:.0f} in bf16" in capsys.readouterr().out
