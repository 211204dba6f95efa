"""What the flow publishes to Prefect (flows/publish.py), checked against Prefect's temporary test
server: artifact keys per base model, the recipe table with its marker column, the report, and the
flow run tagged with and linked to its MLflow run."""

from __future__ import annotations

import json
import re

import pytest

from flows import publish
from qad_pipeline import tracking
from qad_pipeline.core.config import PROJECT_PARAMS, load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import dump_result
from qad_pipeline.results.run import RunSummary
from tests import samples

ROWS = [{"choice": "", "name": "bf16", "status": "ok", "median rec. %": 100.0, "CI %": ""},
        {"choice": "★ selected", "name": "r1", "status": "ok", "median rec. %": 99.0, "CI %": "97.50–100.30"},
        {"choice": "", "name": "r2", "status": "failed", "median rec. %": None, "CI %": "", "error": "boom"}]


def test_artifact_keys_are_per_base_model_and_valid_prefect_keys():
    keys = [publish.artifact_key("recipe-table", load_params(PROJECT_PARAMS, {"base_model.path": path}))
            for path in ("demo/model", "nvidia/NVIDIA-Nemotron-3_Nano:30B", "/data/ckpts/Llama 3.1")]
    assert keys[0] == "recipe-table-demo-model"
    assert len(set(keys)) == 3
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", k) for k in keys), keys


def test_pipeline_tasks_have_fixed_run_names(tmp_path):
    from flows import runtime
    from qad_pipeline.core.stages import STAGES

    job = runtime.Job(str(PROJECT_PARAMS), [], Layout(tmp_path))
    for stage in STAGES:
        task = runtime.stage_task(job, stage, "r1" if STAGES[stage].per_recipe else None)
        assert task.name == stage
        # no random suffix: the stage's one name (`ptq-<recipe>`, `sweep-<budget>` for a per-item stage)
        assert task.task_run_name == (f"{stage}-r1" if STAGES[stage].per_recipe else stage)


@pytest.mark.slow
def test_flow_run_is_tagged_and_linked_and_artifacts_are_keyed_per_model(tmp_path, monkeypatch):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.testing.utilities import prefect_test_harness

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = load_params(PROJECT_PARAMS, {"base_model.path": "some-org/Some_Model"})
    layout = Layout(tmp_path)
    client = tracking.client_for(tracking.tracking_uri(tmp_path))
    exp = tracking.ensure_experiment(client, tracking.experiment_name(params.base_model.path))
    run_id = client.create_run(exp).info.run_id
    chosen = samples.selection("r1", [], reason="r1 is the most compressed.")
    summary = RunSummary.model_validate({"selection": dump_result(chosen), "recipes": ROWS})

    @flow
    def publishing() -> str:
        publish.link_tracking(layout, params, run_id)
        publish.publish_recipe_table(params, summary)
        publish.publish_report(params, summary)
        from prefect.runtime import flow_run

        return flow_run.id

    with prefect_test_harness(server_startup_timeout=120):
        flow_run_id = publishing()
        with get_client(sync_client=True) as prefect:
            tags = prefect.read_flow_run(flow_run_id).tags
            artifacts = {a.key: a for a in prefect.read_latest_artifacts()}
    assert {"mlflow", f"mlflow-run:{run_id}"} <= set(tags)
    assert set(artifacts) == {"recipe-table-some-org-some-model", "qad-pipeline-report-some-org-some-model",
                              "mlflow-run-some-org-some-model"}
    link = artifacts["mlflow-run-some-org-some-model"]
    assert link.type == "markdown" and f"#/experiments/{exp}/runs/{run_id}" in link.data
    table = artifacts["recipe-table-some-org-some-model"]
    rows = json.loads(table.data)
    assert [r["choice"] for r in rows] == ["", "★ selected", ""]
    assert rows[2]["median rec. %"] == "" and rows[2]["error"] == "boom"  # an empty cell, not null
    assert table.description.startswith("Selected: r1.")
