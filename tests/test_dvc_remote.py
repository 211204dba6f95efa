"""A run's outputs pushed to a DVC remote on an S3-API server and pulled back on a "workstation".

The server is moto's, in server mode (`python -m moto.server`: S3 over HTTP on localhost), a
process of its own, as DVC's own tests run it; DVC reaches it through dvc-s3 with the endpoint in
the run's `.dvc/config` and the keys only in the environment.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from qad_pipeline.platform import dvc_remote
from qad_pipeline.core.config import PROJECT_PARAMS, ConfigError, load_params
from qad_pipeline.core.remote_config import RemoteParams
from qad_pipeline.core.stages import STAGES
from tests.devstack import free_port, tool_env

KEYS = {"AWS_ACCESS_KEY_ID": "qad-test-key", "AWS_SECRET_ACCESS_KEY": "qad-test-secret", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free port; yields its endpoint URL. The AWS keys are in the environment
    of this process (and so of the `dvc` processes it starts) while it runs."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
    pytest.importorskip("dvc_s3", reason="dvc-s3 is not installed (pip install 'dvc[s3]')")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=tool_env())
    with pytest.MonkeyPatch.context() as env:
        for key, value in KEYS.items():
            env.setenv(key, value)
        try:
            deadline = time.time() + 60
            while True:
                try:
                    httpx.get(f"{endpoint}/moto-api/", timeout=2)
                    break
                except httpx.HTTPError:
                    assert server.poll() is None and time.time() < deadline, "moto's S3 server did not start"
                    time.sleep(0.2)
            yield endpoint
        finally:
            server.terminate()
            server.wait(10)


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)


def digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def workstation_pull(run: Path, dest: Path, *targets: str) -> subprocess.CompletedProcess:
    """What infra/README.md tells a workstation to do: copy the run's `.dvc/config` and `*.dvc`
    files (no data), then `dvc pull` the targets."""
    (dest / ".dvc").mkdir(parents=True)
    shutil.copy(run / ".dvc" / "config", dest / ".dvc" / "config")
    for pointer in run.rglob("*.dvc"):
        if pointer.is_file() and ".dvc" not in pointer.relative_to(run).parts[:-1]:
            (dest / pointer.relative_to(run)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(pointer, dest / pointer.relative_to(run))
    return subprocess.run(["dvc", "pull", *targets], cwd=dest, capture_output=True, text=True, env=tool_env())


def test_bad_remotes_are_refused_in_one_line(monkeypatch):
    params = load_params(PROJECT_PARAMS)
    monkeypatch.setenv("QAD_DVC_REMOTE", "s3://qad-dvc/runs")
    monkeypatch.setenv("QAD_DVC_ENDPOINT_URL", "minio:9000")
    with pytest.raises(ConfigError, match=r"^QAD_DVC_ENDPOINT_URL='minio:9000': 'minio:9000' is not an http"):
        dvc_remote.remote_for(params)
    monkeypatch.setenv("QAD_DVC_ENDPOINT_URL", "http://minio:9000")
    assert dvc_remote.remote_for(params) == RemoteParams(url="s3://qad-dvc/runs", endpoint_url="http://minio:9000")
    # the params' own remote comes first; a bad one is refused when params.yaml is loaded
    given = load_params(PROJECT_PARAMS, ["versioning.remote={url: /srv/dvc-remote, push: false}"])
    assert dvc_remote.remote_for(given) == RemoteParams(url="/srv/dvc-remote", push=False)
    with pytest.raises(ConfigError, match=r"versioning.remote.url = 'S3://Runs': .* is not s3://<bucket>"):
        load_params(PROJECT_PARAMS, ["versioning.remote={url: S3://Runs}"])
    monkeypatch.delenv("QAD_DVC_REMOTE")
    with pytest.raises(ConfigError, match=r"^no DVC remote configured"):
        dvc_remote.push_remote(params, Path("/nonexistent"))


def fake_run(root: Path) -> list[tuple[str, str | None]]:
    """A finished run's folder in miniature: the declared outputs of calibration, one recipe and the
    export, with a few bytes each; returns the (stage, item) pairs that "ran"."""
    files = {"artifacts/calibration/manifest.json": b'{"samples": 4}', "artifacts/ptq/r1/checkpoint/model.safetensors":
             os.urandom(4096), "artifacts/ptq/r1/scores.json": b"{}", "artifacts/export/model.safetensors": os.urandom(8192),
             "artifacts/export/config.json": b'{"quantization_config": {"quant_algo": "NVFP4"}}',
             "metrics/export.json": b'{"passed": true}', "artifacts/ptq/r2/partial.bin": b"a failed recipe's leftovers"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return [("calibration", None), ("ptq", "r1"), ("export", None)]


def mlflow_run(root: Path) -> tuple[str, str]:
    """An ended MLflow run in the run folder's own store, recorded as the run's (as the flow does)."""
    from qad_pipeline import tracking
    from qad_pipeline.core.layout import Layout

    uri = tracking.tracking_uri(root)
    client = tracking.client_for(uri)
    run_id = client.create_run(client.create_experiment("qad-pipeline/test")).info.run_id
    client.set_terminated(run_id)
    tracking.record_run(Layout(root), uri, run_id, logged=True)
    return uri, run_id


@pytest.mark.slow  # ~20 s: a dozen `dvc` processes, the CLI, MLflow's
def test_push_fails_then_the_cli_retries_and_a_workstation_pulls_through_mlflow(s3, tmp_path, monkeypatch):
    run = tmp_path / "runs" / "demo-model-1a2b"
    ran = fake_run(run)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri, run_id = mlflow_run(run)
    remote = RemoteParams(url="s3://qad-dvc/runs", endpoint_url=s3)

    # the bucket does not exist yet: the push fails, says so and how to retry; nothing is lost
    done, line = dvc_remote.after_run(run, PROJECT_PARAMS, [], ran, remote)
    assert not done and "the push to DVC remote s3://qad-dvc/runs FAILED" in line
    assert f"retry with `qad-pipeline push --out-root {run}`" in line
    assert (run / "artifacts/export/model.safetensors").is_file()

    make_bucket(s3, "qad-dvc")
    env = {**tool_env(), "QAD_DVC_REMOTE": "s3://qad-dvc/runs", "QAD_DVC_ENDPOINT_URL": s3}  # as on the cluster
    retry = subprocess.run(["qad-pipeline", "push", "--out-root", str(run), "--params", str(PROJECT_PARAMS)],
                           capture_output=True, text=True, env=env)
    assert retry.returncode == 0, retry.stderr + retry.stdout
    assert "pushed to DVC remote s3://qad-dvc/runs" in retry.stdout
    assert f"DVC pointer files are in MLflow run {run_id} under dvc/" in retry.stdout
    config = (run / ".dvc" / "config").read_text()
    assert "s3://qad-dvc/runs" in config and s3 in config and "qad-test" not in config  # no key written

    # only the outputs of what ran are tracked: not the failed recipe's leftovers
    assert [p.as_posix() for p in dvc_remote.pointer_files(run)] == [
        ".dvc/config", "artifacts/calibration.dvc", "artifacts/export.dvc", "artifacts/ptq/r1.dvc",
        "metrics/export.json.dvc"]

    # a workstation: the pointers from MLflow, the data from the bucket (infra/README.md, "DVC on the cluster")
    desk = tmp_path / "workstation"
    got = subprocess.run(["mlflow", "artifacts", "download", "--run-id", run_id, "--artifact-path", "dvc",
                          "--dst-path", str(desk)], capture_output=True, text=True,
                         env={**tool_env(), "MLFLOW_TRACKING_URI": uri})
    assert got.returncode == 0, got.stderr
    pulled = subprocess.run(["dvc", "pull", "artifacts/export.dvc", "metrics/export.json.dvc"], cwd=desk / "dvc",
                            capture_output=True, text=True, env=tool_env())
    assert pulled.returncode == 0, pulled.stderr
    assert digests(desk / "dvc/artifacts/export") == digests(run / "artifacts/export")
    assert (desk / "dvc/metrics/export.json").read_bytes() == (run / "metrics/export.json").read_bytes()
    assert not (desk / "dvc/artifacts/ptq/r1").exists()  # what was not asked for stays in the bucket

    # the same folder run again, r1 cleared and failed this time: its old pointer goes, the rest is pushed again
    shutil.rmtree(run / "artifacts/ptq/r1")
    done, line = dvc_remote.after_run(run, PROJECT_PARAMS, [], [("calibration", None), ("export", None)], remote)
    assert done and "pushed to DVC remote" in line, line
    assert "artifacts/ptq/r1.dvc" not in [p.as_posix() for p in dvc_remote.pointer_files(run)]


def test_ran_on_disk_reads_the_items_a_run_left(tmp_path):
    fake_run(tmp_path)
    found = dvc_remote.ran_on_disk(tmp_path)
    assert set(found) == {("calibration", None), ("ptq", "r1"), ("export", None)}  # not r2: no scores, no checkpoint
    assert set(dvc_remote.run_outputs(tmp_path, found)) == {
        "artifacts/calibration", "artifacts/ptq/r1", "artifacts/export", "metrics/export.json"}
    assert all(name in STAGES for name, _ in found)


def test_a_flow_runs_outputs_pushed_and_its_export_pulled_back(pipeline_run, s3, tmp_path):
    """The session's flow run (tests/conftest.py; no remote configured): its post-run step said so;
    then the same step on a copy of its folder, with a remote, pushes exactly the declared outputs
    of the stages that completed, and a workstation pulls the export back, byte for byte."""
    from tests.conftest import BROKEN_RECIPE, GOOD_RECIPES

    summary, layout, overrides, _ = pipeline_run
    assert "no DVC remote configured (versioning.remote)" in summary["dvc"], summary["dvc"]
    assert not (layout.root / ".dvc").exists()  # without a remote the run's folder is left as it is
    run = tmp_path / "run"
    for folder in ("artifacts", "metrics"):
        shutil.copytree(layout.root / folder, run / folder)
    ran = [(name, item or None) for name, _, item in (key.partition("/") for key in summary["seconds"])
           if name in STAGES]
    assert ("export", None) in ran and ("ptq", BROKEN_RECIPE) not in ran

    make_bucket(s3, "qad-runs")
    done, line = dvc_remote.after_run(run, PROJECT_PARAMS, overrides, ran,
                                      RemoteParams(url="s3://qad-runs/cluster", endpoint_url=s3))
    assert done, line
    tracked = {p.as_posix().removesuffix(".dvc") for p in dvc_remote.pointer_files(run)[1:]}
    assert tracked == set(dvc_remote.run_outputs(run, ran))
    assert {"artifacts/calibration", "artifacts/baseline", "artifacts/qad", "artifacts/export", "metrics/export.json",
            *(f"artifacts/ptq/{name}" for name in GOOD_RECIPES)} <= tracked
    assert f"artifacts/ptq/{BROKEN_RECIPE}" not in tracked

    desk = tmp_path / "workstation"
    pulled = workstation_pull(run, desk, "artifacts/export.dvc")
    assert pulled.returncode == 0, pulled.stderr
    assert digests(desk / "artifacts/export") == digests(layout.root / "artifacts/export")
    assert any(name.endswith(".safetensors") for name in digests(desk / "artifacts/export"))
