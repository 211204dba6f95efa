"""Stopping a run: SIGTERM to `qad-pipeline run` stops every stage process and the temporary
Prefect server within seconds, leaves nothing half-written and no RUNNING MLflow run; `kill -9`
leaves no process of the run behind either (its watchdog stops the temporary server and the stage);
and the same command then resumes without running anything that finished again: killed in
final_eval, then in the served eval (the last stage: the export finished before it), every finished
stage comes from Prefect's cache (no process: its usage file is untouched), QAD trains no step again,
and the metrics are the first finish's. Real processes, no mocks."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qad_pipeline.core.config import PROJECT_PARAMS
from tests.conftest import GOOD_RECIPES, TINY
from tests.devstack import tool_env

pytestmark = pytest.mark.slow

RECIPE = GOOD_RECIPES[0]
SECRETS = {"HF_TOKEN": "hf_fakeSecret0123456789", "AWS_SECRET_ACCESS_KEY": "fakeAwsSecret/0123456789",
           "MLFLOW_TRACKING_PASSWORD": "fakeMlflowPassword0123"}


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_every_process_and_the_same_command_resumes_running_nothing_twice(tmp_path):
    from mlflow import MlflowClient

    root = tmp_path / "run"
    command = ["qad-pipeline", "run", "--params", str(PROJECT_PARAMS), "--out-root", str(root)]
    for item in [*TINY, f"ptq.recipes=[{RECIPE}]", "eval.backend=vllm", "export.serving_check=skip"]:
        command += ["--set", item]
    # fake secrets in the environment: they must turn up in no output of the run
    env = {**tool_env(), "PREFECT_HOME": str(tmp_path / "prefect-home"), **SECRETS}
    env.pop("PREFECT_API_URL", None)  # the run's own temporary server
    log = (tmp_path / "first.log").open("w")
    run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    seen: set[int] = set()
    stage_log = root / "artifacts" / "logs" / f"ptq-{RECIPE}.log"
    deadline = time.time() + 600
    while not stage_log.is_file() or stage_log.stat().st_size == 0:  # the recipe's process is at work
        assert run.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.time() < deadline, "the PTQ stage never started"
        seen |= descendants(run.pid)
        time.sleep(0.05)
    # The signal lands while the recipe works, whatever the machine's load: its process is frozen
    # (SIGSTOP) at its first log line (~2 s of work before its checkpoint, alone here), the run gets
    # SIGTERM, and the recipe is thawed (SIGCONT) once the run's SIGTERM to it is pending (/proc's
    # ShdPnd): no timer decides the order (half a second after that line lost the race on a busy machine).
    seen |= descendants(run.pid)
    [stage] = [p for p in seen if f" stage ptq {RECIPE} " in cmdline(p)]
    os.kill(stage, signal.SIGSTOP)
    while state(stage) not in ("T", "Z", ""):  # the kernel stops it as it next runs
        time.sleep(0.01)
    assert state(stage) == "T", f"the recipe's process ended before it was frozen: {state(stage)!r}"
    assert not (root / "artifacts" / "logs" / f"ptq-{RECIPE}.usage.json").exists()
    run.send_signal(signal.SIGTERM)
    deadline = time.time() + 60
    while not sigterm_pending(stage):
        assert time.time() < deadline, "the run never passed its SIGTERM on to the recipe's process"
        time.sleep(0.05)
    os.kill(stage, signal.SIGCONT)
    code = run.wait(timeout=90)
    log.close()
    output = (tmp_path / "first.log").read_text()

    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM" in output
    assert len(seen) >= 2  # at least the temporary server and the PTQ stage process were there
    deadline = time.time() + 10  # the watchdog's SIGTERM, then its SIGKILL after 3 s
    while [p for p in seen if alive(p)] and time.time() < deadline:
        time.sleep(0.1)
    left = sorted(p for p in seen if alive(p))
    assert not left, f"still running after the run ended: {[Path(f'/proc/{p}/cmdline').read_bytes()[:200] for p in left]}"
    assert not list(root.rglob("*.partial")), "a half-written output folder was left behind"
    # nothing looks complete that is not: the recipe was stopped before its checkpoint
    assert not (root / "artifacts" / "ptq" / RECIPE / "checkpoint").exists()
    store = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = store.search_runs([e.experiment_id for e in store.search_experiments()])
    assert runs and not [r.info.run_id for r in runs if r.info.status == "RUNNING"]
    assert {r.info.status for r in runs if r.data.tags.get("qad.kind") == "pipeline"} == {"KILLED"}

    baseline_usage = (root / "artifacts" / "logs" / "baseline.usage.json").stat().st_mtime_ns
    consoles = [output, *resume_killed_after_qad(command, env, root, tmp_path)]
    assert (root / "artifacts" / "ptq" / RECIPE / "checkpoint").is_dir()
    # the baseline finished before the stop: every later run takes it from Prefect's cache
    assert (root / "artifacts" / "logs" / "baseline.usage.json").stat().st_mtime_ns == baseline_usage

    outputs = {"console": "".join(consoles).encode()}
    for path in [*root.rglob("*"), *(tmp_path / "prefect-home").rglob("*")]:  # stage logs, MLflow, Prefect's db
        if path.is_file() and path.stat().st_size < 200 * 2**20:
            outputs[str(path)] = path.read_bytes()
    leaks = [(name, where) for name, value in SECRETS.items() for where, data in outputs.items()
             if value.encode() in data]
    assert not leaks, leaks


def state(pid: int) -> str:
    """The process's state letter (/proc's field 3: R, S, T stopped, Z zombie); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def sigterm_pending(pid: int) -> bool:
    """A process-wide SIGTERM waits for the process (a frozen one takes it once thawed)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc's field 22): with the pid, one process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


STAGES = ("calibration", "baseline", f"ptq-{RECIPE}", "selection", "qad", "final_eval", "export", "served_eval")


def usage(root: Path) -> dict[str, int]:
    """When each stage process last finished (its usage file, written as it ends)."""
    logs = root / "artifacts" / "logs"
    return {name: (logs / f"{name}.usage.json").stat().st_mtime_ns for name in STAGES
            if (logs / f"{name}.usage.json").is_file()}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_until(command: list[str], env: dict, log_path: Path, root: Path, stage: str | None = None) -> str:
    """Run the command to its end, or `kill -9` it as soon as `stage`'s process has started; then
    no process of the run is left within 5 s (the temporary server and the stage included)."""
    with log_path.open("w") as log:
        run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        started, deadline = root / "artifacts" / "logs" / f"{stage}.log", time.time() + 900
        while stage and not started.is_file():
            assert run.poll() is None, f"ended before {stage} started:\n{log_path.read_text()[-3000:]}"
            assert time.time() < deadline, f"{stage} never started"
            time.sleep(0.2)
        if stage:
            time.sleep(1)  # the watchdog (it looks every second) has seen the stage process
            seen = {pid: start_time(pid) for pid in descendants(run.pid)}
            assert any("uvicorn" in cmdline(p) for p in seen) and any(" stage " in cmdline(p) for p in seen), seen
            run.kill()
        code = run.wait(timeout=900)
    text = log_path.read_text()
    assert code == (-signal.SIGKILL if stage else 0), text[-3000:]
    if stage:
        def left() -> list[str]:
            return [cmdline(p)[:120] for p, at in seen.items() if alive(p) and start_time(p) == at]

        deadline = time.time() + 5
        while left() and time.time() < deadline:
            time.sleep(0.2)
        assert not left(), f"still running 5 s after the run was killed in {stage}: {left()}"
    return text


def cached(console: str, stage: str) -> bool:
    return f"Task run '{stage}' - Finished in state Cached" in console


def resume_killed_after_qad(command: list[str], env: dict, root: Path, tmp_path: Path) -> list[str]:
    """The same command: killed (-9) in final_eval, then in the served eval, then to its end; no
    finished stage runs again, QAD trains no step again. Returns the consoles."""
    loss, scores, exported = (root / "artifacts" / "qad" / "loss.json", root / "metrics" / "qad.json",
                              root / "metrics" / "export.json")
    first = run_until(command, env, tmp_path / "2.log", root, "final_eval")
    trained, before = digest(loss), usage(root)
    assert "qad" in before and "final_eval" not in before

    second = run_until(command, env, tmp_path / "3.log", root, "served_eval")
    assert cached(second, "qad") and digest(loss) == trained and usage(root)["qad"] == before["qad"], (
        "QAD trained again after a kill in final_eval")
    for stage in ("calibration", "baseline", f"ptq-{RECIPE}"):
        assert cached(second, stage) and usage(root)[stage] == before[stage], f"{stage} ran again after a kill in final_eval"
    evaluated, packed, before = digest(scores), digest(exported), usage(root)

    last = run_until(command, env, tmp_path / "4.log", root)
    for stage in ("calibration", "baseline", f"ptq-{RECIPE}", "qad", "final_eval", "export"):
        assert cached(last, stage) and usage(root)[stage] == before[stage], f"{stage} ran again after a kill in served_eval"
    assert usage(root)["served_eval"] > before.get("served_eval", 0) and (root / "metrics" / "served.json").is_file()
    assert (digest(loss), digest(scores), digest(exported)) == (trained, evaluated, packed), "the metrics changed"
    return [first, second, last]


def test_watchdog_ends_with_its_run_and_stops_only_what_the_run_left_behind():
    run = ("import subprocess, time\n"
           "from qad_pipeline.platform import processes\n"
           "watchdog = processes.start_watchdog(interval_s=0.2)\n"
           "left = subprocess.Popen(['sleep', '60'])\n"
           "print(watchdog.pid, left.pid, flush=True)\n"
           "time.sleep(1)\n")  # then it ends normally, with `sleep` still running
    bystander = subprocess.Popen(["sleep", "60"])  # not the run's: never touched
    try:
        done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, env=tool_env(), timeout=30)
        assert done.returncode == 0, done.stderr
        watchdog, left = map(int, done.stdout.split())
        deadline = time.time() + 5
        while (alive(watchdog) or alive(left)) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(left), "the run's leftover process is still running"
        assert not alive(watchdog), "the watchdog did not end with its run"
        assert bystander.poll() is None
    finally:
        bystander.kill()


def test_a_stage_process_started_after_stop_all_is_stopped_at_once():
    """A task submitted before the stop starts its process after `stop_all` has looked: `started`
    stops it (in a process of its own: the stop is for good)."""
    run = ("import subprocess\n"
           "from qad_pipeline.platform import processes\n"
           "processes.stop_all(grace_s=0)\n"
           "late = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
           "processes.started(late)\n"
           "print(late.wait(timeout=10))\n")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, env=tool_env(), timeout=30)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == -signal.SIGTERM
