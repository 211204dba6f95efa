"""kill -9 at seeded random points of a stage, then the same command again: it completes, its result
equals an uninterrupted run's (within the tolerances below), and nothing half-written is left or
looks complete; and a disk that fills up during the export. Real processes, no mocks, in private
copies of the shared flow run (the killed stages forked from a fork server, as a flow run's are
without a GPU: `stage_server`).

`QAD_FAULT_POINTS` kill points per stage (default 1; the matrix in docs/faults.md uses 5):

    QAD_FAULT_POINTS=5 python -m pytest -q -s tests/test_faults.py
"""

import json
import glob
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from flows.stage_process import STAGE_ENTRY
from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import PROJECT_ROOT
from qad_pipeline.core.layout import Layout
from qad_pipeline.platform import forkserver
from tests.conftest import GOOD_RECIPES

pytestmark = pytest.mark.slow

POINTS = int(os.environ.get("QAD_FAULT_POINTS", "1"))
SEED = 0
RECIPE = GOOD_RECIPES[0]
QAD_LOSS_RTOL = 1e-3  # a resumed QAD run against an uninterrupted one (AdamW and schedule restored)


def result(layout: Layout, stage: str) -> dict:
    """What must come out the same however often the stage was killed."""
    if stage == "calibration":
        manifest = read_json(layout.data / "manifest.json")
        return {"calibration": manifest["calibration"]["fingerprint"], "eval": manifest["eval"]["fingerprint"]}
    if stage == "ptq":
        scores = read_json(layout.ptq(RECIPE) / "scores.json")
        return {"kl": scores["kl_divergence"], "bpe": scores["effective_bpe"],
                "tasks": {t: v["value"] for t, v in scores["tasks"].items()}}
    if stage == "qad":
        curve = read_json(layout.qad / "loss.json")
        return {"steps": curve["steps"], "final_loss": curve["losses"][-1]["loss"]}
    export = read_json(layout.export_metrics)
    return {"passed": export["passed"], "size_bytes": export["size_bytes"], "bpe": export["effective_bpe"]}


def looks_complete(layout: Layout, stage: str) -> bool:
    marker = {"calibration": layout.data / "manifest.json", "ptq": layout.ptq(RECIPE) / "checkpoint",
              "qad": layout.qad / "model", "export": layout.export_metrics}[stage]
    return marker.exists()


@pytest.fixture(scope="module")
def run_copy(pipeline_run, tmp_path_factory):
    _, layout, overrides, _ = pipeline_run
    root = tmp_path_factory.mktemp("faults") / "run"
    shutil.copytree(layout.root, root, ignore=shutil.ignore_patterns("qad_checkpoints", "mlflow.db", "mlruns"))
    return Layout(root), [*overrides, "export.serving_check=skip"]


def command(layout: Layout, overrides: list[str], stage: str) -> list[str]:
    cmd = [sys.executable, "-m", "qad_pipeline", "stage", stage, *([RECIPE] if stage == "ptq" else []),
           "--out-root", str(layout.root)]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def run_to_end(cmd: list[str]) -> float:
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return time.time() - started


@pytest.fixture(scope="module")
def stage_server():
    """The kill test's stage commands are forked from a fork server, as a flow run's stages are
    without a GPU (`qad_pipeline/platform/forkserver.py`): each starts with its imports done, so every
    kill point lands in the stage's work, and the module pays the imports once, not per command."""
    server = forkserver.Server(dict(os.environ), STAGE_ENTRY)
    yield server
    server.close()
    server.proc.wait(timeout=60)


def forked(server, cmd: list[str], log, timeout: float = 900) -> tuple[int | None, float]:
    """Run `cmd` (`python -m qad_pipeline ...`) forked from `server`, its output to `log`; (its exit
    code, or None when it still ran after `timeout` and was killed with SIGKILL; its seconds)."""
    started = time.time()
    pid = server.start(cmd[3:], os.getcwd(), dict(os.environ), str(log))
    ended = server.wait(pid, timeout)
    if ended is None:
        os.kill(pid, signal.SIGKILL)
        server.wait(pid)
        return None, time.time() - started
    return os.waitstatus_to_exitcode(ended[0]), time.time() - started


def forked_to_end(server, cmd: list[str], log) -> float:
    code, seconds = forked(server, cmd, log)
    assert code == 0, log.read_text()[-3000:]
    return seconds


def close(a, b, rtol: float) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], rtol) for k in a)
    if isinstance(a, float):
        return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)
    return a == b


