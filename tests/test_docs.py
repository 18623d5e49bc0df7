"""The repository speaks to its users: no page, spec, module or test names an internal issue, tells how
the repository was built, or points to a file outside it; and the README defines the paper's takeaways
(T1-T4) where it first names them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()

# What a reader of the repository cannot follow: a tracker's numbers, the story of how a page or a module
# came to be, and files that are not in the repository.
FORBIDDEN = {
    "an issue or pull-request number": r"\b(issues?|pull requests?|PRs?)\s*#?\d+|(?<![\w&/])#\d+\b",
    "how the repository was built": "|".join([
        r"\bthis (turn|session)\b", r"\bround \d+\b", r"\b(a|the|code) review\b", r"\breview found\b",
        r"\blent\b", r"\bstop \d+\b", r"\bfound while\b", r"\bas before\b", r"\bblocked on\b",
        r"\btoday's code\b", r"\bwith today's\b", r"\bfirst measured\b", r"\bfirst measurement\b",
        r"\bthe first (design|attempt|layout)\b", r"\b(first|next) (GPU )?call('s| found| should)",
        r"\bbefore the (seam|redesign|code was)\b", r"\bwas fixed\b", r"\bafter .{0,40}? landed\b", r"\bin the old format\b",
        r"\bthe old (behaviour|explanation|encodings)\b", r"\bas it was\)", r"\bthe default study as it was\b",
    ]),
    "a path outside the repository": r"\.\./shared|(?<![\w.])shared/(DESIGN|PAPER)|/work/|\bhelper_rules\b",
}


def tracked_text_files() -> list[Path]:
    """The repository's files (tracked, and new ones not ignored) that are text."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    files = []
    for name in sorted(set(filter(None, out.split("\0")))):
        path = ROOT / name
        if not path.is_file() or path.resolve() == SELF:
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def design_files_outside() -> list[str]:
    """Design notes named as files (DESIGN.md, PAPER.md) that the repository does not hold."""
    names = {p.name for p in tracked_text_files()}
    return [n for n in ("DESIGN.md", "PAPER.md") if n not in names]


def findings(files: list[Path]) -> list[str]:
    patterns = {why: re.compile(p, re.IGNORECASE) for why, p in FORBIDDEN.items()}
    outside = [re.compile(rf"\b{re.escape(n)}") for n in design_files_outside()]
    found = []
    for path in files:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for why, pattern in patterns.items():
                m = pattern.search(line)
                if m:
                    found.append(f"{where}:{number}: {why}: {m.group(0)!r}")
            for pattern in outside:
                m = pattern.search(line)
                if m:
                    found.append(f"{where}:{number}: a file outside the repository: {m.group(0)!r}")
    return found


def test_the_repository_names_no_issue_no_build_history_and_no_file_outside_it():
    found = findings(tracked_text_files())
    assert not found, "\n".join(found)


def test_the_grep_finds_each_kind(tmp_path):
    """The patterns catch what they are for, and leave the platform's own words alone."""
    bad = tmp_path / "bad.md"
    bad.write_text("Measured for issue 29.\nRound 2: the ablation.\nSee ../shared/DESIGN.md.\n"
                   "Fixed in #31.\nThe figures of today's code.\nRe-measured after `deepspeed.compile` landed.\n")
    good = tmp_path / "good.md"
    good.write_text("Two rounds of the smoke study.\nA refused snapshot leaves everything as it was.\n"
                    "Colour #1f77b4; seeds 3-4; 0.95 at 2x.\n")
    found = findings([bad, good])
    assert [f.split(":")[1] for f in found if "good.md" in f] == []
    assert {f.split(":")[1] for f in found if "bad.md" in f} == {"1", "2", "3", "4", "5", "6"}


def test_the_readme_defines_each_takeaway_where_it_first_names_it():
    """T1-T4 (and F) are the paper's takeaways; the README's first mention of each is its definition."""
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"\bT[1-4]\b", text))  # (T5 is the model)
    if re.search(r"\*\*F\*\*|\(F\)|\(F;|\btakeaway F\b", text):
        named.add("F")
    assert named, "the README names no takeaway"
    for name in sorted(named):
        first = re.search(rf"\b{name}\b", text)
        definition = re.search(rf"^- \*\*{name}\*\*", text, re.MULTILINE)
        assert definition, f"README.md names {name} and never defines it (a line '- **{name}** ...')"
        assert definition.start() + 4 == first.start(), f"README.md names {name} before it defines it"


# --- tables written by their commands ------------------------------------------------------------

def recorded_smoke_study(folder: Path) -> Path:
    """A study folder as `study/run.py` leaves it, from the smoke study's recorded results.csv."""
    import pandas as pd

    from study.results.tables import report_from_results
    from study.spec.schema import load_spec

    report_from_results(load_spec(str(ROOT / "search_spaces/smoke.yaml")),
                        pd.read_csv(ROOT / "tests/data/smoke_results_before_redesign.csv"), str(folder))
    return folder


