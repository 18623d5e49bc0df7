"""Credentials in a URI are refused wherever they are (but a database's user name), and a URI is
printed or stored only masked; the driver lock of a bucket study is taken with the store's own
conditional write, or refused where the store offers none. Real S3 API (moto's server on 127.0.0.1);
GCS cannot exist here: its client is replaced by an in-memory one with its generation preconditions
(google-cloud-storage's calls and google-api-core's real exceptions), and the tests say so."""

from __future__ import annotations

import json
import pickle
import sys
import types

import pytest
from test_record_identity import SMOKE, no_study_starts, refused  # noqa: F401 (a fixture)

from study import run as run_cli
from study.record.mlflow.uri_checks import check_mlflow_uri
from study.spec.preflight import credentials_problem
from trial import storage as store

SECRET = "tok3n-s3cret-v4lue"


# --- secrets in a URI -------------------------------------------------------------------------------------
REFUSED = [
    ("--mlflow-uri", f"http://127.0.0.1:1/?jwt={SECRET}"),
    ("--mlflow-uri", f"https://mlflow.example.com/?bearer={SECRET}"),
    ("--mlflow-uri", f"https://mlflow.example.com/?token={SECRET}"),
    ("--mlflow-uri", f"https://mlflow.example.com/?access_token={SECRET}"),
    ("--mlflow-uri", f"https://mlflow.example.com/?session_id={SECRET}"),
    ("--mlflow-uri", f"http://{SECRET}@127.0.0.1:1"),  # a token as the user name alone
    ("--mlflow-uri", f"https://{SECRET}@mlflow.example.com/"),
    ("--mlflow-uri", "mssql+pyodbc:///?odbc_connect=DRIVER%3D%7BODBC+Driver+18%7D%3BSERVER%3Ddb%3BUID%3Dml%3B"
                     f"PWD%3D{SECRET}"),
    ("--mlflow-uri", f"mssql+pyodbc:///?odbc_connect=DRIVER={{x}};Server=db;Pwd={SECRET}"),
    ("--address", f"ray://{SECRET}@127.0.0.1:10001"),
    ("--storage", f"s3://{SECRET}@bucket/studies"),
    ("--mlflow-uri", f"postgresql+psycopg2://mlflow@db/mlflow?password={SECRET}"),
    ("--mlflow-uri", f"postgresql://mlflow@db/mlflow?sslmode=require&sslpassword={SECRET}"),
    ("--mlflow-uri", f"mysql://mlflow@db/mlflow?passwd={SECRET}"),
    ("--mlflow-uri", f"http://127.0.0.1:1/?token={SECRET}"),
    ("--mlflow-uri", f"https://mlflow.example.com/#access_token={SECRET}"),
    ("--storage", f"s3://bucket/studies?secret_key={SECRET}"),
    ("--storage", f"gs://bucket/studies#access_token={SECRET}"),
    ("--storage", f"file:///tmp/studies?password={SECRET}"),
    ("--storage", f"s3://bucket/studies?X-Amz-Signature={SECRET}&X-Amz-Credential=AKIA"),
]


