"""The fork server (qad_pipeline/platform/forkserver.py): a stage forked from it ends, reports and is
stopped as a fresh `python -m qad_pipeline stage ...` process would be.

The flows' own tests run every stage through it (it is on wherever there is no GPU); the pool
workers' one-stage flow runs (`tests/test_deployments.py`) start fresh processes."""

import os
import signal
import time

import pytest

from flows.stage_process import STAGE_ENTRY
from qad_pipeline.core.config import PROJECT_PARAMS
from qad_pipeline.platform import forkserver
from qad_pipeline.platform.runlock import TOKEN_ENV
from tests.conftest import TINY


@pytest.fixture(scope="module")
def server():
    server = forkserver.Server({**os.environ, "HF_HUB_OFFLINE": "1"}, STAGE_ENTRY)
    yield server
    server.close()
    assert server.proc.wait(timeout=30) == 0


def run(server, argv, cwd, log, until=None):
    """Start `qad-pipeline <argv>`; call `until(pid)` while it runs; (exit code, peak RSS in KiB)."""
    pid = server.start(argv, str(cwd), {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, str(log))
    if until:
        until(pid)
    ended = server.wait(pid, timeout=300)
    assert ended is not None, f"qad-pipeline {' '.join(argv)} did not end: {log.read_text()[-2000:]}"
    return os.waitstatus_to_exitcode(ended[0]), ended[1]


def test_exit_codes_and_output_are_a_fresh_process(server, tmp_path):
    log = tmp_path / "help.log"
    log.write_text("kept\n")
    code, peak_kb = run(server, ["--help"], tmp_path, log)
    assert code == 0 and peak_kb > 100 * 1024
    assert log.read_text().startswith("kept\n") and "Usage: qad-pipeline" in log.read_text()  # appended to
    code, _ = run(server, ["stage", "no_such_stage"], tmp_path, tmp_path / "bad.log")
    assert code == 2 and "no_such_stage" in (tmp_path / "bad.log").read_text()


def test_a_stage_shows_its_command_leads_its_group_and_cleans_up_on_sigterm(server, tmp_path):
    """What `processes.stop_all` and a user's `ps` rely on: the stage's own process group and
    command line; SIGTERM to the group ends it through its cleanup (exit code 143, no partial folder)."""
    log = tmp_path / "calibration.log"
    argv = ["stage", "calibration", "--params", str(PROJECT_PARAMS), "--out-root", str(tmp_path / "run")]
    for item in TINY:
        argv += ["--set", item]
    seen = {}

    def stop_at_work(pid):
        deadline = time.time() + 120
        while not log.is_file() or log.stat().st_size == 0:  # at work: its first line
            assert time.time() < deadline, log.read_text()[-2000:]
            time.sleep(0.02)
        seen["cmdline"] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        seen["group"] = os.getpgid(pid)
        os.killpg(pid, signal.SIGTERM)
        seen["pid"] = pid

    code, _ = run(server, argv, tmp_path, log, until=stop_at_work)
    assert " -m qad_pipeline stage calibration --params " in seen["cmdline"], seen
    assert seen["group"] == seen["pid"]
    assert code == 128 + signal.SIGTERM, log.read_text()[-2000:]  # at its first line it has work left
    assert not list((tmp_path / "run").rglob("*.partial"))


def test_a_new_environment_gets_a_new_server_and_per_stage_variables_do_not():
    first = forkserver.server_for({"PATH": os.environ["PATH"], "HF_HUB_OFFLINE": "1", TOKEN_ENV: "a"}, STAGE_ENTRY)
    try:
        assert forkserver.server_for({"PATH": os.environ["PATH"], "HF_HUB_OFFLINE": "1", TOKEN_ENV: "b",
                                      "OMP_NUM_THREADS": "1"}, STAGE_ENTRY) is first
        second = forkserver.server_for({"PATH": os.environ["PATH"], "HF_HUB_OFFLINE": "0"}, STAGE_ENTRY)
        assert second is not first and forkserver._servers == [second]
        assert first.proc.stdin.closed  # its requests closed: it ends once its stages have
        assert TOKEN_ENV not in second.env and second.env["HF_HUB_OFFLINE"] == "0"
    finally:  # neither is needed past this point: no import of theirs is waited for
        for server in {first, *forkserver._servers}:
            server.proc.kill()
            server.proc.wait()
        forkserver._servers.clear()


def test_switched_off_by_its_variable(monkeypatch):
    monkeypatch.setenv(forkserver.SWITCH, "0")
    assert not forkserver.usable()
    monkeypatch.setenv(forkserver.SWITCH, "1")
    assert forkserver.usable()  # no CUDA device here


def test_a_server_that_cannot_import_says_so_at_the_first_start(tmp_path):
    """Its error goes to the caller's stderr; `start` raises, and the flow then starts a fresh process."""
    entry = forkserver.Entry(function="qad_pipeline.cli:app", prog_name="qad-pipeline", title=("qad-pipeline",),
                             preload=("no_such_module_here",))
    server = forkserver.Server(dict(os.environ), entry)
    with pytest.raises(forkserver.ServerEnded, match="exit code 1"):
        server.start(["--help"], str(tmp_path), dict(os.environ), str(tmp_path / "log"))