def test_the_sparsity_table_is_written_by_its_command_from_a_study(tmp_path, capsys):
    """`python -m study.sparsity_check --study DIR --docs PAGE` replaces the block between its markers
    with the selected configs' figures as the study stored them, and leaves the rest of the page."""
    import pandas as pd

    from study import sparsity_check as sparsity

    study = recorded_smoke_study(tmp_path / "smoke")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nprose before\n\n<!-- generated: sparsity smoke -->\nan old table\n"
                    "<!-- end: sparsity smoke -->\n\nprose after\n")
    assert sparsity.main(["--study", str(study), "--docs", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Page\n\nprose before\n\n<!-- generated: sparsity smoke -->\n*Generated by `python -m ")
    assert text.endswith("<!-- end: sparsity smoke -->\n\nprose after\n") and "an old table" not in text
    results = pd.read_csv(study / "results.csv").drop_duplicates("trial_id").set_index("trial_id")
    rows = [line for line in text.splitlines() if line.startswith("| train length")]
    selected = pd.read_csv(study / "selected.csv")
    assert len(rows) == len(selected) == 2
    for row, trial in zip(rows, selected.trial_id):
        cells = [c.strip() for c in row.strip("|").split("|")]
        r = results.loc[trial]  # one seed per cell: its own figures
        assert cells[3] == f"{r.acc_beyond:.2f}"
        assert cells[5] == f"{r['sparsity/k_median']:.1f} / {r['sparsity/k_p90']:.1f}"
        assert cells[6:9] == [f"{r[f'sparsity/{m}']:.2f}" for m in ("k_match", "precision", "recall")]


def test_the_sparsity_table_refuses_what_it_cannot_write(tmp_path, capsys):
    """Bad input exits 2 with one line naming it, and writes nothing."""
    import pandas as pd

    from study import sparsity_check as sparsity
    from study.results.tables import report_from_results
    from study.spec.schema import load_spec

    page = tmp_path / "page.md"
    with pytest.raises(SystemExit) as e:
        sparsity.main(["--docs", str(page)])
    assert e.value.code == 2 and "--docs: needs --study" in capsys.readouterr().err
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert sparsity.main(["--study", str(tmp_path / "none"), "--mlflow-uri", uri, "--docs", str(page)]) == 2
    assert "neither a study folder nor an experiment" in capsys.readouterr().err
    results = pd.read_csv(ROOT / "tests/data/smoke_results_before_redesign.csv")
    report_from_results(load_spec(str(ROOT / "search_spaces/smoke.yaml")),
                        results[[c for c in results if not c.startswith("sparsity/")]], str(tmp_path / "plain"))
    assert sparsity.main(["--study", str(tmp_path / "plain"), "--docs", str(page)]) == 2
    assert "no trial of it ran the sparsity meter" in capsys.readouterr().err
    assert not page.exists()


# --- the results page --------------------------------------------------------------------------------------
def test_the_results_page_is_what_its_command_makes_from_the_committed_runs():
    """docs/results.md is generated, never edited: `python -m study.results_page --docs docs/results.md`
    on a fresh clone writes it byte for byte, from docs/results/*.csv and the experiment specs."""
    from study import results_page

    assert (ROOT / "docs" / "results.md").read_text() == results_page.page()


def test_the_readme_tops_with_the_measured_rows_of_the_results_page(tmp_path, capsys):
    """`--readme README.md` fills the README's `results: top` block with the page's measured rows, short:
    the README in the repository is what the command makes, and a README without the markers is refused."""
    from study import results_page

    readme = tmp_path / "README.md"
    shipped = (ROOT / "README.md").read_text()
    head, rest = shipped.split("<!-- results: top -->\n", 1)
    readme.write_text(head + "<!-- results: top -->\n" + rest[rest.index("<!-- end results: top -->"):])  # emptied
    assert results_page.main(["--docs", str(tmp_path / "results.md"), "--readme", str(readme)]) == 0
    assert readme.read_text() == shipped
    top = readme.read_text().split("<!-- results: top -->")[1].split("<!-- end results: top -->")[0]
    measured = [r for r in results_page.claim_rows() if r["verdict"] != "not run here"]
    assert measured and len(top.strip().splitlines()) == 2 + len(measured)
    assert all(r["claim"] in top and "not run here" not in top for r in measured)
    readme.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="--readme: .* has no <!-- results: top -->"):
        results_page.main(["--docs", str(tmp_path / "other.md"), "--readme", str(readme)])
    assert not (tmp_path / "other.md").exists()  # refused before either file is written
    with pytest.raises(SystemExit) as e:
        results_page.main(["--readme", str(readme)])
    assert e.value.code == 2 and "--readme: needs --docs" in capsys.readouterr().err


def test_the_coupling_curve_is_what_its_command_makes_from_the_committed_runs(tmp_path):
    from study import results_page

    page = tmp_path / "coupling.md"
    page.write_text((ROOT / "docs" / "coupling.md").read_text())
    if results_page.committed_runs("coupling_train_range") is None:
        pytest.skip("no committed runs of coupling_train_range")
    results_page.write_curve("coupling_train_range", page)
    assert page.read_text() == (ROOT / "docs" / "coupling.md").read_text()
