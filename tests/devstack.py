"""A local Prefect stack for tests and the benchmark: a real server on SQLite, the two work pools,
process workers and the deployments of prefect.yaml, each a child process, all under one folder.

    with LocalPrefect(tmp_dir) as stack:
        stack.worker("qad-control", "control")
        stack.worker("qad-gpu", "gpu-0", {"CUDA_VISIBLE_DEVICES": "0"})
        stack.deploy()
        run_id = stack.run("qad-pipeline/default", {"out_root": "..."})
        run = stack.wait(run_id)

It does what docs/deployments.md tells a user to type (`prefect server start`, `qad-pipeline prefect-setup`,
`prefect worker start`, `prefect deploy --all`, `prefect deployment run`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from qad_pipeline.core.config import PROJECT_ROOT

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPrefect:
    def __init__(self, folder: Path, project: Path = PROJECT_ROOT):
        self.folder = Path(folder)
        self.project = Path(project)
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            **tool_env(),
            "PREFECT_HOME": str(self.folder / "prefect-home"),
            "PREFECT_API_URL": self.api,
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.folder / 'prefect.db'}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_LOCAL_STORAGE_PATH": str(self.folder / "results"),
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_WORKER_PREFETCH_SECONDS": "2",
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
            # The leases of global concurrency slots (the base-model slot) on disk, not in the server's
            # memory: a restarted server that forgot them would fail the holder's renewal and keep
            # the slot taken for good (every later run of that base model would wait forever).
            "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
        }
        for key in ("PREFECT_PROFILES_PATH", "PREFECT_TEST_MODE"):
            self.env.pop(key, None)

    # processes -------------------------------------------------------------------------------
    def _start(self, name: str, cmd: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        log = (self.folder / f"{name}.log").open("a")  # a restarted server goes on writing its log
        proc = subprocess.Popen(cmd, cwd=self.project, env={**self.env, **(extra_env or {})}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def prefect(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["prefect", "--no-prompt", *args], cwd=self.project, env=self.env,
                              capture_output=True, text=True, timeout=300)
        if check and done.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def start(self, timeout: float = 120) -> LocalPrefect:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.start_server(timeout)
        done = subprocess.run(["qad-pipeline", "prefect-setup"], cwd=self.project, env=self.env, capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"qad-pipeline prefect-setup failed:\n{done.stdout}\n{done.stderr}")
        return self

    def start_server(self, timeout: float = 120) -> None:
        """`prefect server start` on this stack's port and database; returns once it answers."""
        self._start("server", ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)])
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.procs["server"].poll() is not None:
                raise RuntimeError(f"the Prefect server exited:\n{self.log('server')[-3000:]}")
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the Prefect server did not answer within {timeout:.0f}s:\n{self.log('server')[-3000:]}")

    def restart_server(self, down_s: float) -> float:
        """Stop the server, leave it down `down_s`, start it again on the same port and database;
        the seconds it did not answer."""
        stopped = time.time()
        self.stop("server")
        time.sleep(down_s)
        self.start_server()
        return time.time() - stopped

    def worker(self, pool: str, name: str, env: dict[str, str] | None = None, limit: int = 1) -> subprocess.Popen:
        """`prefect worker start --pool POOL --limit 1`: one run at a time, like one GPU."""
        return self._start(name, ["prefect", "worker", "start", "--pool", pool, "--type", "process",
                                  "--name", name, "--limit", str(limit)], env)

    def stop(self, *names: str) -> None:
        """SIGTERM to each process group at once; SIGKILL to what is still there 20 s later."""
        procs = [self.procs.pop(name) for name in names]
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 20
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        self.stop(*[n for n in self.procs if n != "server"])  # the workers first, then their server
        if "server" in self.procs:
            self.stop("server")

    def __enter__(self) -> LocalPrefect:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # deployments and runs -----------------------------------------------------------------
    def deploy(self) -> None:
        self.prefect("deploy", "--all")

    def run(self, deployment: str, params: dict, check: bool = True) -> subprocess.CompletedProcess | str:
        """`prefect deployment run NAME --params JSON`; the new flow run's id (or the failed command)."""
        done = self.prefect("deployment", "run", deployment, "--params", json.dumps(params), check=check)
        if not check:
            return done
        for line in done.stdout.splitlines():
            if "UUID:" in line:
                return line.split("UUID:")[1].strip()
        raise RuntimeError(f"no flow run id in:\n{done.stdout}")

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api)

    def wait(self, flow_run_id: str, timeout: float = 900):
        """Poll until the flow run is final; returns it."""
        deadline = time.time() + timeout
        with self.client() as client:
            while time.time() < deadline:
                run = client.read_flow_run(flow_run_id)
                if run.state and run.state.is_final():
                    return run
                time.sleep(2)
        raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout:.0f}s")

    def flow_runs(self, flow_name: str) -> list:
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName

        with self.client() as client:
            return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))

    def events(self, name: str) -> list[dict]:
        """Prefect's event records of one kind, e.g. `prefect.worker.submitted-flow-run`."""
        from prefect.events.filters import EventFilter, EventNameFilter

        with self.client() as client:
            page = client.read_events(filter=EventFilter(event=EventNameFilter(name=[name])), limit=50)
            events = list(page.events)
            while page.next_page:
                page = client.read_events_page(page.next_page)
                events += page.events
        return [e.model_dump(mode="json") for e in events]

    def logs(self, flow_run_id: str, until: str | None = None, timeout: float = 60) -> str:
        """The log messages Prefect stored for a flow run (its tasks' included), one per line.

        A run's process ships its logs in batches and sends the last ones after its final state,
        so a finished run's last lines can still be on the way: with `until`, wait for that text.
        """
        from uuid import UUID

        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(str(flow_run_id))]))
        deadline = time.time() + timeout
        while True:
            messages: list[str] = []
            with self.client() as client:
                while page := client.read_logs(log_filter=only, limit=200, offset=len(messages)):  # every page
                    messages += [row.message for row in page]
            text = "\n".join(messages)
            if until is None or until in text or time.time() > deadline:
                return text
            time.sleep(1)


