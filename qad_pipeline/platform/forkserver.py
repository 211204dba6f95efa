"""Stage processes forked from a server that has imported the stages' libraries once (CPU only).

A stage process of a small model spends most of its time importing torch, transformers, Model
Optimizer and lm-eval: 7-10 s of a demo stage's 13 s on 2 cores (`python -X importtime`), paid again
by every stage of a run. On a machine without a GPU a run starts one server (`serve`, a process of
its own that only imports the modules its caller names, `Entry.preload`) and each stage process is
forked from it, running the caller's entry point (the CLI) with the stage's arguments: the same
`python -m qad_pipeline stage ...` command line (as `ps` shows it), working directory,
environment and log file as a fresh process, its own process group, its exit status and
peak memory reported back. On a GPU every stage is a fresh process (`usable`): a process that has
touched CUDA's driver cannot fork a child that uses it, and at the users' sizes imports are a small
share of a stage. `QAD_FORKSERVER=0` turns it off.

Differences from a fresh process, and how they are handled:
- Modules read some environment variables when imported (Hugging Face's offline switches, caches):
  a stage whose environment differs from the server's, beyond `PER_STAGE` (set per stage and read
  at run time), gets a new server started with its environment.
- OpenMP reads OMP_NUM_THREADS when torch loads: the server starts without it (torch's default
  threads), and a child whose environment sets it sets torch's threads from it.
- The peak memory (VmHWM) counts the pages shared with the server (the imports), as a fresh process
  counts its own imports.

Protocol: a request per line on the server's stdin (JSON: argv, cwd, env, log); per line back,
`{"pid": ...}` when forked and `{"exited": pid, "status": ..., "maxrss_kb": ...}` when reaped.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import setproctitle

from qad_pipeline.platform.runlock import TOKEN_ENV

SWITCH = "QAD_FORKSERVER"
# set per stage by the flow, and read by the stage at run time (not when a module is imported)
PER_STAGE = frozenset({"OMP_NUM_THREADS", "PYTHONUNBUFFERED", TOKEN_ENV})


@dataclass(frozen=True)
class Entry:
    """What a forked process runs: `function` ("module:name", called with `args=` and `prog_name=`),
    the command line it shows (`title`, then its arguments), and the modules the server imports first."""

    function: str
    prog_name: str
    title: tuple[str, ...]
    preload: tuple[str, ...]


def usable() -> bool:
    """Fork stage processes here: not switched off, and no CUDA device (which does not survive a fork)."""
    return os.environ.get(SWITCH, "1") != "0" and sys.platform == "linux" and not _cuda()


@functools.cache
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class ServerEnded(RuntimeError):
    """The server is gone (an import of its failed, or it was killed): nothing can be forked from it."""


class Server:
    """The flow's side of one server process: `start` forks a stage, `result` reads how it ended."""

    def __init__(self, env: dict[str, str], entry: Entry):
        self.env, self.entry = _shared(env), entry
        self.proc = subprocess.Popen([sys.executable, "-c", "from qad_pipeline.platform.forkserver import serve; serve()",
                                      json.dumps(asdict(entry))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**self.env, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True)  # Ctrl-C to the run's group does not reach it
        self._send = threading.Lock()
        self._done = threading.Condition()
        self._forked: list[int] = []
        self._exited: dict[int, tuple[int, int]] = {}
        self._reader = threading.Thread(target=self._read, daemon=True, name="forkserver-reader")
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._done:
                if "pid" in msg:
                    self._forked.append(msg["pid"])
                else:
                    self._exited[msg["exited"]] = (msg["status"], msg["maxrss_kb"])
                self._done.notify_all()
        with self._done:
            self._done.notify_all()  # the server ended: nothing more comes

    def fits(self, env: dict[str, str], entry: Entry) -> bool:
        return self.proc.poll() is None and entry == self.entry and _shared(env) == self.env

    def start(self, argv: list[str], cwd: str, env: dict[str, str], log: str) -> int:
        """Fork the entry point with `argv` in `cwd` with `env`, its output appended to `log`; its pid."""
        request = json.dumps({"argv": argv, "cwd": cwd, "env": env, "log": log}) + "\n"
        with self._send:  # one request at a time: the pids come back in order
            self.proc.stdin.write(request.encode())
            self.proc.stdin.flush()
            with self._done:
                while not self._forked:
                    if self.proc.poll() is not None:
                        raise ServerEnded(f"the fork server ended (exit code {self.proc.returncode}; "
                                          "its error is on this process's stderr)")
                    self._done.wait(0.5)
                return self._forked.pop(0)

    def result(self, pid: int) -> tuple[int, int] | None:
        """(wait status, peak RSS in KiB) once `pid` has ended; None while it runs."""
        with self._done:
            if pid in self._exited:
                return self._exited.pop(pid)
            if self.proc.poll() is not None and not self._reader.is_alive():
                return (signal.SIGKILL, 0)  # the server died and took its children with it
            return None

    def wait(self, pid: int, timeout: float | None = None) -> tuple[int, int] | None:
        """`result` once `pid` has ended; None if it still runs after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (ended := self.result(pid)) is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return ended

    def close(self) -> None:
        """Close its requests: it ends once its children have (it waits for them)."""
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()


def _shared(env: dict[str, str]) -> dict[str, str]:
    """What of a stage's environment its server must share (all but `PER_STAGE`)."""
    return {k: v for k, v in env.items() if k not in PER_STAGE}


_servers: list[Server] = []
_lock = threading.Lock()


def server_for(env: dict[str, str], entry: Entry) -> Server:
    """The running server started with `env` (but `PER_STAGE`) for `entry`, else a new one (an older
    one closes)."""
    with _lock:
        for server in _servers:
            if server.fits(env, entry):
                return server
        for server in _servers:
            server.close()  # ends once its stages have
        _servers[:] = [Server(env, entry)]
        return _servers[0]


def warm(entry: Entry) -> None:
    """Start this process's server now (where `usable`), so that its imports run while the caller
    does other work: its stages (this environment, but `PER_STAGE`) are forked from it."""
    if usable():
        server_for(dict(os.environ), entry)


@atexit.register
def _close_all() -> None:
    for server in _servers:
        server.close()


def serve() -> None:
    """The server: import the stages' libraries, then fork a stage per request and report its end.

    Computes nothing (OpenMP's threads do not survive a fork). It ends when its requests close and
    its children have ended, or at once when its parent dies (its children, stage processes of a dead
    run, then get SIGTERM: `processes.die_with_parent`). It watches its parent pid rather than asking
    for a signal at its parent's death: that signal comes when the *thread* that started it ends,
    and the flow starts it from whichever task thread runs a stage first."""
    entry = Entry(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[1]).items()})
    parent = os.getppid()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what an import prints goes to stderr, not into the replies
    for name in entry.preload:
        importlib.import_module(name)
    module, _, function = entry.function.partition(":")
    main = getattr(importlib.import_module(module), function)
    pending, children, closed = b"", set(), False
    while not closed or children:
        if os.getppid() != parent:
            return  # the run died: its stages die with this process
        ready, _, _ = select.select([] if closed else [0], [], [], 0.05)
        if ready:
            chunk = os.read(0, 65536)
            closed = not chunk
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    replies.close()
                    _child(json.loads(line), entry, main)  # never returns
                with contextlib.suppress(OSError):  # it may have set it already, or ended
                    os.setpgid(pid, pid)  # its own group before anyone is told its pid (killpg)
                children.add(pid)
                replies.write(json.dumps({"pid": pid}) + "\n")
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            replies.write(json.dumps({"exited": pid, "status": status, "maxrss_kb": usage.ru_maxrss}) + "\n")


def _child(request: dict, entry: Entry, main) -> None:
    """In the forked child: become the stage process the request describes, then exit as it does."""
    os.setpgid(0, 0)  # its own process group, as the server also makes it: stop_all signals the group
    # `ps` and the tests that look for a stage process show the command line a fresh one would have
    setproctitle.setproctitle(" ".join([*entry.title, *request["argv"]]))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    if os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = [entry.prog_name, *request["argv"]]
    # SystemExit (typer ends with it) or an exception leaves this process as it would a fresh one:
    # through the interpreter's own exit, atexit handlers and all
    main(prog_name=entry.prog_name, args=request["argv"])
    raise SystemExit(0)
