"""The MLflow experiment and parent run of a study, found by the study's identity
(study/record/identity.py), never by name alone; and the look-ups of the commands that read a record
back: a study's report files (`python -m study.report NAME`) and a trial run's checkpoint
(`--mlflow-run`).

Artifacts stay under the study's own storage: a SQLite-recorded study's experiment has its artifact
location there, and MLflow keeps one artifact location per experiment, so a study of a name whose
experiment keeps its artifacts elsewhere (another storage, bucket or team) records to an experiment
of its own, `<name> @ <its artifact location>`, tagged `study.name` (`study_experiment`).
"""

from __future__ import annotations

from pathlib import Path

from study.record.identity import StudyIdentity
from study.record.recorder import RecordRefused
from study.spec.schema import StudySpec
from trial import storage as store

NAME_TAG = "study.name"  # on every experiment a study records to: all of a name's are found by it
PARENT_TAG = "study.parent"


def filter_literal(value: str) -> str | None:
    """`value` as a string literal of an MLflow filter string, or None where it has none. MLflow's
    parser takes a literal's text between its quotes as it is, with no escapes: single quotes
    unless the value holds one, else double quotes; a value with both cannot be written."""
    value = str(value)
    if "'" not in value:
        return f"'{value}'"
    return f'"{value}"' if '"' not in value else None


def find_runs(client, experiment_ids: list[str], tags: dict[str, str], max_results: int = 1) -> list:
    """Runs tagged with exactly these values, newest first. A value no literal can hold (both
    quotes) is compared here instead of in MLflow's filter."""
    written = {k: filter_literal(v) for k, v in tags.items()}
    query = " and ".join(f"tags.`{k}` = {q}" for k, q in written.items() if q is not None)
    exact = None in written.values()
    runs = client.search_runs(experiment_ids, filter_string=query, max_results=1000 if exact else max_results,
                              order_by=["attributes.start_time DESC"])
    return [r for r in runs if all(r.data.tags.get(k) == v for k, v in tags.items())][:max_results]


def artifact_root(study_dir: str, tracking_uri: str, name: str) -> str | None:
    """Where a study's MLflow artifacts go (what study/experiment/tuning.py gives the tracker): beside the
    study in its storage for a SQLite store; None where a tracking server decides."""
    import os

    return store.join(os.path.dirname(study_dir), "mlartifacts", name) if tracking_uri.startswith("sqlite:") else None


def _same_place(a: str | None, b: str) -> bool:
    def norm(u: str) -> str:
        return (u[len("file://"):] if u.startswith("file://") else u).rstrip("/")
    return a is not None and norm(a) == norm(b)


def own_experiment_name(name: str, artifact_location: str) -> str:
    """The experiment of the studies of `name` whose artifacts go to `artifact_location`, where the
    experiment `name` keeps its artifacts elsewhere (MLflow's names hold 256 characters)."""
    where = artifact_location if len(artifact_location) <= 240 - len(name) else \
        "..." + artifact_location[-(237 - len(name)):]
    return f"{name} @ {where}"


def study_experiment(client, spec: StudySpec, artifact_location: str | None, identity: StudyIdentity | None,
                     create: bool = False) -> tuple[str | None, str, str]:
    """(experiment id, name, a note to print or "") of the study's record: the experiment that
    already holds its parent run (found by identity among the experiments of its name), else the
    experiment `spec.name` where its artifacts go to `artifact_location` (or a server decides),
    else its own (`own_experiment_name`). The id is None where it does not exist and `create` is
    False. A deleted experiment is RecordRefused: restoring it, or recording elsewhere, is the user's
    choice."""
    from mlflow.entities import ViewType

    name = spec.name
    # a spec's name holds no quote (study/spec/schema.py): it has a filter_literal
    known = {e.experiment_id: e for e in client.search_experiments(
        ViewType.ALL, filter_string=f"tags.`{NAME_TAG}` = {filter_literal(name)}")}
    first = client.get_experiment_by_name(name)
    if first is not None:
        known[first.experiment_id] = first
    if identity is not None and known:
        found = find_runs(client, list(known), {PARENT_TAG: "true", **identity.tags()})
        if found:  # a study keeps its record where it is (one made before this rule, too)
            exp = known[found[0].info.experiment_id]
            _refuse_deleted(client, exp)
            return exp.experiment_id, exp.name, ""
    _refuse_deleted(client, first)
    note = ""
    wanted = name
    if first is not None and artifact_location is not None and not _same_place(first.artifact_location,
                                                                               artifact_location):
        wanted = own_experiment_name(name, artifact_location)
        note = (f"mlflow: experiment {name!r} keeps its artifacts in {store.redact(first.artifact_location or '?')}; "
                f"this study records to experiment {wanted!r}, its artifacts under its own storage")
    exp = first if wanted == name else client.get_experiment_by_name(wanted)
    _refuse_deleted(client, exp)
    if exp is not None:
        if artifact_location is not None and not _same_place(exp.artifact_location, artifact_location):
            raise RecordRefused(f"experiment {wanted!r} in {store.redact(client.tracking_uri)} keeps its artifacts in "
                                f"{exp.artifact_location}, not under this study's storage ({artifact_location}); "
                                "rename or delete that experiment, or give the study another name")
        return exp.experiment_id, wanted, note
    if not create:
        return None, wanted, note
    import yaml

    exp_id = client.create_experiment(wanted, artifact_location=artifact_location, tags={NAME_TAG: name})
    text = f"{spec.description}\n\n```yaml\n{yaml.safe_dump(spec.model_dump(mode='json'), sort_keys=False)}```"
    client.set_experiment_tag(exp_id, "mlflow.note.content", text)  # the experiment's page shows it
    return exp_id, wanted, note


