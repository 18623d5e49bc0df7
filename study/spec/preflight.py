"""Checks of `study/run.py`'s flags and environment, before any work: each problem is one message
naming the flag (run.py prints `error: <message>` and exits 2), never a traceback, and nothing is
left behind (a probe folder made to test that a folder is writable is removed again).

What is checked: `--storage` (a folder this user can write whose path reads the same as URI text, or
a bucket URI with no credentials or query whose store offers a conditional write), `--address` /
RAY_ADDRESS (`local` in any spelling, or something that accepts a TCP connection before Ray
starts), `--cluster` (a YAML mapping of node types), and YAML aliases (bounded by
MAX_YAML_EXPANSION). Where the record goes (`--mlflow-uri`) is its recorder's check (`check_flags`). Each rule and why: docs/records.md,
"Flags checked before any work". Nothing here imports Ray for the embedded case (its loopback
switch must be set before that import).
"""

from __future__ import annotations

import math
import os
import re
import socket
import tempfile
from urllib.parse import unquote, urlsplit

from trial import storage as store
from trial.yaml_io import InputFileError, load_yaml_text, read_config_file

CONNECT_TIMEOUT_S = 3.0  # a TCP connect to the Ray cluster's GCS / client server
LOCAL_SPELLINGS = {"local", ""}  # Ray's own `address="local"`; RAY_ADDRESS="" is no address
ENV_HINT = {
    "s3": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment, a profile, or the nodes' instance role",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS or the nodes' service account",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS or the nodes' service account",
}


# --- YAML ------------------------------------------------------------------------------------------
def load_yaml_mapping(path: str, flag: str) -> tuple[dict | None, str | None]:
    """(the mapping, None) or (None, an error naming `flag`) for a YAML file given on the command line,
    read once with the config loader's checks (trial/yaml_io.py: a FIFO is refused before it is opened)."""
    try:
        raw = read_config_file(path)
        data = load_yaml_text(raw.decode("utf-8", errors="replace"), path)
    except OSError as e:
        return None, f"{flag}: {path}: {e.strerror or e}"
    except InputFileError as e:  # it starts with the file (and its line and column)
        return None, f"{flag}: {e}"
    if not isinstance(data, dict):
        what = "nothing" if data is None else f"a {type(data).__name__}"
        return None, f"{flag}: {path} holds {what}, not a YAML mapping"
    return data, None


def check_cluster_yaml(path: str) -> str | None:
    """A cluster-launcher YAML that `--dry-run --cluster` can read node types from."""
    data, problem = load_yaml_mapping(path, "--cluster")
    if problem:
        return problem
    types = data.get("available_node_types")
    if not isinstance(types, dict) or not types:
        return f"--cluster: {path}: available_node_types must be a mapping of node types (got {type(types).__name__})"
    for name, node in types.items():
        where = f"--cluster: {path}: available_node_types.{name}"
        if not isinstance(node, dict):
            return f"{where}: a node type is a mapping, not {type(node).__name__}"
        resources = node.get("resources", {})
        if not isinstance(resources, dict):
            return f"{where}.resources: a mapping of resource -> amount, not {type(resources).__name__}"
        for key, amount in resources.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) \
                    or amount < 0:
                return f"{where}.resources.{key}: {amount!r} is not a non-negative number"
        workers = node.get("max_workers", 0)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            return f"{where}.max_workers: {workers!r} is not a non-negative integer"
    return None


# --- URIs ------------------------------------------------------------------------------------------
# the schemes of MLflow's database stores (mlflow.store.db.db_types.DATABASE_ENGINES), with a driver
# or not (`postgresql+psycopg2`): the only URIs whose user part may hold a user name (no password)
DATABASE_SCHEMES = ("postgresql", "mysql", "sqlite", "mssql")


