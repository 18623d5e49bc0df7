"""The seam of the analyses a trial runs after training: what the trial layer knows of one.

An analysis is one module in analysis/ with one class, a subclass of `Analysis`: its fields are the
trial config's section of its `name` (`sparsity:`), and it says what it checks, holds in memory,
reports (`metrics`, catalogue entries) and leaves beside the metrics (`tables`, `write_artifacts`).
`register` files it under its name; analysis/__init__.py registers the shipped ones, so a process
that validates a trial config with an analysis section imports `analysis` first (the study, the
trial workers and the commands do). The trial layer never imports an analysis: it reads this table.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import ValidationError

from trial.limits import Piece, Strict
from trial.metrics import Metric, add_metrics
from trial.yaml_io import describe_errors


class Analysis(Strict):
    """An analysis as one trial config's section sets it. Subclasses set the class variables and `run`."""

    name: ClassVar[str]  # the trial config's section, and the prefix of its metrics (`sparsity/...`)
    metrics: ClassVar[tuple[Metric, ...]] = ()  # catalogue entries of what `run` reports
    report_columns: ClassVar[tuple[str, ...]] = ()  # of them, the study report's columns where present
    tables: ClassVar[tuple[str, ...]] = ()  # the row tables `run` returns, by name

    def check(self, cfg) -> None:
        """Raise a ValueError naming the field when this section cannot measure trial config `cfg`."""

    def memory(self, cfg, arch) -> list[Piece]:
        """The pieces of memory the analysis holds while it runs (trial/limits.py's estimate)."""
        return []

    def run(self, module, task, cfg, device) -> tuple[dict, dict[str, list[dict]]]:
        """After training, on every rank: (metrics named `{name}/...`, its `tables` by name)."""
        raise NotImplementedError

    def write_artifacts(self, tables: dict[str, list[dict]], folder: str, title: str) -> None:
        """Its tables and figures as files in `folder` (a recorder stores them under `name`); `title`
        says which trial they measure."""


REGISTERED: dict[str, type[Analysis]] = {}


def register(*classes: type[Analysis]) -> None:
    """File each analysis under its name: trial configs take its section, the catalogue its metrics."""
    for cls in classes:
        if REGISTERED.get(cls.name, cls) is not cls:
            raise ValueError(f"analysis {cls.name!r} is registered already ({REGISTERED[cls.name].__qualname__})")
        REGISTERED[cls.name] = cls
        add_metrics(cls.metrics, cls.report_columns)


def analysis_sections(data: Any, fields: set[str]) -> Any:
    """The registered analyses' sections of a raw config moved under `analyses`, each validated as
    its analysis's settings; an error names the section's field (`sparsity.k_max: ...`). A key that is
    none of `fields` nor a registered analysis is refused, saying how analyses are registered."""
    if not isinstance(data, dict):
        return data
    if "analyses" in data:
        raise ValueError(f"analyses: not a field; give each analysis its own section ({', '.join(REGISTERED)})")
    unknown = [k for k in data if k not in fields and k not in REGISTERED]
    if unknown:
        raise ValueError(f"{unknown[0]}: Extra inputs are not permitted (not a trial-config field, nor an analysis "
                         "registered in this process: `import analysis` registers the shipped ones)")
    data, found = dict(data), {}
    for name in [n for n in data if n in REGISTERED]:
        section = data.pop(name)
        if section is None:
            continue
        try:
            found[name] = section if isinstance(section, REGISTERED[name]) else REGISTERED[name].model_validate(section)
        except ValidationError as e:  # the section's own fields, named from the top of the config
            raise ValueError("; ".join(f"{name}.{line}" if re.match(r"[\w.]+: ", line) else f"{name}: {line}"
                                       for line in describe_errors(e).splitlines())) from None
    return {**data, "analyses": found}


def table_key(name: str, table: str) -> str:
    """The key of an analysis's table in the trial's last report (`sparsity_targets`)."""
    return f"{name}_{table}"
