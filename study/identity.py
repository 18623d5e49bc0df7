"""Which study a record belongs to: an id made when a study starts, stored beside it with its spec.

A study is its folder (`<storage>/<name>`), made once, not its name: two storages, or one folder
deleted and made again, hold different studies under one name, and one MLflow store (every bucket
study shares `./studies/mlflow.db` by default) records them all. `<study>/study.json` holds the
study's id, where it lives and the spec it started with. The study's MLflow parent run carries the
id as a tag (study/tracking.py), so a study only ever reads, tags or deletes its own runs.
`--resume` reads the id back, and refuses a spec that differs from the stored one in anything but
the fields a resume applies without changing a result (`RESUMABLE_CHANGES`).
"""

from __future__ import annotations

import datetime
import json
import uuid
from dataclasses import dataclass
from typing import Any

from study.spec import StudySpec, flatten
from trial import storage as store

FILE = "study.json"
# what `--resume` may change: how the remaining trials are run, never what they compute
RESUMABLE_CHANGES = ("description", "resources.max_concurrent_trials", "resources.max_failures",
                     "resources.warm_processes")


@dataclass(frozen=True)
class StudyIdentity:
    id: str  # a new uuid per study folder
    location: str  # <storage>/<name>, a folder or a bucket URI
    created: str  # UTC, ISO 8601
    spec: dict[str, Any]  # the spec it started with, as JSON

    def tags(self) -> dict[str, str]:
        return {"study.id": self.id, "study.location": self.location}


def create(spec: StudySpec, study_dir: str) -> StudyIdentity:
    """A new study's identity, written to `<study>/study.json` (whole or not at all)."""
    ident = StudyIdentity(uuid.uuid4().hex, study_dir, datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), spec.model_dump(mode="json"))
    data = {"id": ident.id, "location": ident.location, "created": ident.created, "spec": ident.spec}
    store.write_atomic(store.join(study_dir, FILE), json.dumps(data, indent=1).encode())
    return ident


def read(study_dir: str) -> StudyIdentity | None:
    """The stored identity; None for a study made before identities (it has no study.json)."""
    raw = store.read_bytes(store.join(study_dir, FILE))
    if raw is None:
        return None
    data = json.loads(raw)
    return StudyIdentity(data["id"], data["location"], data["created"], data["spec"])


def changed_fields(stored: dict[str, Any], spec: StudySpec) -> list[str]:
    """Dotted fields whose value differs between the stored spec and `spec` (a list or a search
    distribution counts as one value), less those a resume may change."""
    old, new = flatten(stored), flatten(spec.model_dump(mode="json"))
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k, _MISSING) != new.get(k, _MISSING)]
    return [k for k in changed if k not in RESUMABLE_CHANGES]


_MISSING = object()
