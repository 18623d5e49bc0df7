"""Run a study: `python study/run.py [--space FILE] [--storage DIR|URI] [--mlflow-uri URI] [--resume] [--dry-run]`.

On a laptop it starts an embedded local Ray of its own (never another Ray running on the machine;
everything it starts listens on 127.0.0.1 only) and records to `sqlite:///<storage>/mlflow.db`
(`sqlite:///./studies/mlflow.db` when the storage is a bucket: `s3://...`, `gs://...`, trial/storage.py);
with `--address` or RAY_ADDRESS (set by `ray job submit --working-dir . -- python study/run.py ...`)
it joins that cluster. The whole study is one Tune experiment (`<storage>/<study name>/tune`), so
`--resume` continues it: finished trials are not rerun, searches and schedulers are restored,
MLflow runs are reused. Ctrl-C stops the trials, marks the study's MLflow run KILLED, writes no
results and exits 130; `--resume` continues from there.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python study/run.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))

from study.plan import (  # noqa: E402
    cluster_concurrency,
    cluster_cpus,
    default_concurrency,
    machine_memory_lines,
    placement_lines,
    plan_lines,
    read_cluster,
)
from study.record.recorder import RECORDERS, RecordRefused, recorder_class  # noqa: E402
from study.spec.schema import StudySpec, load_spec  # noqa: E402

# DeepSpeed JIT-builds its CPU op with the `ninja` on PATH; the venv's (pip's) one first, for the
# driver and every Ray worker it starts: a second ninja version on the machine takes the first one's
# build log as stale and rebuilds the op (minutes, holding a lock trials wait on)
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM, stopped the same way

# Local means local: with this switch (Ray's local-only mode) every listener of the embedded Ray is
# on 127.0.0.1; Ray reads it when imported, so it is set before ray is imported (docs/cluster.md).
LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python study/run.py", description=__doc__.split("\n")[0])
    p.add_argument("--space", default=str(ROOT / "search_spaces" / "default.yaml"), help="study spec YAML")
    p.add_argument("--storage", default="./studies",
                   help="where studies live: a folder (default ./studies) or a bucket URI, s3://bucket/prefix, "
                        "gs://bucket/prefix")
    p.add_argument("--mlflow-uri", help="tracking URI (default sqlite:///<storage>/mlflow.db; for a bucket "
                                        "sqlite:///./studies/mlflow.db, its artifacts in the bucket)")
    p.add_argument("--recorder", default="mlflow", choices=sorted(RECORDERS),
                   help="where the study is recorded (study/record/recorder.py; default mlflow, at --mlflow-uri)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted study")
    p.add_argument("--verbose", action="store_true", help="also print Tune's status tables")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--cluster", help="with --dry-run: a cluster-launcher YAML; show the node type trials land on "
                                     "and how many trials it holds at once")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="set a spec field before it is validated, e.g. resources.gpus_per_worker=1, "
                        "base.optim.steps=100, name=x, grid.task.params.train_k=[2,4] (repeatable; VALUE is YAML)")
    return p.parse_args(argv)


def closing_lines(spec: StudySpec, selected, summary, files: list[str], recorder) -> list[str]:
    """The end of a study in the terminal: per cell the selected config (and how a tie was broken),
    its mean [min-max] over seeds, accuracy per k_test at the longest test length, the
    files written, and where the record shows it (the recorder's `where`)."""
    from study.results.tables import summary_lines

    lines = summary_lines(spec, selected, summary) + ["files:"] + [f"  {f}" for f in files]
    try:
        return lines + recorder.where()
    except recorder.errors:
        return lines


def local_has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def local_shortfall(spec: StudySpec) -> str | None:
    """Why the embedded local Ray can never run one trial of this spec (its trials would wait
    PENDING forever), or None. Ray counts no more CPUs or GPUs than the machine shows."""
    import torch

    r = spec.resources
    for field, need, have in (("cpus_per_worker", r.cpus_per_worker, os.cpu_count() or 1),
                              ("gpus_per_worker", r.gpus_per_worker, torch.cuda.device_count())):
        if need * r.workers_per_trial > have:
            return (f"resources.{field}: a trial needs {need:g} x {r.workers_per_trial} worker(s), this "
                    f"machine has {have}; the local Ray could never start it (give --address for a cluster)")
    return None


class StudyExit(Exception):
    """Stop main with this exit code, after printing `message` (an `error: ...` line) to stderr."""

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message)
        self.code, self.message = code, message


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run_command(args)
    except StudyExit as e:
        if e.message:
            print(e.message, file=sys.stderr)
        return e.code


