"""Who logs a run (host, pid, the pid's start time), and ending the runs whose logger died
without ending them (`mark_stale_runs`)."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from qad_pipeline.tracking.store import EXPERIMENT_PREFIX, HOST, KIND, PID, PID_STARTED, STALE, client_for

if TYPE_CHECKING:  # mlflow is imported where it is used: importing it takes seconds
    from mlflow import MlflowClient


def process_tags() -> dict[str, str]:
    """Who is logging: host, pid and the pid's start time (so a reused pid is not mistaken)."""
    tags = {HOST: socket.gethostname(), PID: str(os.getpid())}
    started = _process_started(os.getpid())
    if started is not None:
        tags[PID_STARTED] = f"{started:.2f}"
    return tags


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 (no psutil, no such process)
        return None


def _process_alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if started:
        now = _process_started(pid)
        if now is not None and abs(now - float(started)) > 1.0:
            return False  # the pid was reused by another process
    return True


def _pipeline_experiment_ids(client: MlflowClient) -> list[str]:
    ids, token = [], None
    while True:
        page = client.search_experiments(filter_string=f"name LIKE '{EXPERIMENT_PREFIX}%'", page_token=token)
        ids += [e.experiment_id for e in page]
        token = page.token
        if not token:
            return ids


def mark_stale_runs(uri: str, *, all_hosts: bool = False, status: str = "KILLED",
                    keep: tuple[str, ...] = ()) -> list[str]:
    """Mark runs left RUNNING by a killed pipeline logger as ended; returns their ids.

    A run of this package (tag `qad.kind`) is stale when the process that created it (tags
    `qad.host`, `qad.pid`, `qad.pid_started`) no longer runs on this host. Runs of other hosts
    are left alone unless `all_hosts` (use it when no other pipeline can be running). They end
    with `status` (KILLED by default) and a tag `qad.stale` that says why. The runs in `keep` are
    left alone (a run that `log_pipeline` is about to complete).
    """
    client = client_for(uri)
    ids = _pipeline_experiment_ids(client)
    if not ids:
        return []
    host = socket.gethostname()
    marked = []
    for run in client.search_runs(ids, filter_string="attributes.status = 'RUNNING'", max_results=5000):
        tags = run.data.tags
        if KIND not in tags or run.info.run_id in keep:
            continue
        pid = int(tags[PID]) if tags.get(PID, "").isdigit() else None
        if tags.get(HOST) == host:
            if pid is not None and _process_alive(pid, tags.get(PID_STARTED)):
                continue
        elif not all_hosts:
            continue
        why = f"left RUNNING by process {pid} on {tags.get(HOST)}, which no longer runs; marked {status}"
        client.set_tag(run.info.run_id, STALE, why)
        client.set_terminated(run.info.run_id, status)
        marked.append(run.info.run_id)
    return marked
