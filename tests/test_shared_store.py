"""One MLflow tracking server (`mlflow server`, SQLite behind it) and one Prefect server shared by
two pipelines on two base models at the same time, as a platform team runs them, with the MLflow
server going away in the middle of both runs and coming back. Real processes, no mocks.

(One test for both faults: each is two real pipeline runs, minutes on two cores.)"""

import json
import shutil
import subprocess
import time

import pytest

from qad_pipeline import tracking
from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT
from tests.conftest import GOOD_RECIPES, TINY
from tests.devstack import LocalMLflow, LocalPrefect

pytestmark = [pytest.mark.slow, pytest.mark.long]  # ~8 min: `python -m pytest -q -m long tests/test_shared_store.py`

RECIPE = GOOD_RECIPES[0]
ARTIFACT_KINDS = ("recipe-table", "qad-pipeline-report", "mlflow-run")


def command(verb: str, root, overrides: list[str]) -> list[str]:
    cmd = ["qad-pipeline", verb, "--params", str(PROJECT_PARAMS), "--out-root", str(root)]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def pipeline_runs(client, root) -> list:
    """The pipeline (parent) runs logged for one out-root, in any experiment."""
    return client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`qad.out_root` = '{root}' and tags.`qad.kind` = 'pipeline'")


def stage_runs(client, parent) -> dict:
    found = client.search_runs([parent.info.experiment_id],
                               filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    names = [r.info.run_name for r in found]
    assert len(names) == len(set(names)), f"a stage logged twice: {sorted(names)}"
    return {r.info.run_name: r for r in found}


def test_two_pipelines_at_once_into_one_store_that_goes_away_mid_run(tmp_path):
    """Both runs finish without their tracking store; `log-mlflow` (both at once) then completes the
    MLflow run each pipeline started, logging nothing twice; each run's files, MLflow runs,
    registered version and Prefect artifacts are its own."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    models, runs, overrides = {}, {}, {}
    for name in ("alpha", "beta"):
        models[name] = tmp_path / "models" / name
        shutil.copytree(PROJECT_ROOT / "demo" / "model", models[name])
        overrides[name] = [*TINY, f"ptq.recipes=[{RECIPE}]", "selection.policy=qad", "export.serving_check=skip",
                           f"base_model.path={models[name]}"]
    with LocalMLflow(tmp_path / "mlflow") as server, LocalPrefect(tmp_path / "prefect") as prefect:
        env = {**prefect.env, "MLFLOW_TRACKING_URI": server.uri}
        for name in models:
            root = tmp_path / name
            log = (tmp_path / f"{name}.log").open("w")
            runs[name] = (root, subprocess.Popen(command("run", root, overrides[name]), stdout=log,
                                                 stderr=subprocess.STDOUT, env=env))
        deadline = time.time() + 600
        # both pipelines have started their MLflow run (RUNNING): the server goes away
        while not all((root / "artifacts" / "mlflow_run.json").is_file() for root, _ in runs.values()):
            assert all(proc.poll() is None for _, proc in runs.values()), "a run ended early"
            assert time.time() < deadline, "the pipelines never started their MLflow runs"
            time.sleep(0.5)
        server.stop()
        started = {}
        for name, (root, proc) in runs.items():
            output = (tmp_path / f"{name}.log")
            assert proc.wait(timeout=1500) == 0, output.read_text()[-3000:]  # no tracking store needed to finish
            assert "MLflow logging failed" in output.read_text() and "qad-pipeline log-mlflow" in output.read_text()
            started[name] = read_json(root / "artifacts" / "mlflow_run.json")
            assert started[name]["logged"] is False
        server.start()
        logging = {name: subprocess.Popen(command("log-mlflow", root, overrides[name]), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, env=env)
                   for name, (root, _) in runs.items()}  # both at once, into the one store
        for name, proc in logging.items():
            out = proc.communicate(timeout=600)[0]
            assert proc.returncode == 0 and f"completed run {started[name]['run_id']}" in out, out[-3000:]
        with prefect.client() as api:
            flow_runs = {r.parameters["out_root"]: r for r in api.read_flow_runs()
                         if r.parameters.get("out_root") and not r.parent_task_run_id}
            artifacts = {name: api.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
                any_=[flow_runs[str(root)].id]))) for name, (root, _) in runs.items()}

        client = server.client()
        for name, (root, _) in runs.items():
            model = str(models[name])
            assert read_json(root / "metrics" / "baseline.json")["model"]["path"] == model
            assert read_json(root / "metrics" / "export.json")["passed"]
            [parent] = pipeline_runs(client, root)  # the run the pipeline started, completed: not a second one
            assert parent.info.run_id == started[name]["run_id"] and parent.info.status == "FINISHED"
            assert parent.data.tags["base_model.path"] == model and "qad.stale" not in parent.data.tags
            assert client.get_experiment(parent.info.experiment_id).name == f"qad-pipeline/{model}"
            children = stage_runs(client, parent)
            assert set(children) == {"calibration", "baseline", f"ptq-{RECIPE}", "selection", "qad", "final_eval",
                                     "export"}
            assert all(c.info.status == "FINISHED" for c in children.values())
            ptq = read_json(root / "metrics" / "ptq" / f"{RECIPE}.json")
            assert children[f"ptq-{RECIPE}"].data.metrics["median_recovery"] == pytest.approx(ptq["median_recovery"])
            assert children["qad"].data.metrics["final_loss"] == pytest.approx(
                read_json(root / "artifacts" / "qad" / "loss.json")["losses"][-1]["loss"])
            registered = tracking.registered_model_name(model)
            [version] = client.search_model_versions(f"name='{registered}'")
            assert version.run_id == parent.info.run_id
            assert client.get_model_version_by_alias(registered, "candidate").version == version.version
            record = read_json(root / "artifacts" / "mlflow_run.json")
            assert record["run_id"] == parent.info.run_id and record["logged"] and record["model_version"] == "1"
            # Prefect: each flow run published its own artifacts, under keys of its own base model
            assert all(a.key.endswith(f"-models-{name}") for a in artifacts[name]), [a.key for a in artifacts[name]]
            keys = {kind: a for a in artifacts[name] for kind in ARTIFACT_KINDS if a.key.startswith(f"{kind}-")}
            assert len(artifacts[name]) == len(keys) == len(ARTIFACT_KINDS)  # <kind>-<base model path slug>
            rows = keys["recipe-table"].data
            assert [r["name"] for r in (json.loads(rows) if isinstance(rows, str) else rows)] == ["bf16", RECIPE]
            assert f"MLflow run {parent.info.run_id}" in str(keys["mlflow-run"].data)
        assert not {a.key for a in artifacts["alpha"]} & {a.key for a in artifacts["beta"]}

        root = runs["alpha"][0]  # logged whole now: a second log-mlflow adds nothing
        again = subprocess.run(command("log-mlflow", root, overrides["alpha"]), capture_output=True, text=True,
                               env=env, timeout=600)
        assert again.returncode == 0 and "nothing logged" in again.stdout, again.stdout + again.stderr
        [parent] = pipeline_runs(client, root)
        assert len(stage_runs(client, parent)) == 7
        assert len(client.search_model_versions(f"name='{tracking.registered_model_name(str(models['alpha']))}'")) == 1
