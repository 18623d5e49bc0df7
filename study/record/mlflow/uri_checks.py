"""`--mlflow-uri` checked before any work (the MLflow recorder's `check_flags`): a tracking server
that answers, a SQLite database whose folder can be made and whose path reads the same as URI text,
no credential in the URI; and a SQLite record on a cluster's head node, warned of (it goes away with
the node). Each rule and why: docs/records.md, "Flags checked before any work"."""

from __future__ import annotations

import os

from study.spec.preflight import CONNECT_TIMEOUT_S, check_local_folder, credentials_problem, uri_text_problem
from trial import storage as store

HTTP_TIMEOUT_S = 20.0  # a tracking server's answer to one REST call: a busy server's first query can take seconds


def check_flags(uri: str | None, storage: str, network: bool) -> str | None:
    """`--mlflow-uri` (None: the default SQLite record, beside the storage folder or in ./studies) and
    the folders that record writes, as `<flag>: <what is wrong>`; `network`: ask a tracking server."""
    if uri is not None:
        problem = check_mlflow_uri(uri, network)
    elif store.is_uri(store.absolute(storage)):  # the default SQLite store beside the driver
        problem = check_local_folder("--mlflow-uri (default ./studies/mlflow.db)", os.path.abspath("studies"))
    else:
        problem = None
    return problem or check_record_paths(storage, uri)


def check_mlflow_uri(uri: str, network: bool = True) -> str | None:
    scheme = uri.partition(":")[0].lower()
    problem = credentials_problem("--mlflow-uri", uri, "MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME / "
                                                       "MLFLOW_TRACKING_PASSWORD (a database: PGPASSWORD, "
                                                       "~/.pgpass or an option file)")
    if problem:
        return problem
    if scheme == "sqlite":
        path = sqlite_database(uri) if ":///" in uri else None
        if not path or path == ":memory:":
            return f"--mlflow-uri: {store.redact(uri)}: expected sqlite:///path/to/mlflow.db"
        written = os.path.dirname(os.path.abspath(uri.partition(":///")[2]))
        if written != os.path.dirname(os.path.abspath(path)):
            return (f"--mlflow-uri: {store.redact(uri)}: {uri_text_problem(written)}; give a database path "
                    "without %-escapes or '?'")
        path = os.path.abspath(path)
        if os.path.isdir(path):
            return f"--mlflow-uri: {store.redact(uri)}: {path} is a folder, not a database file"
        return check_local_folder("--mlflow-uri", os.path.dirname(path), store.redact(uri))
    if scheme in ("http", "https"):
        return check_tracking_server(uri) if network else None
    if scheme == "databricks":  # `databricks` or `databricks://profile`: MLflow's own scheme, not a path
        return None
    if ("://" not in uri or scheme == "file") and \
            os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        return (f"--mlflow-uri: {store.redact(uri)}: MLflow 3 refuses a file store (unless MLFLOW_ALLOW_FILE_STORE=true); "
                "give a database, e.g. sqlite:///path/to/mlflow.db, or a tracking server")
    return None


def sqlite_database(uri: str) -> str | None:
    """The database file a sqlite: URI names, as SQLAlchemy reads it (MLflow opens it through
    SQLAlchemy): %-escapes decoded, a `?` starting the query."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(uri).database
    except ArgumentError:
        return None


def check_record_paths(storage: str, mlflow_uri: str | None) -> str | None:
    """A study recorded to SQLite (the default, or --mlflow-uri sqlite:...) keeps its MLflow artifacts in
    its storage folder, and by default its database too: their paths must read the same as URI text."""
    local = None if store.is_uri(store.absolute(storage)) else store.absolute(storage)
    if mlflow_uri is None:  # the database: in the storage folder, or ./studies for a bucket
        folder = local or os.path.abspath("studies")
        flag = "--storage" if local else "--mlflow-uri (default ./studies/mlflow.db)"
        why = uri_text_problem(folder)
    elif local and mlflow_uri.lower().startswith("sqlite:"):  # the artifacts: <storage>/mlartifacts/<name>
        folder, flag = local, "--storage"
        why = uri_text_problem(folder.replace("?", ""))  # '?' is fine in an artifact location
    else:
        return None
    if why:
        return (f"{flag}: {why} (where the study's MLflow record goes); rename the folder, or record to a "
                "tracking server (--mlflow-uri http://...)")
    return None


def check_tracking_server(uri: str) -> str | None:
    """One REST call (search one experiment) with a short timeout and no retries."""
    import requests

    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search"
    headers, auth = {}, None
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
    elif os.environ.get("MLFLOW_TRACKING_USERNAME"):
        auth = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ.get("MLFLOW_TRACKING_PASSWORD", ""))
    verify = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or \
        os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() not in ("true", "1")
    try:
        answer = requests.get(url, params={"max_results": 1}, headers=headers, auth=auth, verify=verify,
                              timeout=(CONNECT_TIMEOUT_S, HTTP_TIMEOUT_S))  # no host: 3 s; a slow one: 20
    except requests.RequestException as e:
        reason = type(e).__name__
        if isinstance(e, requests.ConnectionError) and "refused" in str(e).lower():
            reason = "connection refused"
        elif isinstance(e, requests.Timeout):
            reason = f"no connection within {CONNECT_TIMEOUT_S:g} s" if isinstance(
                e, requests.ConnectTimeout) else f"no answer within {HTTP_TIMEOUT_S:g} s"
        return f"--mlflow-uri: {store.redact(uri)}: no MLflow tracking server answers there ({reason})"
    if answer.status_code in (401, 403):
        return (f"--mlflow-uri: {store.redact(uri)}: the tracking server refused us (HTTP {answer.status_code}); set "
                "MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD")
    if answer.status_code != 200:
        return (f"--mlflow-uri: {store.redact(uri)}: not an MLflow tracking server (HTTP {answer.status_code} from "
                "/api/2.0/mlflow/experiments/search)")
    return None


# --- a record that outlives the cluster -------------------------------------------------------------
def ephemeral_record(uri: str | None, address: str | None, storage: str) -> str | None:
    """Why the study's MLflow record will not outlive the cluster it runs on, or None. `address` is
    run.py's (None: the embedded Ray, where the record stays on this machine with its user). On a
    cluster (`ray job submit` sets RAY_ADDRESS, or `--address`) the driver runs on the head node, and
    a SQLite record, the default included, is a file there: the runs, params and metrics go away with
    the node (`ray down`, a replaced head), even where the artifacts are in a bucket."""
    if address is None:
        return None
    if uri is None:  # run.py's default: beside the driver; for a bucket, in ./studies
        folder = os.path.abspath("studies") if store.is_uri(storage) else storage
        given = f"by default sqlite:///{os.path.join(folder, 'mlflow.db')}"
    elif uri.lower().startswith("sqlite:"):
        given = uri
    else:
        return None  # a tracking server or a database of its own, which can outlive the cluster
    return (f"--mlflow-uri: the study's MLflow record is a SQLite file beside the driver ({given}); on a "
            "cluster that is the head node, and the record goes away with it (unless that path is on a "
            "filesystem that outlives the node). Point --mlflow-uri at a tracking server that outlives the "
            "cluster: `mlflow server --backend-store-uri postgresql+psycopg2://mlflow@DB-HOST:5432/mlflow "
            "--artifacts-destination s3://YOUR-BUCKET/mlflow` on a VM of its own or with a managed "
            "PostgreSQL, then --mlflow-uri http://MLFLOW-HOST:5000 (docs/cluster.md)")