def run_command(args) -> int:
    from study.spec import preflight
    from trial import storage as store

    spec = _checked_spec(args)
    address = preflight.ray_address(args.address)  # None: the embedded Ray (`local` in any spelling)
    storage = store.absolute(args.storage)
    warning = recorder_class(args.recorder).cluster_warning(args.mlflow_uri, address, storage)
    if warning:  # e.g. SQLite on a cluster: a file on its head node
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    study_dir = store.join(storage, spec.name)
    concurrency = default_concurrency(spec, cluster_cpus(address))
    memory, crowded = ([], None) if address or args.cluster else machine_memory_lines(spec, concurrency)
    if crowded:  # the embedded Ray's trials, together, on this machine
        raise StudyExit(EXIT_BAD_INPUT, f"error: {args.space}: {crowded}")
    if args.dry_run:
        here = not (spec.resources.gpus_per_worker and not local_has_gpu()) or bool(address or args.cluster)
        code = _dry_run(args, spec, concurrency if here else None)
        print("\n".join(memory))
        return code
    stored = checked_study_folder(args, spec, storage, study_dir, address)
    if not address:
        from trial.session import pin_extension_builds

        pin_extension_builds()  # the trials' build folder and ninja, inherited by the embedded Ray
        os.environ.update(LOCAL_ONLY_ENV)  # before ray is imported
    tracking_uri = _tracking_uri(args, storage, study_dir)
    _checked_record(args.recorder, spec, study_dir, tracking_uri, stored)
    (selected, summary, files, failed, unrecorded, claims), recorder = _run_locked(
        args, spec, study_dir, tracking_uri, address, concurrency, stored)
    print("\n".join(closing_lines(spec, selected, summary, files, recorder) + claims))
    chosen = set(selected["cell"]) if "cell" in selected else set()
    unselected = [c.label for c in spec.cells() if c.label not in chosen]
    if unrecorded:
        print(f"error: {args.recorder}: {unrecorded}", file=sys.stderr)
    if not failed and not unselected:
        return 1 if unrecorded else 0
    lines = [f"error: {len(failed)} trial(s) failed:"] if failed else ["error:"]
    lines += [f"  {t['trial_id']} (cell {t['cell']}): {t['reason']}" for t in failed]
    lines += [f"  cell {label}: no trial finished, nothing selected" for label in unselected]
    print("\n".join(lines), file=sys.stderr)
    return 1


def _checked_spec(args) -> StudySpec:
    """The flags, the environment and the spec, checked before anything is read or written."""
    from study.spec import preflight
    from trial.yaml_io import InputFileError, describe_errors

    problem = preflight.check_flags(args) or recorder_class(args.recorder).check_flags(
        args.mlflow_uri, args.storage, not args.dry_run)  # where the record goes, by the recorder that writes it
    if problem:
        raise StudyExit(EXIT_BAD_INPUT, f"error: {problem}")
    try:
        return load_spec(args.space, preflight.trials_run_here(args.address), args.set)  # its memory bounds a trial's
    except (OSError, ValueError) as e:  # checked before anything is written under --storage
        where = "" if isinstance(e, InputFileError) else f"{args.space}: "  # it names file:line:col
        raise StudyExit(EXIT_BAD_INPUT, f"error: {where}{describe_errors(e)}") from None


