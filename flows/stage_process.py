"""Run one stage, `qad-pipeline stage ...`, as a child process; shared by the pipeline's flows.

Each heavy stage runs in its own process (the same command that `dvc repro` runs), so a recipe
that crashes or runs out of memory fails alone and the flow reports it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from prefect import get_run_logger

from qad_pipeline.platform import forkserver, processes
from qad_pipeline.core.artifacts import write_json
from qad_pipeline.core.layout import Layout
from qad_pipeline.platform.processes import exit_reason, oom_kills
from qad_pipeline.core.stages import STAGES


class StageFailed(RuntimeError):
    pass


# What a stage process forked by the fork server runs (CPU only, `forkserver.usable`): the CLI, after
# the libraries every stage imports and each stage's module are imported once.
STAGE_ENTRY = forkserver.Entry(
    function="qad_pipeline.cli:app", prog_name="qad-pipeline", title=(sys.executable, "-m", "qad_pipeline"),
    preload=("qad_pipeline.cli", "transformers.modeling_utils", "modelopt.torch.quantization", "modelopt.torch.export",
             "lm_eval.evaluator", *sorted({s.module for s in STAGES.values()})))


def warm_fork_server() -> None:
    """Start the run's fork server now (CPU only), its imports going on while the run sets up."""
    forkserver.warm(STAGE_ENTRY)


def _high_water_kb(pid: int) -> int | None:
    """The process's own peak resident memory since its exec (VmHWM; None where /proc has none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def wait_with_peak(pid: int, ended=None) -> tuple[int, int]:
    """Wait for stage process `pid`; (its wait status, its peak RSS in KiB).

    The peak is the child's own memory: its VmHWM, read while it runs. `wait4`'s ru_maxrss would
    also count the parent's pages that the child held between fork and exec, so a stage started
    from a 700 MB flow process could never read below 700 MB; it is the fallback without /proc.
    `ended` (a forked stage's: `forkserver.Server.result`) says how it ended; by default `wait4`.
    """
    peak, delay = 0, 0.05
    while True:
        if ended is None:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            result = (status, usage.ru_maxrss) if done else None
        else:
            result = ended(pid)
        if result:
            return result[0], peak or result[1]
        peak = max(peak, _high_water_kb(pid) or 0)
        time.sleep(delay)
        delay = min(0.5, delay * 2)


class Forked:
    """A stage process forked by the fork server, as `processes` keeps it (pid, returncode)."""

    def __init__(self, server: forkserver.Server, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def wait(self) -> None:
        self.server.wait(self.pid)  # the server reaps it and says so


def run_stage_process(
    stage: list[str], params_file: str, overrides: list[str], layout: Layout, threads: int | None = None,
    env: dict[str, str] | None = None, fork: bool = True,
) -> float:
    """Run `qad-pipeline stage ...` in a child process; its output goes to artifacts/logs/.

    Its wall time, start and end (epoch seconds, `started_at`/`finished_at`: MLflow's run times)
    and peak resident memory (the child's own, `wait_with_peak`) are logged and written to
    `artifacts/logs/<stage>.usage.json`, where the memory plan's estimates can be checked.

    `threads` caps the child's CPU threads (OMP_NUM_THREADS) when several stages share the
    machine's cores, unless the caller's environment already sets OMP_NUM_THREADS. The child runs
    in the params file's folder; `env` adds to its environment. Without a GPU it is forked from the
    run's fork server (`forkserver`: its libraries already imported), unless `fork` is False (a
    process that runs one stage only: the server would import more than that stage does).
    """
    logger = get_run_logger()
    name = "-".join(stage)
    layout.logs.mkdir(parents=True, exist_ok=True)
    log_path = layout.logs / f"{name}.log"
    # `qad-pipeline stage ...` with this interpreter (the run's environment, whatever PATH says)
    cmd = [sys.executable, "-m", "qad_pipeline",
           *STAGES[stage[0]].command(*stage[1:], params_file=params_file, out_root=str(layout.root),
                                     overrides=overrides)[1:]]
    logger.info("%s: started (log: %s)", name, log_path)
    started = time.time()
    # unbuffered: what the stage prints reaches its log as it happens, not when a buffer fills or it exits
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if threads and "OMP_NUM_THREADS" not in child_env:
        child_env["OMP_NUM_THREADS"] = str(threads)
    oom_before = oom_kills()
    with log_path.open("w") as log:
        # its own process group: a cancelled run stops it and whatever it started (processes.stop_all)
        proc = None
        if fork and forkserver.usable():  # forked from a process that has imported its libraries (CPU only)
            server = forkserver.server_for(child_env, STAGE_ENTRY)
            try:
                proc = Forked(server, server.start(cmd[3:], str(Path(params_file).parent), child_env, str(log_path)))
            except forkserver.ServerEnded as err:
                logger.warning("%s: %s; it runs as a fresh process", name, err)
        if proc is None:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(params_file).parent,
                                    env=child_env, start_new_session=True)
        processes.started(proc)
        try:
            status, peak_kb = wait_with_peak(proc.pid, proc.server.result if isinstance(proc, Forked) else None)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            processes.finished(proc)
        proc.returncode = code = os.waitstatus_to_exitcode(status)
    finished = time.time()
    elapsed = finished - started
    peak_mb = peak_kb / 1024
    write_json(layout.logs / f"{name}.usage.json", {"stage": name, "seconds": elapsed, "peak_rss_mb": peak_mb,
                                                    "exit_code": code, "started_at": started,
                                                    "finished_at": finished})
    if code != 0:
        tail = log_path.read_text().strip().splitlines()[-5:]
        why = exit_reason(code, oom_before, oom_kills())
        raise StageFailed(f"{name} failed after {elapsed:.0f}s, {why}; last lines of {log_path}:\n" + "\n".join(tail))
    logger.info("%s: done in %.1fs, peak memory %.0f MB", name, elapsed, peak_mb)
    return elapsed
