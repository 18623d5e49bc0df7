"""The command lines a researcher reads first: every `--help` says what the command does in whole
sentences with balanced backticks, every argument has a help line, `python -m study.report --markdown`
prints the summary as tables to paste, and `python -m study.compare A B` puts two studies side by side."""

from __future__ import annotations

import ast
import importlib
import json

import pytest
from test_figures import made_up_results
from test_study import ROOT

from study.results.tables import report_from_results
from study.spec.schema import load_spec

COMMANDS = ["study.run", "study.train", "study.report", "study.compare", "study.loss_gap", "study.sparsity",
            "study.claims", "study.results_page", "study.sparsity_check", "study.per_position",
            "tasks.__main__", "benchmarks.suite", "benchmarks.scale", "gpu.check", "benchmarks.mlflow_ui"]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_says_what_the_command_does_in_whole_sentences(module, capsys):
    main = importlib.import_module(module).main
    for argv in (["--help"], ["sample", "--help"]) if module == "tasks.__main__" else (["--help"],):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
        text = capsys.readouterr().out
        description = text.split("\n\n")[1]  # after the usage
        if not description.lstrip().startswith(("positional arguments", "options")):
            assert description.rstrip()[-1] in ".:)", f"{module}: the description stops mid-sentence: {description!r}"
        assert text.count("`") % 2 == 0, f"{module} {argv}: unbalanced backtick in\n{text}"


def test_every_argument_has_a_help_line():
    missing = []
    for folder in ("study", "benchmarks", "tasks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" \
                        and not any(k.arg == "help" for k in node.keywords):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not missing, "\n".join(missing)


@pytest.fixture(scope="module")
def two_studies(tmp_path_factory) -> tuple:
    """The default study's report from made-up results, and the same with twice the steps."""
    tmp = tmp_path_factory.mktemp("studies")
    spec = load_spec(str(ROOT / "search_spaces" / "default.yaml"))
    longer = load_spec(str(ROOT / "search_spaces" / "default.yaml"), overrides=["base.optim.steps=3000"])
    report_from_results(spec, made_up_results(spec), str(tmp / "A"))
    report_from_results(longer, made_up_results(longer, seeds=2), str(tmp / "B"))
    return tmp / "A", tmp / "B"


def table_rows(text: str, header_start: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_report_markdown_prints_the_summary_as_tables_to_paste(two_studies, capsys, tmp_path):
    from study.report import main

    assert main([str(two_studies[0]), "--markdown", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    selection = table_rows(out, "| cell | chosen |")
    assert selection[0] == ["cell", "chosen", "seeds", "acc_in_dist", "acc_beyond", "acc_k_beyond"]
    assert len(selection) == 2 + 6 and selection[2][:3] == ["K_train 2, learned / random_shift", "optim.lr 0.001", "3"]
    selected = json.loads(json.dumps(__import__("pandas").read_csv(tmp_path / "selected.csv").iloc[0].to_dict()))
    low, high = f"{selected['acc_beyond_min']:.2f}", f"{selected['acc_beyond_max']:.2f}"
    assert selection[2][4] == f"{selected['acc_beyond_mean']:.2f}" + ("" if low == high else f" [{low}-{high}]")
    lengths = table_rows(out, "| cell | k |")
    assert lengths[0] == ["cell", "k", "10", "20", "30", "40", "runs"] and len(lengths) == 2 + 6 * 6
    assert all(row[-1].endswith("/3") for row in lengths[2:])


def test_compare_puts_two_studies_side_by_side(two_studies, capsys):
    from study.compare import main

    assert main([str(p) for p in two_studies]) == 0
    out = capsys.readouterr().out
    assert "specs differ (A | B):\n  base.optim.steps: 1500 | 3000\n" in out
    rows = table_rows(out, "| cell |")
    assert rows[0][:3] == ["cell", "seeds (A)", "seeds (B)"] and "acc_beyond (B)" in rows[0]
    assert len(rows) == 2 + 6 and all(row[1:3] == ["3", "2"] for row in rows[2:])
    assert main([str(two_studies[0]), str(two_studies[0] / "none")]) == 2
    assert "error:" in capsys.readouterr().err