def _dry_run(args, spec: StudySpec, concurrency: int | None) -> int:
    from study.experiment.tuning import build_search

    build_search(spec, spec.resources.model_dump())  # what Tune would be given, built (no Ray started)
    if not args.cluster:
        print("\n".join(plan_lines(spec, concurrency, "" if args.address else "this machine's CPUs")))
        return 0
    try:
        cluster = read_cluster(args.cluster)
    except OSError as e:
        raise StudyExit(EXIT_BAD_INPUT, f"error: --cluster: {e}") from None
    concurrency = spec.resources.max_concurrent_trials or cluster_concurrency(spec, cluster)  # not this machine's
    lines = plan_lines(spec, concurrency, f"what {args.cluster} holds")
    lines[5:5] = placement_lines(spec, cluster, args.cluster, concurrency)
    print("\n".join(lines))
    return 0


def checked_study_folder(args, spec: StudySpec, storage: str, study_dir: str, address: str | None):
    """Whether this study may start (or resume) here; returns its stored identity on --resume (None
    for a new study). A study without a readable study.json or driver.lock is refused."""
    from study.record import identity as ident
    from study.spec.trust import check_resume_folder
    from trial import storage as store

    shortfall = None if address else local_shortfall(spec)
    if shortfall:
        raise StudyExit(EXIT_BAD_INPUT, f"error: {args.space}: {shortfall}")
    try:  # an unreachable or unauthorised bucket stops here, before any trial (a folder: made later)
        if store.is_uri(storage):
            store.check_writable(storage)
        found = store.exists(store.join(study_dir, "tune"))
    except store.StorageError as e:
        raise StudyExit(EXIT_BAD_INPUT, f"error: --storage: {e}") from None
    if found and not args.resume:
        raise StudyExit(EXIT_BAD_INPUT, f"error: study {spec.name!r} already exists in {study_dir}; pass --resume to "
                                   "continue it, or choose another --storage or name")
    if args.resume and not found:
        raise StudyExit(EXIT_BAD_INPUT, f"error: --resume: no study {spec.name!r} in {study_dir}")
    _check_lock_file(study_dir)
    if not args.resume:
        return None
    untrusted = check_resume_folder(study_dir)  # a resume unpickles what the folder holds
    if untrusted:
        raise StudyExit(EXIT_BAD_INPUT, f"error: {untrusted}")
    try:  # no study.json (or a corrupt one): refused, never matched to a record by name
        stored = ident.read(study_dir, spec.name)
    except ident.StudyFileError as e:
        raise StudyExit(EXIT_BAD_INPUT, f"error: --resume: {e}") from None
    except store.StorageError as e:
        raise StudyExit(EXIT_BAD_INPUT, f"error: --storage: {e}") from None
    changed = ident.changed_fields(stored.spec, spec)  # the restored search holds the stored spec
    if changed:
        raise StudyExit(EXIT_BAD_INPUT, f"error: --resume: {args.space} differs from the spec study {spec.name!r} "
                   f"started with ({store.join(study_dir, ident.FILE)}) in: {', '.join(changed)}. A resume "
                   f"may change only {', '.join(ident.RESUMABLE_CHANGES)}; for anything else start a new "
                   "study (another name or --storage)")
    if store.is_uri(study_dir):  # a bucket's policy cannot be read with a study's credentials
        print(f"note: --resume trusts {store.redact(study_dir)}: whoever can write that bucket prefix runs code as "
              "you when it resumes (docs/records.md, Trusted storage)", file=sys.stderr, flush=True)
    return stored


def _check_lock_file(study_dir: str) -> None:
    """A driver.lock that is not one (study/experiment/lock.py reads a JSON object; an empty file is a driver
    killed mid-write, which it takes over) is refused: nothing can say whose it is."""
    import json

    from study.experiment.lock import FILE
    from trial import storage as store

    path = store.join(study_dir, FILE)
    try:
        raw = store.read_bytes(path)
        if raw and not isinstance(json.loads(raw.decode("utf-8")), dict):
            raise ValueError("not a JSON object")
    except store.StorageError as e:
        raise StudyExit(EXIT_BAD_INPUT, f"error: --storage: {e}") from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError: ValueErrors; nested deeply
        raise StudyExit(EXIT_BAD_INPUT, f"error: {store.redact(path)}: not a driver lock ({' '.join(str(e).split())[:120]}); "
                   "nothing was changed. If no driver runs this study, delete the file and run again") from None


