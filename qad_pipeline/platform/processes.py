"""The lifetimes of the stage processes a run starts: none outlives the run.

- `started`/`finished` keep the set of live stage processes; `stop_all` stops them (SIGTERM to
  each one's process group, so torchrun's and the serving check's children too; SIGKILL after a
  grace period) when a run is cancelled (SIGTERM, Ctrl-C, a Prefect cancel). A stage process
  started after that (a task already submitted) gets SIGTERM as it is registered: a stopped run
  starts no more work.
- `die_with_parent`: a stage process started by a run gets SIGTERM when that run's process dies,
  even by SIGKILL.
- `exit_on_sigterm`: a stage process turns SIGTERM into SystemExit, so its `finally` blocks run
  and a half-written output folder is removed, not left behind.
- `exit_reason`: why a stage process ended, naming the signal; out of memory only when the
  kernel's OOM killer counted a kill.
- `start_watchdog`: a process that outlives a `kill -9` of the run by a moment, to stop what the
  run started that does not die with it (Prefect's temporary server, its own child).
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
_stopping = False  # stop_all has run: this process's run is stopping


def started(proc: subprocess.Popen) -> None:
    with _lock:
        _live.add(proc)
        if _stopping:
            _signal_group(proc, signal.SIGTERM)  # stop_all has already looked: nothing new runs


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
    started a process reaps it (and calls `finished`); this only waits for that to happen. From
    here on `started` stops each process it is given.
    """
    global _stopping
    with _lock:
        _stopping = True
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


def start_watchdog(interval_s: float = 1.0) -> subprocess.Popen:
    """Start `watch(this process)` in a child process of its own; it ends soon after this one."""
    code = f"from qad_pipeline.platform.processes import watch; watch({os.getpid()}, {interval_s})"
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=True)  # Ctrl-C and signals to the run's group do not reach it


def watch(parent: int, interval_s: float = 1.0, grace_s: float = 3.0) -> None:
    """Record `parent`'s descendants (pid and start time) every `interval_s`; once `parent` has
    died, stop those still running (SIGTERM, SIGKILL after `grace_s`), then return.

    It learns of the death from SIGTERM (PR_SET_PDEATHSIG) or from its parent pid changing. A
    recorded pid is only signalled while it is the same process (same start time), and nothing
    is signalled while `parent` lives: a SIGTERM from anyone else only ends the watch.
    """
    import psutil

    signalled: list[int] = []

    def _wake(signum, _frame):
        if not signalled:  # the death signal comes again when the dying process's last thread ends
            signalled.append(signum)
            raise Stopped(signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _wake)
    die_with_parent(signal.SIGTERM)
    recorded: dict[int, float] = {}
    try:
        while os.getppid() == parent:
            try:
                for child in psutil.Process(parent).children(recursive=True):
                    if child.pid != os.getpid():
                        recorded[child.pid] = child.create_time()
            except psutil.Error:  # it is going; the next look at getppid tells
                pass
            time.sleep(interval_s)
    except Stopped:
        # The thread that started this process has ended. If others of its process were still
        # running, this process went to one of them (same parent pid) until the last one ends.
        deadline = time.monotonic() + 2.0
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.02)
    if os.getppid() == parent:
        return
    left = []
    for pid, created in recorded.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == created and _running(process):
                process.terminate()
                left.append(process)
        except psutil.Error:
            continue
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _running(p)]
    for process in left:
        try:
            process.kill()  # psutil checks it is still the same process
        except psutil.Error:
            pass


def _running(process) -> bool:
    """Not ended: a zombie (ended, not yet reaped by its new parent) is no longer running."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