def _refuse_deleted(client, exp) -> None:
    if exp is not None and exp.lifecycle_stage == "deleted":
        uri = store.redact(client.tracking_uri)
        raise RecordRefused(
            f"experiment {exp.name!r} (id {exp.experiment_id}) in {uri} is deleted; restore it (`MLFLOW_TRACKING_URI="
            f"{uri} mlflow experiments restore --experiment-id {exp.experiment_id}`), delete it for good (`mlflow gc "
            f"--backend-store-uri {uri} --experiment-ids {exp.experiment_id}`), or give the study another name")


def stored_study(uri: str, name: str, into: str) -> tuple[str, str]:
    """(folder, where) of the newest study named `name` in the store: its report files
    (results.csv, study_spec.json, series.csv where it has one) downloaded into `into`; a LookupError says why there is none."""
    import os

    from mlflow.tracking import MlflowClient

    database = uri.partition("sqlite:///")[2] if uri.startswith("sqlite:///") else None
    if database and not os.path.exists(database):  # MLflow would create an empty one to search
        raise LookupError(f"error: {name}: neither a study folder nor an experiment (no database {database})")
    client = MlflowClient(uri)
    # the studies of a name: in its experiment and in those of other artifact locations (study_experiment)
    exps = {e.experiment_id: e for e in client.search_experiments(
        filter_string=f"tags.`{NAME_TAG}` = {filter_literal(name)}")} if filter_literal(name) else {}
    exp = client.get_experiment_by_name(name)
    if exp is not None and exp.lifecycle_stage == "active":
        exps[exp.experiment_id] = exp
    if not exps:
        raise LookupError(f"error: {name}: neither a study folder nor an experiment in {uri}")
    parents = find_runs(client, list(exps), {PARENT_TAG: "true"}, max_results=1000)
    if not parents:
        raise LookupError(f"error: experiment {name} has no study run")
    run_id = parents[0].info.run_id  # studies of one name (other storages): the newest
    for file in ("results.csv", "study_spec.json"):
        client.download_artifacts(run_id, file, into)
    if any(f.path == "series.csv" for f in client.list_artifacts(run_id)):  # a study whose trials tracked lengths
        client.download_artifacts(run_id, "series.csv", into)
    folder, where = into, f"MLflow run {run_id} of experiment {exps[parents[0].info.experiment_id].name}"
    if len(parents) > 1:
        where += (f" (the tracking store holds {len(parents)} studies of this name; this is the newest, "
                  f"{parents[0].data.tags.get('study.location', 'made before study ids')}; "
                  "give a study folder to read another)")
    return folder, where


def source_tags() -> dict[str, str]:
    """MLflow's own source tags: the entry point and, in a git checkout, the commit, with
    `code.dirty` true when tracked files have changes (so a result is never credited to a commit
    that did not produce it)."""
    import subprocess

    root = str(Path(__file__).resolve().parents[3])  # the checkout: study/record/mlflow/ is three down
    tags = {"mlflow.source.name": "study/run.py", "mlflow.source.type": "LOCAL"}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return tags
    if commit:
        tags["mlflow.source.git.commit"] = commit
        tags["code.dirty"] = "true" if dirty else "false"
    return tags


def runs_link(tracking_uri: str, experiment_id: str) -> str:
    """The UI's runs table of the experiment (the experiment's default page in MLflow 3 is the
    GenAI overview). A SQLite store is read by `mlflow ui`, on 127.0.0.1:5000 by default."""
    base = store.redact(tracking_uri).rstrip("/") if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def study_params(spec: StudySpec) -> dict[str, str]:
    """What a study varies and how it selects, as the parent run's params."""
    import json

    out = {f"grid.{k}": json.dumps(v) for k, v in spec.grid.items()}
    if spec.search is not None:
        out.update({f"search.{k}": json.dumps(d.model_dump(exclude_none=True)) for k, d in spec.search.params.items()})
        out.update({"search.sampler": spec.search.sampler, "search.trials_per_cell": spec.search.trials_per_cell})
    out.update({"objective": f"{spec.objective.mode} {spec.objective.metric} (ties: lower val_loss)",
                "replicas": spec.replicas, "cells": len(spec.cells()), "task": spec.task.name, "seed": spec.seed})
    return out
