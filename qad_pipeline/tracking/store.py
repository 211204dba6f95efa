"""Where runs are logged: the tracking store's URI, a fail-fast reachability check, the client,
and the names this package gives experiments, registered models and tags."""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from qad_pipeline.core.config import ConfigError
from qad_pipeline.core.redaction import redact_text

if TYPE_CHECKING:  # mlflow is imported where it is used: importing it takes seconds
    from mlflow import MlflowClient

EXPERIMENT_PREFIX = "qad-pipeline/"
MODEL_SUFFIX = "-nvfp4"
MLFLOW_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"  # the cheapest read of MLflow's REST API
DEFAULT_DB_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433}
DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]", "pymysql": "PyMySQL"}

# MLflow 3's UI opens an experiment on the GenAI "Overview" (traces) unless its tag
# mlflow.experimentKind says "custom_model_development" (the UI's "Machine learning": the runs
# table); the key and values are the UI's (mlflow/server/js: ExperimentKind), MLflow's Python API has
# no constant for them.
EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_DEVELOPMENT = "custom_model_development"

# tags this package sets
KIND = "qad.kind"  # "pipeline" or "sweep" (parents), "stage" (child)
STAGE = "qad.stage"
RECIPE = "qad.recipe"
HOST = "qad.host"
PID = "qad.pid"
PID_STARTED = "qad.pid_started"
LOGGED_AT = "qad.logged_at"  # epoch ms, zero-padded: sorts as text
ERROR = "error"
PARENT = "mlflow.parentRunId"
GIT_COMMIT = "mlflow.source.git.commit"
NOTE = "mlflow.note.content"
FLOW_RUN_ID = "prefect.flow_run_id"
COMPLETE = "qad.complete"  # set last on a child run: everything it holds is logged
STALE = "qad.stale"  # why mark_stale_runs ended a run
LOGGING_ERROR = "qad.logging_error"  # why logging a run failed part-way (the run ended FAILED)


def git_commit() -> str | None:
    """The project's current git commit (with "-dirty" when it has uncommitted changes), if any.

    Not MLflow's git context: that reads the repository of the entry script (`sys.argv[0]`) and
    never says "-dirty". Without a repository (the image has no `.git`): `$QAD_GIT_COMMIT`, which
    the image sets from its `GIT_COMMIT` build argument (`unknown`: none).
    """
    import subprocess

    from qad_pipeline.core.config import project_root

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=project_root(), capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        built = os.environ.get("QAD_GIT_COMMIT", "").strip()
        return built if built and built != "unknown" else None


def tracking_uri(root: Path) -> str:
    """`MLFLOW_TRACKING_URI` if set, else a SQLite file in the output root (no server to start)."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    return f"sqlite:///{(Path(root).resolve() / 'mlflow.db').as_posix()}"


def _check_db_driver(uri: str, shown: str) -> None:
    """The database driver that SQLAlchemy would load for `uri` is importable (`postgresql://`
    means psycopg 3 from SQLAlchemy 2.1 on, psycopg2 before; `postgresql+psycopg2://` names it)."""
    try:
        from sqlalchemy.engine import make_url

        dialect = make_url(uri).get_dialect()
    except Exception:  # noqa: BLE001 (a URI SQLAlchemy cannot parse: MLflow will say why)
        return
    try:
        dialect.import_dbapi()
    except ImportError as err:
        module = getattr(err, "name", None) or str(err)
        raise ConfigError(
            f"MLflow tracking store {shown} needs the Python package {DRIVER_PACKAGES.get(module, module)!r} "
            f"(module {module!r}), which is not installed"
        ) from None


def check_reachable(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast, with one `ConfigError` naming the URI, when the tracking store cannot be reached.

    http(s): the server must answer MLflow's REST API (`GET /api/2.0/mlflow/experiments/search`) with
    a JSON object within `timeout_s`. The request is MLflow's client's own (`_probe_server`): it sends
    the credentials and TLS settings the client will send, so an authenticating server (`mlflow server
    --app-name basic-auth`, a proxy) that answers 401/403 refuses them, or asks for some; any other
    answer (a 404 from some other web server) is refused too.
    postgresql/mysql/mssql: the database driver must be importable and the host's port must
    accept a TCP connection. sqlite: the database file's folder must exist or be creatable.
    Other schemes (file, databricks, plugins) are not checked.
    """
    shown = redact_text(uri)
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme.lower()
    base = scheme.split("+", 1)[0]
    hint = "start it, or unset MLFLOW_TRACKING_URI to log into sqlite:///<out-root>/mlflow.db"
    if scheme in ("http", "https"):
        _probe_server(uri, shown, timeout_s, hint)
        return
    if base in DEFAULT_DB_PORTS:
        _check_db_driver(uri, shown)
        if parsed.hostname:
            port = parsed.port or DEFAULT_DB_PORTS[base]
            try:
                socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
            except OSError as err:
                raise ConfigError(
                    f"MLflow tracking database {shown} cannot be reached at {parsed.hostname}:{port} ({err}); {hint}"
                ) from None
        return
    if scheme == "sqlite":
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if path and path != ":memory:":
            folder = Path(path).parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"MLflow tracking database {shown}: cannot create {folder} ({err})") from None


