"""Every size a spec can set is bounded, and a spec beyond a bound exits 2 with one
line naming the field and the bound, within seconds, before anything is started or written.

Driven like tests/test_validation_fuzz.py: the CLIs' `main` in-process (`study/run.py --dry-run`,
`python -m study.train` stopped by an `--out` into a missing folder, `python -m tasks sample`).
"""

from __future__ import annotations

import re
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from study import run as run_cli
from study import train as train_cli
from study.spec.plan_bounds import MAX_CELLS, MAX_TRIALS, MAX_VALIDATED_CONFIGS
from study.spec.preflight import load_yaml_mapping
from tasks import __main__ as tasks_cli
from tasks import get_task
from tasks.base import MAX_SYMBOLS
from tasks.corpus import JSONL_LINE_SLACK, MAX_CORPUS_BYTES, clear_cache, load_documents
from trial.yaml_io import MAX_YAML_BYTES, MAX_YAML_DEPTH

ROOT = Path(__file__).resolve().parents[1]
SMOKE = yaml.safe_load((ROOT / "search_spaces" / "smoke.yaml").read_text())
TRIAL = (ROOT / "search_spaces" / "trials" / "sparse_parity.yaml").read_text()
# fourteen factors smoke.yaml leaves at their defaults, two valid values each (2**15 cells with its
# train_length)
FACTORS = {"model.dropout": [0.0, 0.1], "model.norm": ["layer", "rms"], "model.attn_scale": ["sqrt", "none"],
           "model.init": ["default", "t5"], "model.norm_position": ["pre", "pre_post"],
           "model.ffn": ["gelu", "gated_gelu"], "model.tie_embeddings": [False, True],
           "model.embed_init_std": [0.02, 0.05], "optim.weight_decay": [0.0, 0.01],
           "optim.grad_clip": [1.0, 0.5], "optim.min_lr_ratio": [0.1, 0.2],
           "optim.betas": [[0.9, 0.98], [0.9, 0.99]], "model.d_ff": [64, 128],
           "positional.init_std": [0.02, 0.05]}


