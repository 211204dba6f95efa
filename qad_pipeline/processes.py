"""The lifetimes of the stage processes a run starts: none outlives the run.

- `started`/`finished` keep the set of live stage processes; `stop_all` stops them (SIGTERM to
  each one's process group, so torchrun's and the serving check's children too; SIGKILL after a
  grace period) when a run is cancelled (SIGTERM, Ctrl-C, a Prefect cancel).
- `die_with_parent`: a stage process started by a run gets SIGTERM when that run's process dies,
  even by SIGKILL.
- `exit_on_sigterm`: a stage process turns SIGTERM into SystemExit, so its `finally` blocks run
  and a half-written output folder is removed, not left behind.
- `exit_reason`: why a stage process ended, naming the signal; out of memory only when the
  kernel's OOM killer counted a kill.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_live: set[subprocess.Popen] = set()
_lock = threading.Lock()


def started(proc: subprocess.Popen) -> None:
    with _lock:
        _live.add(proc)


def finished(proc: subprocess.Popen) -> None:
    with _lock:
        _live.discard(proc)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # each stage process leads its own process group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(grace_s: float = 10.0) -> list[int]:
    """Stop every live stage process and its children; the pids that were stopped.

    SIGTERM to each process group, then SIGKILL to what is left after `grace_s`. The thread that
    started a process reaps it (and calls `finished`); this only waits for that to happen.
    """
    with _lock:
        procs = [p for p in _live if p.returncode is None]
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        with _lock:
            if not _live.intersection(procs):
                break
        time.sleep(0.1)
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)  # what is left of its group
    return [p.pid for p in procs]


def die_with_parent(sig: int) -> None:
    """Linux: this process gets `sig` when its parent dies, so a killed run leaves no stage behind."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG


class Stopped(BaseException):
    """This process was sent `signal` (SIGTERM, SIGINT) while a run was going on."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal = signum


def raise_on_signals() -> None:
    """SIGTERM and SIGINT raise `Stopped` here, so a run can stop its stages and say why."""
    def _stop(signum, _frame):
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in this process (its cleanup runs), instead of ending it at once."""
    def _exit(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this cgroup (None: not known here)."""
    for path, key in ((Path("/sys/fs/cgroup/memory.events"), "oom_kill"),  # cgroup v2
                      (Path("/sys/fs/cgroup/memory/memory.oom_control"), "oom_kill")):  # cgroup v1
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def exit_reason(code: int, oom_before: int | None, oom_after: int | None) -> str:
    """Why a stage process ended: its exit code, or the signal that killed it; out of memory only
    when the kernel's OOM killer counted a kill meanwhile."""
    if code >= 0:
        return f"exit code {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    if -code == signal.SIGKILL and oom_before is not None and oom_after is not None and oom_after > oom_before:
        return f"killed by the kernel's out-of-memory killer ({name})"
    if -code == signal.SIGKILL and oom_before is None:
        return f"killed by {name} (the kernel's out-of-memory killer sends it: see `dmesg`)"
    return f"killed by {name}"
