"""Which study a record belongs to: an id made when a study starts, stored beside it with its spec.

A study is its folder (`<storage>/<name>`), made once, not its name: two storages, or one folder
deleted and made again, hold different studies under one name, and one MLflow store (every bucket
study shares `./studies/mlflow.db` by default) records them all. `<study>/study.json` holds the
study's id, where it lives and the spec it started with. The study's MLflow parent run carries the
id as a tag (study/record/mlflow/experiment.py), so a study only ever reads, tags or deletes its own runs; a study
folder without a readable study.json is refused, never matched by name, and so is a copy of a study's
folder, whose study.json names the original's location, or, at the same path on another host, the
original's host and folder inode (`python -m study.record.identity --new-study FOLDER` records the
copy as a study of its own). `--resume` reads the id
back, and refuses a spec that differs from the stored one in anything but the fields a resume
applies without changing a result (`RESUMABLE_CHANGES`).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from study.spec.schema import StudySpec, flatten
from trial import storage as store

FILE = "study.json"
# what `--resume` may change: how the remaining trials are run, never what they compute
RESUMABLE_CHANGES = ("description", "claims", "resources.max_concurrent_trials", "resources.max_failures",
                     "resources.warm_processes")


class StudyFileError(ValueError):
    """A study folder's study.json is missing or unreadable; the message names it (one line)."""


@dataclass(frozen=True)
class StudyIdentity:
    id: str  # a new uuid per study folder
    location: str  # <storage>/<name>, a folder or a bucket URI
    created: str  # UTC, ISO 8601
    spec: dict[str, Any]  # the spec it started with, as JSON
    host: str | None = None  # where it was made, and its folder's inode there: what a copy cannot share
    inode: int | None = None

    def tags(self) -> dict[str, str]:
        return {"study.id": self.id, "study.location": self.location}


def create(spec: StudySpec, study_dir: str) -> StudyIdentity:
    """A new study's identity, written to `<study>/study.json` (whole or not at all)."""
    return _write(StudyIdentity(uuid.uuid4().hex, study_dir, _now(), spec.model_dump(mode="json")), study_dir)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write(ident: StudyIdentity, study_dir: str, **more) -> StudyIdentity:
    """`ident` with the folder's marker (this host, the folder's inode; a bucket has none), written."""
    if not store.is_uri(study_dir):
        os.makedirs(study_dir, exist_ok=True)
        ident = StudyIdentity(ident.id, ident.location, ident.created, ident.spec, socket.gethostname(),
                              os.stat(study_dir).st_ino)
    data = {"id": ident.id, "location": ident.location, "created": ident.created, "spec": ident.spec,
            "host": ident.host, "inode": ident.inode, **more}
    store.write_atomic(store.join(study_dir, FILE), json.dumps(data, indent=1).encode())
    return ident