@pytest.mark.parametrize("stage", ["calibration", "ptq", "qad", "export"])
def test_kill_9_then_the_same_command_completes_with_the_same_result(run_copy, stage_server, stage, tmp_path):
    layout, overrides = run_copy
    cmd = command(layout, overrides, stage)
    log = tmp_path / f"{stage}.log"
    shutil.rmtree(layout.qad_checkpoints, ignore_errors=True)
    seconds = forked_to_end(stage_server, cmd, log)  # the uninterrupted result
    expected = result(layout, stage)
    rng = random.Random(f"{SEED}-{stage}")
    rtol = QAD_LOSS_RTOL if stage == "qad" else 1e-9
    outcomes = []
    while sum(o["killed"] for o in outcomes) < POINTS and len(outcomes) < 3 * POINTS:
        shutil.rmtree(layout.qad_checkpoints, ignore_errors=True)  # QAD starts afresh, then resumes
        at = rng.uniform(0.3, 0.95) * seconds  # into the work
        code, took = forked(stage_server, cmd, log, timeout=at)
        killed = code is None
        if not killed:
            assert code == 0, log.read_text()[-3000:]
            seconds = took  # it ran faster than before (less load): aim by this run's time
        if looks_complete(layout, stage):  # killed before it cleared the last result, or after; or not killed
            assert close(expected, result(layout, stage), rtol), f"{stage} killed at {at:.1f}s left a partial output"
        if killed:
            forked_to_end(stage_server, cmd, log)
        got = result(layout, stage)
        assert close(expected, got, rtol), f"{stage} killed at {at:.1f}s: {got} != uninterrupted {expected}"
        assert not list(layout.root.rglob("*.partial")), "a half-written folder was left behind"
        outcomes.append({"kill_at_s": round(at, 1), "killed": killed, "same_result": True})
    assert sum(o["killed"] for o in outcomes) >= POINTS, f"{stage} always finished before its kill point: {outcomes}"
    print(json.dumps({"stage": stage, "uninterrupted_s": round(seconds, 1), "outcomes": outcomes}))


def tree_digest(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def fill_disk(where, leave: int = 0) -> None:
    """Write a file into `where` until only `leave` bytes are free (0: until the disk says it is full)."""
    with open(where / "filler", "wb") as out:
        try:
            while (free := shutil.disk_usage(where).free) > leave:
                out.write(b"\0" * min(free - leave, 2**20))
                out.flush()
        except OSError:
            pass


class TmpfsDisk:
    """A 48 MiB tmpfs (root only): a real disk, filled by a file the test writes."""

    def __init__(self, folder):
        self.folder = folder

    def too_small(self, cmd) -> subprocess.CompletedProcess:
        fill_disk(self.folder, leave=2**20)  # too little room from the start
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        finally:
            (self.folder / "filler").unlink()

    def fills_up(self, cmd, staged: str) -> subprocess.CompletedProcess:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not glob.glob(staged):  # room enough at the start; the disk fills up while the export is written
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        fill_disk(self.folder)
        try:
            out, err = proc.communicate(timeout=900)
        finally:
            (self.folder / "filler").unlink()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class SimulatedDisk:
    """A disk simulated in the stage's process (tests/full_disk.py): any user, no mount."""

    def __init__(self, folder):
        self.folder = folder

    def run(self, cmd, free: int, writable: int) -> subprocess.CompletedProcess:
        assert cmd[1:3] == ["-m", "qad_pipeline"]
        wrapped = [cmd[0], "-m", "tests.full_disk", str(self.folder), str(free), str(writable), *cmd[3:]]
        return subprocess.run(wrapped, capture_output=True, text=True, timeout=900, cwd=PROJECT_ROOT)

    def too_small(self, cmd) -> subprocess.CompletedProcess:
        return self.run(cmd, free=2**20, writable=2**20)

    def fills_up(self, cmd, staged: str) -> subprocess.CompletedProcess:
        return self.run(cmd, free=2**40, writable=2**16)  # the check passes; the first weights file fills it


# A real tmpfs where the tests run as root (CI), the simulated disk elsewhere: nothing is skipped.
# QAD_TEST_DISK=simulated runs the simulated one as root too (tests/test_full_disk.py checks it on CI).
DISK = os.environ.get("QAD_TEST_DISK") or ("tmpfs" if os.geteuid() == 0 else "simulated")


@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / "disk"
    folder.mkdir()
    if DISK == "simulated":
        yield SimulatedDisk(folder)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(folder)], check=True)
    yield TmpfsDisk(folder)
    subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_full_disk_during_export_is_one_line_and_the_previous_export_stays(pipeline_run, small_disk):
    _, source, overrides, _ = pipeline_run
    layout = Layout(small_disk.folder / "run")
    shutil.copytree(source.root, layout.root, ignore=shutil.ignore_patterns("qad_checkpoints", "mlflow.db", "mlruns",
                                                                          "mlartifacts", "ptq"))
    cmd = command(layout, [*overrides, "export.serving_check=skip"], "export")
    previous = tree_digest(layout.export)

    def intact(done, says: str) -> None:
        output = done.stdout + done.stderr
        assert done.returncode == 2, output[-3000:]
        [line] = [ln for ln in output.splitlines() if ln.startswith("error:")]
        assert says in line and "Traceback" not in output, output[-3000:]
        assert tree_digest(layout.export) == previous  # the previous export, byte for byte
        assert not list(layout.root.rglob("*.partial")) and not list(layout.root.rglob(".*.tmp"))

    # refused before anything is written
    intact(small_disk.too_small(cmd), "not enough disk space for the export")
    staged = str(layout.export.parent / ".export.*.partial")
    intact(small_disk.fills_up(cmd, staged), "filled up while the export was written")
    run_to_end(cmd)  # with the space back, the same command completes
    assert read_json(layout.export_metrics)["passed"]