class LocalMLflow:
    """`mlflow server` on 127.0.0.1 with a SQLite store and a local artifact folder, as a child
    process that can be stopped and started again on the same port and store."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> LocalMLflow:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = (self.folder / "server.log").open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
             "--artifacts-destination", str(self.folder / "artifacts")],
            env=tool_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"mlflow server did not answer within {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def __enter__(self) -> LocalMLflow:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# A DVC project ----------------------------------------------------------------------------------
PROJECT_FILES = ["dvc.yaml", "params.yaml", "recipes", "eval_tasks", "data/heldout", "tasks", "qad_pipeline", "serving",
                 ".dvc/config", ".dvcignore", ".gitignore"]
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "qad-pipeline", "GIT_AUTHOR_EMAIL": "qad-pipeline@localhost",
                "GIT_COMMITTER_NAME": "qad-pipeline", "GIT_COMMITTER_EMAIL": "qad-pipeline@localhost"}


def tool_env() -> dict[str, str]:
    """This environment with the venv's commands (qad-pipeline, dvc, prefect) first on PATH."""
    return {**os.environ, **GIT_IDENTITY,
            "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}


def sh(cwd: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=tool_env(), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def set_params(repo: Path, overrides: list[str]) -> None:
    """Apply `section.key=value` overrides to the project's params.yaml itself."""
    import yaml

    from qad_pipeline.core.config import apply_overrides

    path = repo / "params.yaml"
    path.write_text(yaml.safe_dump(apply_overrides(yaml.safe_load(path.read_text()), overrides), sort_keys=False))


def make_dvc_project(repo: Path, overrides: list[str], remote: Path) -> Path:
    """A fresh git + DVC project with this project's pipeline files, params.yaml with `overrides`
    applied, the demo model as `models/base` tracked with `dvc add`, and `remote` as DVC remote."""
    import shutil

    for rel in PROJECT_FILES:
        src, dst = PROJECT_ROOT / rel, repo / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    shutil.copytree(PROJECT_ROOT / "demo" / "model", repo / "models" / "base")
    set_params(repo, [*overrides, "base_model.path=models/base"])
    sh(repo, "qad-pipeline", "dvc-yaml", "--params", "params.yaml")  # for these params (the sweep's stages or not)
    sh(repo, "git", "init", "-q")
    sh(repo, "dvc", "remote", "add", "-f", "-d", "local", str(remote))
    sh(repo, "dvc", "add", "-q", "models/base")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-q", "-m", "project")
    return repo