def credentials_problem(flag: str, uri: str, hint: str) -> str | None:
    """A URI that carries a credential is refused: a password, or any user part but a database's
    user name (a bucket's is an access key, `http://TOKEN@host` a token), or a secret in its query or
    fragment (`?password=`, `#access_token=`, `?jwt=`, `?odbc_connect=...PWD%3D...`): it would be
    printed, logged and stored in every trial's config and Tune's state. The message never repeats it."""
    info, keys = store.userinfo(uri), store.secret_keys(uri)
    if keys:
        return (f"{flag}: {store.redact(uri)}: a secret in the URI ({', '.join(keys)}) is refused (it would be "
                f"echoed in messages and stored in every trial's config); remove it and use {hint}")
    if info is None:
        return None
    if ":" not in info and uri.partition(":")[0].partition("+")[0].lower() in DATABASE_SCHEMES:
        return None  # a database's user name alone (`postgresql://study@db/mlflow`) is no secret
    return (f"{flag}: {store.redact(uri)}: credentials in the URI are refused (they would be echoed in "
            f"messages and stored in every trial's config); remove them and use {hint}")


def check_storage(storage: str) -> str | None:
    if store.is_uri(storage):
        scheme = storage.partition("://")[0].lower()
        problem = credentials_problem("--storage", storage, ENV_HINT.get(scheme, "the store's own environment "
                                                                               "variables or the nodes' role"))
        if problem:
            return problem
        parts = urlsplit(storage)
        if scheme == "file":
            if store.local_path_of(storage) is None:
                return (f"--storage: {store.redact(storage)}: a file: URI names a path on this machine "
                        "(file:///absolute/path), with no host, query or fragment")
        elif parts.query or parts.fragment or "?" in storage or "#" in storage:
            return (f"--storage: {store.redact(storage)}: a query string or fragment is not supported (the study's "
                    "folders are joined to the path); give the region or endpoint through the environment "
                    "(AWS_REGION, AWS_ENDPOINT_URL) instead")
        elif not parts.netloc:
            return f"--storage: {store.redact(storage)}: no bucket (expected {scheme}://bucket/prefix)"
        elif store.unlockable(storage):
            return f"--storage: {store.redact(storage)}: {store.unlockable(storage)}"
        else:
            return None  # reachability: study/run.py's probe object (store.check_writable)
    return check_local_folder("--storage", store.absolute(storage))