def _checked_record(name: str, spec: StudySpec, study_dir: str, tracking_uri: str, stored) -> None:
    """The record the study would use, checked before Ray starts (the recorder's `check`): one that
    cannot be used (a deleted experiment) is refused here, not in a traceback once the cluster runs."""
    try:
        recorder_class(name).check(spec, study_dir, tracking_uri, stored)
    except RecordRefused as e:
        raise StudyExit(EXIT_BAD_INPUT, f"error: {name}: {e}") from None
    except Exception as e:  # a SQLite store on a full disk raises neither: say so, as a study does
        from trial import storage as store

        full = store.disk_full(study_dir, e)
        if not full:
            raise
        raise StudyExit(1, f"error: --storage: {full}. Study {spec.name!r} did not start. Free space, then run it again "
                      "(with --resume if it had started before)") from None


def _tracking_uri(args, storage: str, study_dir: str) -> str:
    """--mlflow-uri, else a SQLite file: in the storage folder, or beside the driver for a bucket
    (a SQLite store cannot live in a bucket; the artifacts go to the bucket)."""
    from trial import storage as store

    if store.is_uri(storage):
        local_db = os.path.abspath("studies")
        os.makedirs(local_db, exist_ok=True)
        return args.mlflow_uri or f"sqlite:///{local_db}/mlflow.db"
    os.makedirs(study_dir, exist_ok=True)
    return args.mlflow_uri or f"sqlite:///{storage}/mlflow.db"


def _run_locked(args, spec: StudySpec, study_dir: str, tracking_uri: str, address: str | None,
                concurrency: int | None, stored):
    """run_study under the study's driver lock, recording with the recorder `--recorder` names;
    returns its results and the recorder. Each way a study stops early becomes a StudyExit."""
    from study.experiment.lock import StudyLocked, driver_lock
    from study.experiment.tuning import Terminated, run_study
    from study.record import identity as ident
    from trial import storage as store

    try:
        with driver_lock(study_dir):
            if not args.resume and store.exists(store.join(study_dir, "tune")):
                # made by another driver since the check before the lock: never written over
                raise StudyExit(EXIT_BAD_INPUT, f"error: study {spec.name!r} already exists in {study_dir} (another "
                                "driver made it just now); pass --resume to continue it, or choose another "
                                "--storage or name")
            identity = stored if args.resume else ident.create(spec, study_dir)
            print("\n".join(plan_lines(spec, concurrency)), flush=True)
            record = recorder_class(args.recorder)(spec, tracking_uri, study_dir, identity)
            return run_study(spec, study_dir, record, address, concurrency, args.resume, args.verbose), record
    except StudyLocked as e:  # before anything of the study was touched
        raise StudyExit(EXIT_BAD_INPUT, f"error: {e}") from None
    except store.StorageError as e:  # the storage stopped answering (study/experiment/snapshots.py): stopped, resumable
        then = "there is room" if isinstance(e, store.StorageFull) else "the storage answers"
        raise StudyExit(1, f"error: --storage: {e}. Study {spec.name!r} stopped: the trials it finished are kept, the "
                      f"others continue from their last checkpoint; continue it with --resume once {then}") from None
    except KeyboardInterrupt as e:  # the study's MLflow run is KILLED and nothing was reported
        raise StudyExit(EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED) from None
    except Exception as e:  # a full disk surfaces anywhere (Tune, DeepSpeed, MLflow): say so, not how
        full = store.disk_full(study_dir, e)
        if not full:
            raise
        raise StudyExit(1, f"error: --storage: {full}. Study {spec.name!r} stopped; what other studies recorded there "
                      "is untouched. Free space, then continue it with --resume") from None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before the study started: nothing to record
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