def dry_run(tmp_path: Path, spec: dict | str, capsys) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of `study/run.py --space SPEC --dry-run`; nothing may be written."""
    path = tmp_path / "spec.yaml"
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False))
    storage = tmp_path / "storage"
    start = time.perf_counter()
    code = run_cli.main(["--space", str(path), "--storage", str(storage), "--dry-run"])
    seconds = time.perf_counter() - start
    assert not storage.exists()
    return code, capsys.readouterr().err, seconds


def refused(code: int, err: str, *named: str) -> None:
    """Exit 2 and one line, `error: ...`, holding every `named` text; no traceback."""
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in named:
        assert text in err, (text, err)


def smoke(**changes) -> dict:
    spec = yaml.safe_load(yaml.safe_dump(SMOKE))
    spec.update(changes)
    return spec


# --- the study's grid and trials: refused from the factors' lengths, before the product is built ----
@pytest.mark.timeout(60)  # before the bound: 32,768 cells validated one by one, about a minute
def test_a_grid_of_fifteen_two_value_factors_is_refused_at_once(tmp_path, capsys):
    spec = smoke(grid={**SMOKE["grid"], **FACTORS})
    code, err, seconds = dry_run(tmp_path, spec, capsys)
    refused(code, err, "grid: 32768 cells", f"bound of {MAX_CELLS} cells", "MAX_CELLS")
    assert seconds < 5, seconds


def test_one_cell_beyond_the_bound_is_refused_and_the_bound_itself_accepted(tmp_path, capsys):
    steps = list(range(20, 20 + MAX_CELLS // 2))  # with train_length's two values: MAX_CELLS cells
    base = smoke()["base"]
    base["optim"].pop("steps")
    code, err, _ = dry_run(tmp_path, smoke(base=base, grid={**SMOKE["grid"], "optim.steps": steps},
                                           search="none"), capsys)
    assert code == 0, err
    code, err, _ = dry_run(tmp_path, smoke(base=base, grid={**SMOKE["grid"], "optim.steps": [*steps, 10**4]},
                                           search="none"), capsys)
    refused(code, err, f"grid: {MAX_CELLS + 2} cells (2 x {MAX_CELLS // 2 + 1} values)",
            f"bound of {MAX_CELLS}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("changes, field", [
    ({"search": {**SMOKE["search"], "trials_per_cell": 10**9}},
     "search.trials_per_cell: 2 cell(s) x 1000000000 trials each"),
    ({"search": "none", "replicas": MAX_TRIALS},
     f"replicas: 2 cell(s) x {MAX_TRIALS} trials each (replicas)"),
])
def test_more_trials_than_the_bound_are_refused(changes, field, tmp_path, capsys):
    code, err, seconds = dry_run(tmp_path, smoke(**changes), capsys)
    refused(code, err, field, f"bound of {MAX_TRIALS} trials", "MAX_TRIALS")
    assert seconds < 5, seconds


@pytest.mark.timeout(60)  # before the bound: 51,000 trial configs validated, over a minute
def test_more_configs_to_validate_than_the_bound_are_refused(tmp_path, capsys):
    base = smoke()["base"]
    base["optim"].pop("steps")
    points = MAX_VALIDATED_CONFIGS // MAX_CELLS + 1  # at every one of MAX_CELLS cells
    lrs = [round(0.001 + i * 1e-4, 4) for i in range(points)]
    spec = smoke(base=base, grid={**SMOKE["grid"], "optim.steps": list(range(20, 20 + MAX_CELLS // 2))},
                 search={**SMOKE["search"], "params": {"optim.lr": {"choice": lrs}}})
    code, err, seconds = dry_run(tmp_path, spec, capsys)
    refused(code, err, f"search.params: {MAX_CELLS} cell(s) x {points} search points",
            f"bound of {MAX_VALIDATED_CONFIGS}", "MAX_VALIDATED_CONFIGS")
    assert seconds < 5, seconds


@pytest.mark.timeout(60)  # before the bound: ~10 s a MB to parse, unbounded
def test_a_config_file_beyond_the_size_bound_is_refused_unread(tmp_path, capsys):
    description = "word " * (MAX_YAML_BYTES // 5)
    code, err, seconds = dry_run(tmp_path, smoke(description=description), capsys)
    refused(code, err, f"spec.yaml: more than {MAX_YAML_BYTES} bytes", "MAX_YAML_BYTES")
    assert seconds < 5, seconds
    trial = tmp_path / "trial.yaml"
    trial.write_text(TRIAL + "# " + description + "\n")
    code = train_cli.main([str(trial), "--out", str(tmp_path / "missing" / "eval.csv")])
    refused(code, capsys.readouterr().err, f"trial.yaml: more than {MAX_YAML_BYTES} bytes")


# --- task parameters that size the vocabulary: bounded before it is built -----------------------
@pytest.mark.timeout(60)  # before the bound: a billion symbols would exhaust memory
@pytest.mark.parametrize("task, param", [("copy", "alphabet"), ("variable_assignment", "num_vars")])
@pytest.mark.parametrize("value", [MAX_SYMBOLS + 1, 10**9])
def test_a_vocabulary_beyond_the_bound_is_refused_naming_the_parameter(task, param, value, tmp_path, capsys):
    spec = smoke(task={"name": task, "params": {param: value, "min_length": 2}})
    spec["base"].pop("sparsity")
    spec["base"]["positional"]["max_position"] = 128
    if task == "copy":
        spec["base"]["eval"].pop("ks")
    code, err, seconds = dry_run(tmp_path, spec, capsys)
    refused(code, err, f"task.params.{param}: ", f"bound of {MAX_SYMBOLS}", "MAX_SYMBOLS")
    assert seconds < 10, seconds
    assert tasks_cli.main(["sample", task, "--param", f"{param}={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {param}: {value} is larger than the bound of {MAX_SYMBOLS}"), err


def test_the_largest_vocabulary_still_builds():
    assert len(get_task("copy", alphabet=MAX_SYMBOLS).vocab) == MAX_SYMBOLS + 3


def test_a_parameter_nested_too_deeply_for_json_is_refused_naming_it(capsys):
    assert tasks_cli.main(["sample", "copy", "--param", "alphabet=" + "[" * 10**5 + "]" * 10**5]) == 2
    assert capsys.readouterr().err.startswith("error: alphabet: "), "no traceback"


# --- corpus files: read up to max_bytes, never whole ----------------------------------------------
@pytest.fixture
def fresh_corpus_cache():
    clear_cache()
    yield
    clear_cache()


def peak_bytes(load) -> int:
    tracemalloc.start()
    try:
        load()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_folder_corpus_reads_files_only_up_to_max_bytes(tmp_path, fresh_corpus_cache):
    folder = tmp_path / "docs"
    folder.mkdir()
    text = "héllo wörld ".encode() * 10
    (folder / "a.txt").write_bytes(text)
    with open(folder / "b.txt", "wb") as f:  # 64 MiB of text, sparse on disk
        f.write(b"abc")
        f.truncate(64 * 2**20)
    docs = {}
    peak = peak_bytes(lambda: docs.update(load_documents(str(folder), max_bytes=500)))
    assert peak < 2**20, f"{peak} bytes allocated to read 500"
    assert docs == {"a.txt": text, "b.txt": b"abc" + b"\0" * (500 - len(text) - 3)}


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_file_cut_at_max_bytes_holds_what_reading_it_whole_gave(cut, tmp_path, fresh_corpus_cache):
    """Same spec, same data: the prefix read equals the whole file normalised through UTF-8, then cut."""
    raw = "aé€😀".encode() + b"\xff\xc3(" + "😀z".encode()
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_bytes(raw)
    (dict(load_documents(str(folder), max_bytes=cut))["a.txt"]
     == raw.decode("utf-8", errors="replace").encode()[:cut]) or pytest.fail(f"cut {cut}")


def test_a_jsonl_corpus_stops_at_max_bytes_and_refuses_a_line_beyond_its_bound(tmp_path, fresh_corpus_cache):
    huge = '{"text": "' + "x" * (16 * 2**20) + '"}\n'
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "first record"}\n' + huge)
    docs = {}
    peak = peak_bytes(lambda: docs.update(load_documents(str(path), max_bytes=12)))
    assert docs == {"line000000001": b"first record"} and peak < 2**20, peak  # the huge line is never read
    longest = 6 * 1000 + JSONL_LINE_SLACK
    with pytest.raises(ValueError, match=re.escape(f"docs.jsonl:2: a line longer than {longest} characters")):
        peak_bytes(lambda: load_documents(str(path), max_bytes=1000))
    path.write_text('{"text": "ok"}\n{"text": ' + "[" * 10**5 + "]" * 10**5 + "}\n")
    with pytest.raises(ValueError, match=r"docs\.jsonl:2: JSON nested too deeply"):
        load_documents(str(path), max_bytes=10**5)


def test_max_bytes_beyond_the_bound_is_refused(tmp_path, capsys, fresh_corpus_cache):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in "abcd":
        (folder / f"{name}.txt").write_text(name * 200)
    trial = yaml.safe_load((ROOT / "search_spaces" / "trials" / "lm_stdlib.yaml").read_text())
    trial["task"]["params"].update(corpus=str(folder), max_bytes=MAX_CORPUS_BYTES + 1, train_length=16)
    path = tmp_path / "trial.yaml"
    path.write_text(yaml.safe_dump(trial))
    assert train_cli.main([str(path), "--out", str(tmp_path / "missing" / "eval.csv")]) == 2
    refused(2, capsys.readouterr().err, "task.params.max_bytes: ", f"bound of {MAX_CORPUS_BYTES}",
            "MAX_CORPUS_BYTES")


# --- YAML: no recursive alias, no nesting beyond the bound through aliases -------------------------
RECURSIVE = "loop: &l {inner: *l}\n"
# each anchor nests five lists around the one before: 500 levels deep, in 25,000 values
ALIAS_CHAIN = "".join(f"a{i}: &a{i} {'[' * 5}{f'*a{i - 1}' if i else '1'}{']' * 5}\n" for i in range(100))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, named", [(RECURSIVE, "recursive YAML alias"),
                                         (ALIAS_CHAIN, f"bound of {MAX_YAML_DEPTH} (MAX_YAML_DEPTH)")])
def test_a_recursive_or_too_deep_alias_is_refused_in_one_line(text, named, tmp_path, capsys):
    code, err, seconds = dry_run(tmp_path, yaml.safe_dump(SMOKE) + text, capsys)
    refused(code, err, named)
    assert re.match(r"error: .*spec\.yaml:\d+:\d+: alias \*", err), err
    assert seconds < 5, seconds
    trial = tmp_path / "trial.yaml"
    trial.write_text(TRIAL + text)
    code = train_cli.main([str(trial), "--out", str(tmp_path / "missing" / "eval.csv")])
    refused(code, capsys.readouterr().err, "trial.yaml:", named)
    data, problem = load_yaml_mapping(str(trial), "--cluster")  # the other files a command line names
    assert data is None and problem.startswith("--cluster: ") and named in problem, problem


def test_aliases_that_stay_within_the_bounds_still_load(tmp_path, capsys):
    spec = smoke()
    spec["base"]["optim"].pop("warmup_steps")
    text = yaml.safe_dump(spec, default_flow_style=True, width=10**4).replace(
        "task.params.train_length: [8, 12]", "task.params.train_length: &lengths [8, 12]").replace(
        "optim.lr: {loguniform: [0.001, 0.01]}", "optim.lr: {loguniform: [0.001, 0.01]}, "
        "optim.warmup_steps: {choice: *lengths}")
    assert "*lengths" in text and "&lengths" in text, text
    code, err, _ = dry_run(tmp_path, text, capsys)
    assert code == 0, err


def test_an_evaluation_grid_beyond_the_bound_is_refused_before_its_product(tmp_path, capsys):
    from trial.limits import MAX_EVAL_POINTS

    spec = smoke()
    spec["base"]["eval"].update(lengths=list(range(2, 202)), ks=list(range(1, 61)))
    code, err, seconds = dry_run(tmp_path, spec, capsys)
    refused(code, err, "eval.lengths", f"bound of {MAX_EVAL_POINTS}")
    assert seconds < 10


def test_a_cluster_config_nested_too_deeply_is_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("a: " + "[" * 6000 + "]" * 6000 + "\n")
    data, error = load_yaml_mapping(str(path), "--cluster")
    assert data is None and error.startswith(f"--cluster: {path}:1:") and "nested deeper than 50 levels" in error