def _credentials(creds) -> str:
    """What MLflow's client authenticates with (never the password or token itself); '' for nothing."""
    if creds.username and creds.password:
        return f"the user {creds.username!r} (MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD)"
    if creds.token:
        return "MLFLOW_TRACKING_TOKEN"
    if creds.auth:
        return f"the auth provider {creds.auth!r} (MLFLOW_TRACKING_AUTH)"
    if creds.aws_sigv4:
        return "AWS SigV4 signing (MLFLOW_TRACKING_AWS_SIGV4)"
    return ""


def _probe_server(uri: str, shown: str, timeout_s: float, hint: str) -> None:
    """GET MLFLOW_PROBE once (no retries), with MLflow's `http_request` and the host credentials its
    client reads (`MLFLOW_TRACKING_USERNAME`/`_PASSWORD`, `_TOKEN`, `~/.mlflow/credentials`, an auth
    plugin, `MLFLOW_TRACKING_INSECURE_TLS`, `MLFLOW_TRACKING_SERVER_CERT_PATH`, ...)."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    creds = get_default_host_creds(uri)
    try:
        answer = http_request(creds, MLFLOW_PROBE, "GET", max_retries=0, timeout=timeout_s, raise_on_status=False)
    except MlflowException as err:  # the request failed: say why in one line (the innermost cause)
        cause: BaseException = err
        while cause.__cause__ or cause.__context__:
            cause = cause.__cause__ or cause.__context__
        raise ConfigError(f"MLflow tracking server {shown} cannot be reached ({redact_text(str(cause))}) "
                          f"within {timeout_s:g}s; {hint}") from None
    probe = f"HTTP {answer.status_code} on GET {MLFLOW_PROBE}"
    if answer.status_code in (401, 403):
        sent = _credentials(creds)
        if sent:
            raise ConfigError(f"MLflow tracking server {shown} refuses {sent} ({probe}); check them")
        raise ConfigError(f"MLflow tracking server {shown} asks for credentials ({probe}) and none are set: set "
                          "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (on Kubernetes: the Secret "
                          "qad-mlflow-auth, infra/README.md)")
    not_mlflow = (f"MLflow tracking server {shown} answers but is not an MLflow tracking server ({{}} on "
                  f"GET {MLFLOW_PROBE}); point MLFLOW_TRACKING_URI at an `mlflow server`, or unset it to log "
                  "into sqlite:///<out-root>/mlflow.db")
    if answer.status_code != 200:
        raise ConfigError(not_mlflow.format(f"HTTP {answer.status_code}"))
    try:
        answer_is_json_object = isinstance(json.loads(answer.content), dict)
    except ValueError:
        answer_is_json_object = False
    if not answer_is_json_object:
        raise ConfigError(not_mlflow.format("an answer that is not MLflow's JSON"))


def experiment_name(base_model_path: str) -> str:
    """The experiment of one base model: `qad-pipeline/<path or hub id>`."""
    return redact_text(EXPERIMENT_PREFIX + base_model_path.strip())


def registered_model_name(base_model_path: str) -> str:
    """The registered model of one base model's NVFP4 exports, e.g. `demo-model-nvfp4`.

    MLflow model names may not hold '/' or ':'; anything but letters, digits, '_', '-' and '.'
    becomes '-'.
    """
    stem = re.sub(r"[^A-Za-z0-9_.\-]+", "-", redact_text(base_model_path.strip())).strip("-.")
    return (stem or "model")[:200] + MODEL_SUFFIX


def client_for(uri: str) -> MlflowClient:
    """An MlflowClient on `uri` for both tracking and the model registry."""
    from mlflow import MlflowClient

    if uri.startswith("sqlite:"):
        check_reachable(uri)  # creates the database's folder
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def artifact_location(uri: str, root: Path) -> str | None:
    """Where a new experiment keeps its artifacts: beside the data for a database the process
    writes itself (sqlite, postgresql, ...); a tracking server chooses its own."""
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    if scheme in ("http", "https", "databricks", "databricks-uc", "file", ""):
        return None
    return (Path(root).resolve() / "mlartifacts").as_uri()


def ensure_experiment(client: MlflowClient, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment `name`, created (or restored from deletion) when needed, and marked as
    model development (`mlflow.experimentKind`) unless it already has a kind."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location,
                                            tags={EXPERIMENT_KIND: MODEL_DEVELOPMENT})
        except MlflowException:  # created meanwhile by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    if EXPERIMENT_KIND not in exp.tags:  # made before the kind was set, or by someone else
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_DEVELOPMENT)
    return exp.experiment_id