def read(study_dir: str, name: str, here: bool = True) -> StudyIdentity:
    """The stored identity of the study `name` in `study_dir`. None is never an answer: a study
    made before study ids, or whose study.json is gone, cannot be told from other studies of its
    name, and a corrupt one says nothing; both are StudyFileError (the file is left as it is). So is
    (`here`) one that says the study lives elsewhere: a copied folder (`aws s3 sync`, `cp -r`) resumed
    as the study it was copied from would take over that study's MLflow record."""
    path = store.join(study_dir, FILE)
    raw = store.read_bytes(path)
    if raw is None:
        raise StudyFileError(
            f"{store.redact(path)} is missing (a study made before study ids, or the file was deleted): nothing "
            f"can tell this study's MLflow record from other studies named {name!r}, and a record is never "
            "matched by name; nothing was changed. Start it as a new study (another name or --storage)")
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        ident = StudyIdentity(data["id"], data["location"], data["created"], data["spec"], data.get("host"),
                              data.get("inode"))
        if not (isinstance(ident.id, str) and re.fullmatch(r"[0-9a-f]{32}", ident.id)):
            raise ValueError(f"id {ident.id!r} is not a study id")
        if not all(isinstance(v, str) for v in (ident.location, ident.created)) or not isinstance(ident.spec, dict):
            raise ValueError("location and created are text, spec an object")
    except (ValueError, KeyError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError: ValueErrors
        why = f"no {e}" if isinstance(e, KeyError) else "nested too deeply to be one" if isinstance(
            e, RecursionError) else " ".join(str(e).split())[:200]
        raise StudyFileError(f"{store.redact(path)} cannot be read ({why}); nothing was changed. Restore it from "
                             "a backup, or start a new study (another name or --storage)") from None
    if here and not same_folder(ident.location, study_dir):
        raise StudyFileError(
            f"{store.redact(path)} says study {name!r} lives in {store.redact(ident.location)}: this folder is a "
            "copy (or was moved), and resuming it as that study would take over its MLflow record; nothing was "
            f"changed. To continue it as a study of its own (a new MLflow record): python -m study.record.identity "
            f"--new-study {shlex.quote(store.redact(study_dir))}")
    copied = here and not store.is_uri(study_dir) and ident.inode is not None and _inode(study_dir) != ident.inode
    if copied:  # the same path, another folder: a copy on another host (or a folder made again)
        raise StudyFileError(
            f"{store.redact(path)} says study {name!r} was made in the folder of inode {ident.inode} on host "
            f"{ident.host}; this is inode {_inode(study_dir)} on {socket.gethostname()}: a copy at the same path, "
            "and resuming it as that study would take over its MLflow record; nothing was changed. To continue "
            f"it as a study of its own: python -m study.record.identity --new-study {shlex.quote(study_dir)}")
    return ident


def _inode(folder: str) -> int | None:
    try:
        return os.stat(folder).st_ino
    except OSError:
        return None


def same_folder(a: str, b: str) -> bool:
    """Whether two study locations are one folder: a bucket's URIs equal, a local folder the same one
    (another path to it, through a link, is the same folder; a copy or a folder made again is not)."""
    if store.is_uri(a) or store.is_uri(b):
        return a.rstrip("/") == b.rstrip("/")
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is gone
        return os.path.abspath(a) == os.path.abspath(b)


def renew(study_dir: str) -> StudyIdentity:
    """Give the study folder `study_dir` an identity of its own (a new id, this location, the spec it
    holds), so that a copy records to a new MLflow parent run; returns it."""
    old = read(study_dir, "?", here=False)
    moved = old.inode is not None and not store.is_uri(study_dir) and _inode(study_dir) != old.inode
    if same_folder(old.location, study_dir) and not moved:  # the original keeps its identity, and its record
        raise StudyFileError(f"{store.redact(study_dir)} is where study {old.id} was made, not a copy of it; "
                             "nothing was changed")
    return _write(StudyIdentity(uuid.uuid4().hex, study_dir, _now(), old.spec), study_dir,
                  copied_from={"id": old.id, "location": old.location, "host": old.host})


def changed_fields(stored: dict[str, Any], spec: StudySpec) -> list[str]:
    """Dotted fields whose value differs between the stored spec and `spec` (a list or a search
    distribution counts as one value), less those a resume may change."""
    old, new = flatten(stored), flatten(spec.model_dump(mode="json"))
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k, _MISSING) != new.get(k, _MISSING)]
    return [k for k in changed if k not in RESUMABLE_CHANGES]


_MISSING = object()


def main(argv: list[str] | None = None) -> int:
    """`python -m study.record.identity --new-study FOLDER`: record a copied study folder as a study of
    its own, so that `--resume` continues it under a new MLflow parent run."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m study.record.identity", description=main.__doc__.split("\n")[0])
    p.add_argument("--new-study", metavar="FOLDER", required=True, help="the study's folder (<storage>/<name>)")
    folder = store.absolute(p.parse_args(argv).new_study)
    try:
        ident = renew(folder)
    except (StudyFileError, store.StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{store.redact(store.join(folder, FILE))}: study id {ident.id}, location {store.redact(folder)}; "
          "continue it with `python study/run.py --resume` (its MLflow record starts afresh)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
