"""Where runs are logged (qad_pipeline/tracking/store.py, stale.py): the URI, the reachability
check, stale runs, and the same round trip against PostgreSQL."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from qad_pipeline import tracking
from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import ConfigError
from qad_pipeline.tracking.stale import process_tags
from tests.http_stub import serve
from tests.tracking_fakes import BROKEN, GOOD, build_layout, children, logged_store, make_params


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The shared store with two logged pipeline runs (tracking_fakes.logged_store)."""
    return logged_store(tmp_path_factory)


def test_tracking_uri_default_is_sqlite_in_root_and_env_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert tracking.tracking_uri(tmp_path) == "http://mlflow.example:5000"


def test_the_commit_comes_from_git_else_from_the_images_build_argument(tmp_path, monkeypatch):
    from qad_pipeline.core import config
    from qad_pipeline.tracking.store import git_commit

    assert len(git_commit().removesuffix("-dirty")) == 40  # this checkout
    monkeypatch.setattr(config, "project_root", lambda: tmp_path)  # no .git, as in the image
    monkeypatch.setenv("QAD_GIT_COMMIT", "a" * 40)
    assert git_commit() == "a" * 40
    monkeypatch.setenv("QAD_GIT_COMMIT", "unknown")  # built without --build-arg GIT_COMMIT
    assert git_commit() is None


