"""The code's shape, checked: the layers import one way, no module imports itself back through
others (imports inside functions count), modules and their docstrings stay short enough to read,
Ray's private names live in one module, and MLflow is spoken in its recorder's folder only.

Layers, lowest first: tasks and models, then trial (one trial), then analysis (after training), then
study (many trials, and the commands). A module may import its own layer and the layers below; inside
study, its jobs are layered the same way (ray_compat, spec, results, record, experiment, the commands).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"tasks": 0, "models": 0, "trial": 1, "analysis": 2, "study": 3, "benchmarks": 4, "gpu": 4}
PACKAGES = ("tasks", "models", "trial", "analysis", "study", "benchmarks", "gpu")  # every package of the repository
MAX_LINES = 400
# modules allowed past MAX_LINES, with why (a reason a reader would accept, not "it grew")
LONG_MODULES = {
    "trial/config.py": "the trial config: every field a trial takes and the checks across fields, one contract "
                       "a user reads whole when a config is refused",
    "study/spec/schema.py": "the study spec: its fields and every cross-field check that refuses a bad study "
                            "before it starts, read together",
    "models/decoder.py": "the whole model in one file a researcher can hold in their head, as nanoGPT's model.py",
    "benchmarks/suite.py": "P1-P5, a function and a printer each, run side by side in one process so that "
                           "their ratios share one machine state",
    "benchmarks/scale.py": "P6 end to end (the simulated cluster, the study, its kill and resume, the report, "
                           "and the driver's MLflow/snapshot counters): read together when a figure is questioned",
    "gpu/check.py": "the GPU check's steps, each run in a process of its own against one deadline, and its "
                    "summary: one call of a GPU machine, read together",
    "benchmarks/mlflow_ui.py": "a 1,000-run record in the tracking server it is given, its API timings and the "
                               "runs page dumped and clicked through: one measurement, read together",
}
RAY_COMPAT = "study/ray_compat.py"


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts).removesuffix(".__init__")
            found[name] = path
    return found


def project_imports(path: Path, known: set[str]) -> set[str]:
    """Every project module `path` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from study import storage` imports study.storage; `from trial.x import f` imports trial.x
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: project_imports(path, known) - {name} for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_every_package_of_the_repository_is_in_the_graph():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"search_spaces"}  # specs, no code
    assert packages == set(PACKAGES) == set(LAYER), packages


def test_no_module_imports_itself_back():
    # package __init__ modules that import their own submodules (analysis -> analysis.loss_gap) are
    # edges of the graph too; a submodule importing its package back would close a cycle and be found
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_package_imports_the_tests():
    """tests/ (its support code included: tests/support/, the servers the tests start) sits above every
    layer: a benchmark measures what it is given, and the tests start it (benchmarks/mlflow_ui.py's
    `--tracking-uri`, tests/test_mlflow_postgres.py)."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            found += [f"{name}: imports {n}" for n in names
                      if n.split(".")[0] in ("tests", "conftest", "support") or n.split(".")[0].startswith("test_")]
    assert not found, "\n".join(found)


def test_imports_point_down_the_layers():
    wrong = []
    for name, imported in graph().items():
        for other in imported:
            if LAYER[other.split(".")[0]] > LAYER[name.split(".")[0]]:
                wrong.append(f"{name} imports {other}")
    assert not wrong, "\n".join(sorted(wrong))


# study's jobs, lowest first (study/__init__.py): each may import its own and the ones before it
STUDY_JOB = {"study.ray_compat": 0, "study.spec": 1, "study.results": 2, "study.record": 3, "study.experiment": 4}
COMMANDS = 5  # the modules directly in study/: run, train, report, loss_gap, sparsity, model_source


def study_job(module: str) -> int:
    return next((rank for prefix, rank in STUDY_JOB.items() if module == prefix or module.startswith(prefix + ".")),
                COMMANDS)


def test_study_jobs_import_down_too():
    wrong = [f"{name} imports {other}" for name, imported in graph().items() if name.startswith("study.")
             for other in imported if other.startswith("study.") and study_job(other) > study_job(name)]
    assert not wrong, "\n".join(sorted(wrong))
    # every study module is in a job: a new sub-package must be placed above
    packages = {p.parent.name for p in (ROOT / "study").glob("*/__init__.py")}
    assert {f"study.{p}" for p in packages} <= set(STUDY_JOB), packages


def test_modules_are_short_enough_to_read():
    long = {}
    for _name, path in modules().items():
        rel = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and rel not in LONG_MODULES:
            long[rel] = lines
    assert not long, f"over {MAX_LINES} lines without a reason in LONG_MODULES: {long}"


MAX_DOCSTRING_LINES = 15


def test_module_docstrings_are_short():
    """A module's docstring says what it is for and where to read more; definitions, figures and
    history belong in docs/."""
    long = {}
    for _name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        lines = doc.count("\n") + 1 if doc else 0
        if lines > MAX_DOCSTRING_LINES:
            long[str(path.relative_to(ROOT))] = lines
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the rest to docs/): {long}"


def test_mlflow_is_spoken_in_its_recorder_only():
    """The record is a seam (study/record/recorder.py): only the MLflow recorder's folder imports
    mlflow; everything else asks the recorder."""
    found = []
    for name, path in modules().items():
        if name.startswith(("study.record.mlflow", "benchmarks.")):  # the benchmarks measure MLflow itself
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [f"{name}: imports {n}" for n in names if n.split(".")[0] == "mlflow"]
    assert not found, "\n".join(found)


PRIVATE_RAY = re.compile(r"ray\.\w+(\.\w+)*\._\w+|ray\._\w+|\._(local_tuner|delete_fs_path|checkpoint_manager)\b"
                         r"|\b_internal\b|current_checkpoint_index")


def test_rays_private_names_live_in_one_module():
    found = []
    for path in [*ROOT.glob("study/**/*.py"), *ROOT.glob("trial/**/*.py"), *ROOT.glob("benchmarks/*.py"),
                 *ROOT.glob("gpu/*.py")]:
        rel = str(path.relative_to(ROOT))
        if rel == RAY_COMPAT:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE_RAY.search(line.split("#")[0]):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line, private", [
    ("from ray.train._internal.session import get_session", True),
    ("tuner._local_tuner.get_run_config()", True),
    ("import ray.tune", False),
])
def test_the_private_name_pattern_tells_them_apart(line, private):
    assert bool(PRIVATE_RAY.search(line)) is private


def test_ruff_finds_nothing():
    """The lint of pyproject.toml's [tool.ruff.lint], over the whole repository (CI runs this file)."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]'")
    out = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_tests_use_no_private_name_of_the_project():
    """A test reads what users and other modules read: no `from study.x import _name`, no `module._name`
    on a project module (a private helper is made public, with a name that says what it holds)."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        modules_bound = set()  # local names bound to a project module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                    modules_bound.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PACKAGES:
                        modules_bound.add((alias.asname or alias.name).split(".")[0])
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id not in ("self", "cls")):
                continue
            if node.value.id in modules_bound or node.attr in project_privates():
                found.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not found, "\n".join(found)


def project_privates() -> set[str]:
    """The private names the project defines (functions, methods, attributes, module globals)."""
    pattern = re.compile(r"^\s*(?:async\s+)?def (_[a-z]\w*)|self\.(_[a-z]\w*)\s*[:=]|^(_[a-z]\w*)\s*[:=]", re.M)
    names = set()
    for path in modules().values():
        for match in pattern.finditer(path.read_text()):
            names.add(next(g for g in match.groups() if g))
    return names
