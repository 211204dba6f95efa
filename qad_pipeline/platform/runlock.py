"""One writer per output root: `qad-pipeline run` and every `qad-pipeline stage` hold a lock on it.

The lock is `<out-root>/.qad-pipeline.lock`, held with `flock` for as long as the run or stage
runs, so two writers (a Prefect run and a `dvc repro`, or two Prefect runs) never mix their
files: the second is refused with a message naming the first. The operating system drops a
`flock` when its process dies, so a killed run never blocks the next one; the lock file keeps the
holder's description, and the next holder reports that the previous run was killed and what
happens to its unfinished outputs.

The stage processes of a run pass through its lock: the run hands them its token in
`QAD_PIPELINE_RUN_LOCK`. The nodes of a multi-node QAD stage are not the run's child processes (a
cluster starts them, e.g. a Kubeflow training job): they get the token in `QAD_PIPELINE_NODE_OF`
and pass through the lock the same way, on the out-root they share.

`dvc repro` deletes a stage's outputs before it runs the stage's command, so the stage's own
lock would come too late for it. In a DVC project a run therefore also holds DVC's own lock
(`.dvc/tmp/rwlock`) on `artifacts/` and `metrics/`: `dvc repro` refuses to start a stage while a
run writes there, naming the run, and a run refuses to start while `dvc repro` runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, TextIO

from qad_pipeline.core.config import ConfigError

LOCK_NAME = ".qad-pipeline.lock"
TOKEN_ENV = "QAD_PIPELINE_RUN_LOCK"
NODE_ENV = "QAD_PIPELINE_NODE_OF"


class LockHeld(ConfigError):
    """Another run is writing the same output root."""


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, `{holder.get('command')}`, since {started}"


def _read(fh) -> dict:
    fh.seek(0)
    try:
        return json.loads(fh.read() or "{}")
    except json.JSONDecodeError:
        return {}


@contextmanager
def flocked(path: Path, busy) -> Iterator[TextIO]:
    """`path` opened and held with `flock` (exclusive, non-blocking) for the block: the project's one
    file lock (the run lock below, the watcher's state). When another process holds it, raises
    `busy(fh)` with the file open at the holder's description."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy(fh) from None
        try:
            yield fh
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def run_lock(root: Path, what: str, on_stale=None) -> Iterator[str]:
    """Hold the output root's lock; yields the token that the run's own stage processes pass.

    A stage process started by a run that holds the lock (same token in the environment) passes
    through. `on_stale(message)` is called when the previous holder was killed before it finished.
    """
    root = Path(root)
    path = root / LOCK_NAME
    token = os.environ.get(TOKEN_ENV) or os.environ.get(NODE_ENV)
    if token and path.is_file():
        with path.open() as fh:
            holder = _read(fh)
        if holder.get("token") == token and not holder.get("finished"):
            yield token  # a stage of the run that holds the lock
            return
    if os.environ.get(NODE_ENV):
        raise LockHeld(f"this QAD node belongs to a run ({NODE_ENV}) that no longer holds {path}: the run ended or "
                       "was stopped; the node does not start on its own")

    def busy(fh) -> LockHeld:
        return LockHeld(f"{root} is being written by another qad-pipeline run ({_describe(_read(fh))}); "
                        f"refusing to {what} into the same outputs. Wait for it to finish (or stop it), or "
                        "give this run another --out-root.")

    with flocked(path, busy) as fh:
        holder = _read(fh)
        if holder and not holder.get("finished") and on_stale is not None:
            on_stale(
                f"the previous run on {root} ({_describe(holder)}) was killed before it finished. "
                "Its unfinished stage outputs are removed and written again by the stages that re-run "
                "(`dvc status` lists them under DVC; QAD resumes from its last checkpoint)."
            )
        token = uuid.uuid4().hex
        mine = {"token": token, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) or what, "finished": False}
        _write(fh, mine)
        try:
            yield token
        finally:
            _write(fh, {**mine, "finished": True, "ended": time.time()})


def _write(fh, data: dict) -> None:
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps(data))
    fh.flush()
    os.fsync(fh.fileno())


@contextmanager
def dvc_write_lock(root: Path, what: str) -> Iterator[None]:
    """In a DVC project, hold DVC's write lock on the outputs' folders; elsewhere do nothing."""
    root = Path(root).resolve()
    if not (root / ".dvc").is_dir():
        yield
        return
    from dvc.fs import localfs
    from dvc.lock import LockError
    from dvc.rwlock import rwlock

    tmp = root / ".dvc" / "tmp"
    tmp.mkdir(exist_ok=True)
    with ExitStack() as stack:
        try:
            stack.enter_context(rwlock(str(tmp), localfs, what, [], [str(root / "artifacts"), str(root / "metrics")],
                                       False))
        except LockError as err:
            raise LockHeld(f"DVC is writing {root}: {err}") from None
        yield