def check_local_folder(flag: str, folder: str, given: str | None = None) -> str | None:
    """`folder` is a folder this process can write, or can be created: its nearest existing
    ancestor is a folder in which a probe folder can be made (and is removed at once). `given`: what
    the user wrote, when the folder is only part of it (a database file's folder)."""
    flag = f"{flag}: {given}" if given else flag
    nearest = folder
    while not os.path.lexists(nearest):
        parent = os.path.dirname(nearest)
        if parent == nearest:
            break
        nearest = parent
    if not os.path.isdir(nearest):
        what = "a file" if os.path.isfile(nearest) else "not a folder"
        return (f"{flag}: {folder}: {nearest} is {what}" if nearest != folder
                else f"{flag}: {folder} is {what}, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".preflight-", dir=nearest))
    except OSError as e:
        verb = "write in" if nearest == folder else "create folders in"
        return f"{flag}: {folder}: cannot {verb} {nearest}: {e.strerror or e}"
    return None


def uri_text_problem(folder: str) -> str | None:
    """Why a folder's path cannot be written into a sqlite: URI or a local MLflow artifact location as
    it is: MLflow creates the database's folder from the URI's text as written but opens the database
    where SQLAlchemy's reading of it says (a %-escape decoded, `?` starting a query), and it decodes
    %-escapes in a local artifact location. Escaping them would not help: the folder MLflow creates
    would then be the escaped text, beside the one meant. None if the path can be written as it is."""
    escape = re.search(r"%[0-9A-Fa-f]{2}", folder)
    if escape:
        return (f"{escape[0]!r} in the path reads as {unquote(escape[0])!r} in a URI, and MLflow would write "
                f"outside {folder}")
    if "?" in folder:
        return f"'?' in the path starts a URI's query, and MLflow would write outside {folder}"
    return None


# --- Ray ------------------------------------------------------------------------------------------
def is_local(address: str | None) -> bool:
    """Whether an --address / RAY_ADDRESS value asks for a Ray of our own (`local`, any case or
    padding, quoted; empty; none)."""
    return address is None or address.strip().strip("'\"").strip().lower() in LOCAL_SPELLINGS


def trials_run_here(flag_value: str | None) -> bool:
    """Whether a study's trials run on this machine (the embedded Ray: no cluster address), whose
    memory then bounds a trial's (study.spec.schema.load_spec)."""
    return is_local(flag_value if flag_value is not None else os.environ.get("RAY_ADDRESS"))


def ray_address(flag_value: str | None) -> str | None:
    """The Ray cluster to join (`--address`, else RAY_ADDRESS), or None for the embedded local Ray,
    which listens on 127.0.0.1 only. `local` in any spelling is None, and RAY_ADDRESS is then removed
    from this process's environment, so that nothing started from here reads it as a cluster."""
    value = flag_value if flag_value is not None else os.environ.get("RAY_ADDRESS")
    if is_local(value):
        if is_local(os.environ.get("RAY_ADDRESS")) or flag_value is not None:
            os.environ.pop("RAY_ADDRESS", None)
        return None
    return value.strip()


def check_address(flag_value: str | None, network: bool = True) -> str | None:
    """A cluster address must accept a TCP connection (GCS `host:port`, a client server `ray://host:port`,
    or `auto`: the last `ray start` on this machine) within CONNECT_TIMEOUT_S."""
    flag = "--address" if flag_value is not None else "RAY_ADDRESS"
    value = flag_value if flag_value is not None else os.environ.get("RAY_ADDRESS")
    if is_local(value):
        return None
    address = value.strip()
    problem = credentials_problem(flag, address, "the cluster's token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN)") \
        if store.is_uri(address) else None
    if problem or not network:
        return problem
    target = address
    if address.lower() == "auto":
        try:
            from study.ray_compat import ray_address_from_environment

            target = ray_address_from_environment()
        except Exception as e:  # noqa: BLE001 - Ray says why in its own words; no traceback for the user
            return f"{flag}: auto: no running Ray cluster found on this machine ({' '.join(str(e).split())[:200]})"
        if not target:
            return f"{flag}: auto: no running Ray cluster found on this machine"
    scheme, _, host_port = target.rpartition("://")
    if scheme and scheme.lower() != "ray":
        return f"{flag}: {store.redact(address)}: not a Ray address (host:port, ray://host:port, auto or local)"
    host, sep, port = host_port.rstrip("/").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{flag}: {store.redact(address)}: not a Ray address (host:port, ray://host:port, auto or local)"
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        reason = f"no answer within {CONNECT_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) \
            else (e.strerror or str(e)).lower()
        return f"{flag}: {store.redact(address)}: no Ray cluster answers at {host}:{port} ({reason})"
    return None


# --- all of study/run.py's flags -----------------------------------------------------------------
def _utf8(value: str) -> bool:
    """Whether a command-line value is valid UTF-8 (Python keeps undecodable bytes as surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_flags(args) -> str | None:
    """The first problem with run.py's flags and environment, as `<flag>: <what is wrong>`, or None.
    `--dry-run` checks everything but the network (a tracking server, a cluster's address)."""
    network = not args.dry_run
    for flag, value in (("--storage", args.storage), ("--space", args.space), ("--cluster", args.cluster),
                        ("--mlflow-uri", getattr(args, "mlflow_uri", None))):
        if value is not None and not _utf8(value):  # pyarrow, MLflow and the record would fail on it mid-study
            return f"{flag}: not valid UTF-8 ({ascii(value)[:80]}); rename it"
    if args.cluster is not None:
        problem = check_cluster_yaml(args.cluster)
        if problem:
            return problem
    problem = check_storage(args.storage)
    if problem:
        return problem
    return check_address(args.address, network)  # where the record goes: its recorder's check_flags