@pytest.mark.parametrize("flag,uri", REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_a_credential_anywhere_in_a_uri_is_refused_and_never_echoed(flag, uri, tmp_path, capsys, monkeypatch,
                                                                    no_study_starts):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    argv = [flag, uri] if flag == "--storage" else [flag, uri, "--storage", str(tmp_path / "studies")]
    line = refused(argv, capsys, flag)
    assert "in the URI" in line and SECRET not in line  # refused for it, not for a server not answering
    assert not (tmp_path / "studies").exists()


def test_a_database_user_name_alone_is_still_accepted():
    for uri in ("postgresql://mlflow@db/mlflow", "postgresql+psycopg2://mlflow@db:5432/mlflow?sslmode=require",
                "mysql://mlflow@db/mlflow"):
        assert credentials_problem("--mlflow-uri", uri, "env") is None, uri
    assert credentials_problem("--mlflow-uri", "postgresql://mlflow:pw@db/mlflow", "env")


def test_what_follows_a_uris_host_is_printed_masked():
    """What no rule recognises as a secret (`?k=...`) is masked all the same where a URI has a host;
    the path stays (a bucket's is where the study lives); a local URI keeps what is no secret."""
    assert store.redact(f"https://mlflow.example.com/api?k={SECRET}&region=x#frag={SECRET}") == \
        "https://mlflow.example.com/api?k=***&region=***#frag=***"
    assert store.redact(f"postgresql://ml:{SECRET}@db/mlflow?sslmode=require") == "postgresql://***@db/mlflow?sslmode=***"
    assert store.redact("s3://bucket/studies/smoke") == "s3://bucket/studies/smoke"
    assert store.redact("sqlite:////tmp/x/mlflow.db?timeout=30") == "sqlite:////tmp/x/mlflow.db?timeout=30"
    assert store.redact(f"mssql+pyodbc:///?odbc_connect=PWD%3D{SECRET}") == "mssql+pyodbc:///?odbc_connect=***"


def test_redact_hides_secrets_in_the_query_and_fragment_and_keeps_the_rest():
    from trial import storage as store

    assert store.redact(f"postgresql://u:{SECRET}@db/m?sslmode=require&password={SECRET}#token={SECRET}") == \
        "postgresql://***@db/m?sslmode=***&password=***#token=***"
    assert store.redact("s3://bucket/p?region=us-east-1") == "s3://bucket/p?region=***"  # a host's: all masked
    assert store.redact("/a/local/path?password=x") == "/a/local/path?password=x"  # a folder's name


def test_a_uri_with_harmless_options_and_a_user_name_is_accepted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = run_cli.main(["--space", SMOKE, "--storage", str(tmp_path / "studies"), "--dry-run",
                         "--mlflow-uri", "postgresql://mlflow@db/mlflow?sslmode=require&connect_timeout=5"])
    assert code == 0, capsys.readouterr().err


def test_an_unreachable_server_is_named_masked(capsys):
    problem = check_mlflow_uri("http://127.0.0.1:1/mlflow?workspace=team-a", network=True)
    assert problem.startswith("--mlflow-uri: http://127.0.0.1:1/mlflow?workspace=***: no MLflow tracking server")


def test_the_tracker_is_stored_without_the_uri_as_given(tmp_path):
    """Tune pickles its callbacks with the experiment (tuner.pkl, in the study's storage); a resume
    replaces the restored tracker with its own."""
    from test_record_identity import tracker

    made = tracker(tmp_path, str(tmp_path / "study"), str(tmp_path / "artifacts"))
    made.tracking_uri = f"https://mlflow.example.com/?workspace={SECRET}"  # as if given so
    stored = pickle.dumps(made)
    assert SECRET.encode() not in stored
    restored = pickle.loads(stored)
    assert restored.tracking_uri == "https://mlflow.example.com/?workspace=***" and restored.client is None


# --- S3: a store that ignores conditional writes -------------------------------------------------------------
def _drop_conditions(request, **kwargs):
    """What an S3-compatible store that ignores conditional headers does: it never sees them."""
    for header in ("If-None-Match", "If-Match"):
        request.headers.pop(header, None)


def test_moto_honours_if_none_match(s3):
    from botocore.exceptions import ClientError

    s3["client"].put_object(Bucket="studies", Key="honours/k", Body=b"1")
    with pytest.raises(ClientError, match="PreconditionFailed"):
        s3["client"].put_object(Bucket="studies", Key="honours/k", Body=b"2", IfNoneMatch="*")


def test_a_store_that_ignores_conditional_writes_is_refused_the_lock(s3, monkeypatch):
    """Without the check, both drivers' `If-None-Match: *` puts succeed there: the second overwrites
    the first's lock, both run the study (docs/records.md)."""
    import boto3

    from study.experiment.lock import StudyLocked, driver_lock

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    boto3.setup_default_session()
    boto3.DEFAULT_SESSION.events.register("before-send.s3.PutObject", _drop_conditions)
    first = boto3.client("s3")
    first.put_object(Bucket="studies", Key="ignores/smoke/driver.lock", Body=b"{}", IfNoneMatch="*")
    first.put_object(Bucket="studies", Key="ignores/smoke/driver.lock", Body=b"{}", IfNoneMatch="*")  # taken twice
    first.delete_object(Bucket="studies", Key="ignores/smoke/driver.lock")
    with pytest.raises(StudyLocked, match="ignores conditional writes"):
        with driver_lock("s3://studies/ignores/smoke"):
            pytest.fail("took a lock the store cannot make atomic")
    keys = s3["client"].list_objects_v2(Bucket="studies", Prefix="ignores/").get("Contents", [])
    assert keys == []  # the probe is gone, no lock left


def test_a_store_that_honours_them_still_gives_the_lock(s3):
    from study.experiment.lock import StudyLocked, driver_lock

    with driver_lock("s3://studies/honours/smoke"):
        with pytest.raises(StudyLocked, match="is being run by"):
            with driver_lock("s3://studies/honours/smoke"):
                pytest.fail("two drivers")
    assert s3["client"].list_objects_v2(Bucket="studies", Prefix="honours/smoke").get("Contents") is None


def test_a_bucket_gone_when_the_study_ends_leaves_its_lock_with_a_warning_not_a_traceback(s3, monkeypatch, capsys):
    """The study's work is done and written; a bucket that stops answering right then (a refused
    connection, not an S3 error) leaves the lock for the next run to take over."""
    from study.experiment.lock import driver_lock
    from tests.support.postgres import free_port

    with driver_lock("s3://studies/ending/smoke"):
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert "driver.lock is left in place" in capsys.readouterr().err
    assert [o["Key"] for o in s3["client"].list_objects_v2(Bucket="studies", Prefix="ending/")["Contents"]] == [
        "ending/smoke/driver.lock"]


# --- GCS: generation preconditions ------------------------------------------------------------------------
class FakeGcs:
    """google.cloud.storage's Client as the lock uses it, over an in-memory bucket with GCS's rules:
    a write or delete under `if_generation_match=G` happens only if the object's generation is G (0: no
    object), else PreconditionFailed (HTTP 412); each write makes a new generation. GCS itself cannot
    exist here; google-api-core's exceptions are the real ones."""

    objects: dict[str, tuple[bytes, int]] = {}
    generations = 0

    class Blob:
        def __init__(self, key):
            self.key, self.generation = key, None

        def _check(self, match):
            from google.api_core.exceptions import PreconditionFailed

            have = FakeGcs.objects.get(self.key, (None, 0))[1]
            if match is not None and have != match:
                raise PreconditionFailed(f"412 {self.key}: generation {have}, not {match}")

        def upload_from_string(self, data, if_generation_match=None):
            self._check(if_generation_match)
            FakeGcs.generations += 1
            FakeGcs.objects[self.key] = (bytes(data), FakeGcs.generations)

        def reload(self):
            from google.api_core.exceptions import NotFound

            if self.key not in FakeGcs.objects:
                raise NotFound(f"404 {self.key}")
            self.generation = FakeGcs.objects[self.key][1]

        def download_as_bytes(self, if_generation_match=None):
            self._check(if_generation_match)
            return FakeGcs.objects[self.key][0]

        def delete(self, if_generation_match=None):
            from google.api_core.exceptions import NotFound

            if self.key not in FakeGcs.objects:
                raise NotFound(f"404 {self.key}")
            self._check(if_generation_match)
            del FakeGcs.objects[self.key]

    class Client:
        def bucket(self, name):
            return types.SimpleNamespace(blob=lambda key: FakeGcs.Blob(f"{name}/{key}"))


@pytest.fixture
def gcs(monkeypatch):
    module = types.ModuleType("google.cloud.storage")
    module.Client = FakeGcs.Client
    monkeypatch.setitem(sys.modules, "google.cloud.storage", module)
    import google.cloud

    monkeypatch.setattr(google.cloud, "storage", module, raising=False)
    FakeGcs.objects = {}
    return FakeGcs


def test_a_gcs_lock_is_created_and_taken_over_once(gcs):
    from study.experiment import lock

    path = "gs://bucket/studies/smoke/driver.lock"
    assert lock.put_version(path, b"first", None)
    assert not lock.put_version(path, b"second", None)  # two drivers started together: one lock
    raw, generation = lock.read_version(path)
    assert raw == b"first"
    assert lock.put_version(path, b"taker", generation)  # a stale lock taken over exactly once
    assert not lock.put_version(path, b"other taker", generation)
    assert lock.read_version(path)[0] == b"taker"
    lock.remove_version(path, generation)  # a release by the driver whose lock was taken over: not deleted
    assert lock.read_version(path)[0] == b"taker"


def test_a_gcs_driver_lock_refuses_a_second_driver(gcs):
    from study.experiment.lock import StudyLocked, driver_lock

    with driver_lock("gs://bucket/studies/smoke"):
        holder = json.loads(gcs.objects["bucket/studies/smoke/driver.lock"][0])
        with pytest.raises(StudyLocked, match=f"pid {holder['pid']}"):
            with driver_lock("gs://bucket/studies/smoke"):
                pytest.fail("two drivers")
    assert gcs.objects == {}


def test_gs_storage_without_its_client_or_another_store_is_refused_before_anything(tmp_path, capsys, monkeypatch,
                                                                                 no_study_starts):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)  # not installed (as here)
    line = refused(["--storage", "gs://bucket/studies", "--dry-run"], capsys, "--storage: gs://bucket/studies")
    assert "google-cloud-storage" in line
    line = refused(["--storage", "hdfs://namenode/studies", "--dry-run"], capsys, "--storage: hdfs://namenode/studies")
    assert "no conditional write" in line
