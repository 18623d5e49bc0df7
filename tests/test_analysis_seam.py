"""The analysis seam (trial/analyses.py): an analysis is one class registered by one line, and the
trial config, the catalogue, the memory estimate, the training loop and the MLflow record learn its
section, metrics, memory, results and artifacts from it. A test analysis of this file's own goes
through each of them; the shipped ones (analysis/) are registered the same way."""

from __future__ import annotations

from typing import ClassVar

import pytest
from pydantic import Field, ValidationError

from tests.test_train import Recorder, config
from trial import analyses, metrics
from trial.analyses import Analysis, register
from trial.config import TrialConfig, selectable_metrics
from trial.limits import GiB, Piece, estimate, fits
from trial.loop import train_loop_per_worker
from trial.metrics import Metric
from trial.yaml_io import describe_errors


class Probe(Analysis):
    """Counts the model's parameters, scaled: a result the test can predict."""

    name: ClassVar[str] = "probe"
    metrics: ClassVar[tuple[Metric, ...]] = (Metric("probe/share", "end", True), Metric("probe/*", "end"))
    report_columns: ClassVar[tuple[str, ...]] = ("probe/share",)
    tables: ClassVar[tuple[str, ...]] = ("rows",)
    scale: int = Field(1, ge=1)
    gib: float = Field(0, ge=0, description="the memory it says it holds")

    def check(self, cfg) -> None:
        if self.scale > cfg.model.n_layers:
            raise ValueError(f"probe.scale: {self.scale} is more than model.n_layers {cfg.model.n_layers}")

    def memory(self, cfg, arch) -> list[Piece]:
        return [Piece("probe.gib", "the probe's buffer", int(self.gib * GiB))]

    def run(self, module, task, cfg, device):
        n = sum(p.numel() for p in module.parameters())
        return {"probe/parameters": n * self.scale, "probe/share": 0.5}, {"rows": [{"layer": i} for i in range(2)]}

    def write_artifacts(self, tables, folder, title):
        with open(f"{folder}/rows.txt", "w") as f:
            f.write(f"{title}: {len(tables['rows'])} rows\n")


@pytest.fixture
def probe():
    register(Probe)
    yield Probe
    del analyses.REGISTERED["probe"]  # leave the catalogue as the shipped analyses make it
    metrics.ANALYSIS_METRICS[:] = [m for m in metrics.ANALYSIS_METRICS if not m.name.startswith("probe/")]
    metrics.OPTIONAL[:] = [c for c in metrics.OPTIONAL if not c.startswith("probe/")]


def test_a_section_no_analysis_registered_is_refused_naming_it():
    with pytest.raises(ValidationError) as err:
        TrialConfig.model_validate(config(probe={"scale": 1}))
    assert describe_errors(err.value).startswith("probe: Extra inputs are not permitted")


def test_the_trial_config_takes_the_section_and_writes_it_back(probe):
    cfg = TrialConfig.model_validate(config(probe={"scale": 2}))
    assert cfg.probe == Probe(scale=2) and cfg.analyses_on() == ["probe"]
    assert TrialConfig.model_validate(config()).probe is None
    dumped = cfg.model_dump(mode="json")
    assert dumped["probe"] == {"scale": 2, "gib": 0.0} and "analyses" not in dumped
    assert TrialConfig.model_validate(dumped) == cfg
    for section, named in (({"scale": 0}, "probe.scale: Input should be greater"), ({"scale": 3}, "probe.scale: 3 is"),
                           ({"bogus": 1}, "probe.bogus: Extra inputs"), (7, "probe: Input should be")):
        with pytest.raises(ValidationError) as err:
            TrialConfig.model_validate(config(probe=section))
        assert describe_errors(err.value).startswith(named), describe_errors(err.value)


def test_the_catalogue_and_the_memory_estimate_learn_it(probe):
    cfg = TrialConfig.model_validate(config(probe={"gib": 4096}))
    assert "probe/*" in selectable_metrics(cfg)[1]
    assert metrics.is_proportion("probe/share") and metrics.find("probe/parameters").when == "end"
    assert "probe/share" in metrics.OPTIONAL
    assert any(p.field == "probe.gib" for p in estimate(cfg)[1])
    assert fits(cfg).startswith("probe.gib: a trial would hold about")


def test_the_loop_runs_it_after_training_and_reports_its_metrics_and_tables(probe):
    rec = Recorder()
    out = train_loop_per_worker(config(probe={"scale": 2}), rec)
    final = rec.reports[-1]
    assert final["probe/share"] == 0.5 and out["metrics"]["probe/share"] == 0.5
    assert final["probe/parameters"] == 2 * TrialConfig.model_validate(config()).n_parameters()
    assert final["probe_rows"] == [{"layer": 0}, {"layer": 1}]
    assert all("probe/share" not in r for r in rec.reports[:-1])  # after training only


def test_the_mlflow_record_stores_its_artifacts_under_its_name(probe, tmp_path):
    """A real MLflow (SQLite) run: the recorder asks the analysis to write its files."""
    from mlflow.tracking import MlflowClient

    from study.record.mlflow.trial_runs import log_final_artifacts

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.create_run(client.create_experiment("seam", artifact_location=str(tmp_path / "artifacts")))
    trial_config = TrialConfig.model_validate(config(probe={})).model_dump(mode="json")
    log_final_artifacts(client, run.info.run_id, {"probe_rows": [{"layer": 0}]}, trial_config)
    stored = [a.path for a in client.list_artifacts(run.info.run_id, "probe")]
    assert stored == ["probe/rows.txt"]
    text = open(client.download_artifacts(run.info.run_id, "probe/rows.txt", str(tmp_path))).read()
    assert text.startswith("sparse_parity, ") and text.endswith(": 1 rows\n")