def test_check_reachable_fails_fast_naming_the_uri(tmp_path):
    """Fast means one attempt: MLflow's client retries a server that hangs up, with backoff (minutes)."""
    accepted, stop = [], threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, then hangs up at once
        server.settimeout(0.1)

        def hang_up():
            while not stop.is_set():
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                accepted.append(connection)
                connection.close()

        thread = threading.Thread(target=hang_up)
        thread.start()
        try:
            uri = f"http://127.0.0.1:{server.getsockname()[1]}"
            with pytest.raises(ConfigError, match=f"{uri}.* cannot be reached"):
                tracking.check_reachable(uri)
        finally:
            stop.set()
            thread.join()
    assert len(accepted) == 1, f"{len(accepted)} connections: the probe retried"
    with pytest.raises(ConfigError, match=r"http://127\.0\.0\.1:9"):
        tracking.check_reachable("http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="cannot be reached"):
        tracking.check_reachable("http://127.0.0.1:9", timeout_s=0.5)
    tracking.check_reachable(f"sqlite:///{tmp_path}/sub/mlflow.db")  # creates the folder
    assert (tmp_path / "sub").is_dir()


def test_check_reachable_sends_mlflows_credentials_and_names_a_refusal(tmp_path, monkeypatch):
    """A server behind basic auth (`mlflow server --app-name basic-auth`, a proxy): the probe sends what
    MLflow's client sends (MLFLOW_TRACKING_USERNAME/PASSWORD, the variables of the Secret qad-mlflow-auth
    on Kubernetes), and says in one line when none are set or they are refused, never with the password."""
    import base64

    user, password = "qad", "s3cret-mlflow-pw"
    good = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    seen = []

    def respond(headers):
        seen.append(headers.get("Authorization"))
        ok = headers.get("Authorization") == good
        return (200 if ok else 401), (b'{"experiments": []}' if ok else b""), "application/json"

    server, uri = serve(respond)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.mlflow/credentials
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_AUTH"):
        monkeypatch.delenv(name, raising=False)
    try:
        with pytest.raises(ConfigError, match="asks for credentials .* set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"):
            tracking.check_reachable(uri)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong-password")
        with pytest.raises(ConfigError, match=r"refuses the user 'qad' .*HTTP 401") as refused:
            tracking.check_reachable(uri)
        assert "wrong-password" not in str(refused.value)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        tracking.check_reachable(uri)
        assert seen[-1] == good and seen[0] is None
        # the password is a secret by its name: scrubbed out of any text the pipeline logs or tags
        assert password not in tracking.redact_text(f"POST {uri} as {user}:{password}")
        assert tracking.redact("MLFLOW_TRACKING_PASSWORD", password) == tracking.REDACTED
    finally:
        server.shutdown()


def test_mark_stale_runs_ends_runs_of_dead_processes(logged):
    uri, client = logged["uri"], logged["client"]  # the shared store: a new database costs seconds
    exp_id = tracking.ensure_experiment(client, tracking.experiment_name("some/model"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = client.create_run(exp_id, tags={"qad.kind": "pipeline", "qad.host": host, "qad.pid": str(dead.pid)})
    alive = client.create_run(exp_id, tags={"qad.kind": "pipeline", **process_tags()})
    elsewhere = client.create_run(exp_id, tags={"qad.kind": "pipeline", "qad.host": "other-host", "qad.pid": "1"})
    foreign = client.create_run(exp_id, tags={"note": "not ours"})
    assert tracking.mark_stale_runs(uri) == [stale.info.run_id]
    status = {r: client.get_run(r).info.status for r in
              (stale.info.run_id, alive.info.run_id, elsewhere.info.run_id, foreign.info.run_id)}
    assert status == {stale.info.run_id: "KILLED", alive.info.run_id: "RUNNING",
                      elsewhere.info.run_id: "RUNNING", foreign.info.run_id: "RUNNING"}
    assert "no longer runs" in client.get_run(stale.info.run_id).data.tags["qad.stale"]
    assert tracking.mark_stale_runs(uri, all_hosts=True) == [elsewhere.info.run_id]
    client.set_terminated(alive.info.run_id)
    client.set_terminated(foreign.info.run_id)


def test_experiments_are_marked_as_model_development_for_the_mlflow_3_ui(logged):
    uri, client = logged["uri"], logged["client"]
    exp_id = client.get_run(logged["runs"][0]["run_id"]).info.experiment_id
    assert MlflowClient(uri).get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"
    # one made before (or by someone else) without a kind gets it; one with a kind keeps its own
    older = client.create_experiment(tracking.experiment_name("older/model"))
    assert "mlflow.experimentKind" not in client.get_experiment(older).tags
    assert tracking.ensure_experiment(client, tracking.experiment_name("older/model")) == older
    assert MlflowClient(uri).get_experiment(older).tags["mlflow.experimentKind"] == "custom_model_development"
    genai = client.create_experiment(tracking.experiment_name("genai/model"),
                                     tags={"mlflow.experimentKind": "genai_development"})
    assert tracking.ensure_experiment(client, tracking.experiment_name("genai/model")) == genai
    assert client.get_experiment(genai).tags["mlflow.experimentKind"] == "genai_development"


# -- the same round trip against PostgreSQL (skipped where PostgreSQL or psycopg2 is missing) ---------


def _postgres_bin() -> Path | None:
    """The folder of pg_ctl and initdb: on PATH, else Debian's /usr/lib/postgresql/<version>/bin."""
    on_path = [shutil.which("pg_ctl"), shutil.which("initdb")]
    if all(on_path):
        return Path(on_path[0]).resolve().parent
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / "pg_ctl").is_file() and (folder / "initdb").is_file():
            return folder
    return None


@pytest.fixture
def postgres_uri():
    """A throwaway PostgreSQL server on a free port; yields its SQLAlchemy URI."""
    import pwd
    import tempfile

    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed: no pg_ctl/initdb (Debian: apt-get install postgresql)")
    import importlib.util

    # SQLAlchemy >= 2.1 reads plain postgresql:// as psycopg 3; name whichever driver is installed.
    driver = next((d for d in ("psycopg2", "psycopg") if importlib.util.find_spec(d)), None)
    if driver is None:
        pytest.skip("neither psycopg2 nor psycopg is installed (pip install psycopg2-binary): "
                    "MLflow needs one for postgresql://")
    run_as: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        if shutil.which("runuser") is None:
            pytest.skip("running as root and there is no runuser to start the server as 'postgres'")
        run_as = ["runuser", "-u", "postgres", "--"]
    # Outside tmp_path: the server's user must be able to reach its folder.
    folder = Path(tempfile.mkdtemp(prefix="qad-pg-"))
    if run_as:
        os.chown(folder, user.pw_uid, user.pw_gid)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = folder / "db"
    try:
        subprocess.run([*run_as, str(bindir / "initdb"), "-D", str(db), "-U", "postgres", "--auth=trust",
                        "-E", "UTF8", "--no-sync"], check=True, capture_output=True, timeout=120)
        subprocess.run([*run_as, str(bindir / "pg_ctl"), "-D", str(db), "-l", str(folder / "server.log"), "-w",
                        "-t", "60", "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off",
                        "start"], check=True, capture_output=True, timeout=90)
        yield f"postgresql+{driver}://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*run_as, str(bindir / "pg_ctl"), "-D", str(db), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def test_postgresql_round_trip(postgres_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", postgres_uri)
    tracking.check_reachable(postgres_uri)
    closed = postgres_uri.rsplit(":", 1)[0] + ":9/postgres"  # nothing listens on port 9
    with pytest.raises(ConfigError, match="cannot be reached at 127.0.0.1:9"):
        tracking.check_reachable(closed)
    model_dir = tmp_path / "base-model"
    model_dir.mkdir()
    params = make_params(tmp_path, model_dir)
    layout = build_layout(tmp_path, params, time.time() - 600)
    assert tracking.tracking_uri(tmp_path) == postgres_uri
    run_id = tracking.log_pipeline(layout, params, flow_run_id="pg", git_commit=None)
    assert tracking.register_export(layout, params, run_id) == "1"
    rows = tracking.compare_table(postgres_uri, params.base_model.path)
    assert [r["name"] for r in rows] == ["bf16", *GOOD, BROKEN, "qad"]
    assert rows[-1]["median_recovery"] == pytest.approx(read_json(layout.qad_metrics)["median_recovery"])
    assert all(r["run_id"] in {c.info.run_id for c in children(MlflowClient(postgres_uri), run_id).values()}
               for r in rows)
