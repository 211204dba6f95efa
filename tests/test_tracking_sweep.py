"""The BPE sweep in MLflow (qad_pipeline/tracking/sweep_runs.py): its own kind of parent run, a child
per budget, and no run left RUNNING or taken for a pipeline run when logging fails part-way."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from qad_pipeline import tracking
from qad_pipeline.core.config import PROJECT_PARAMS, ConfigError, load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.core.stages import with_sweep
from qad_pipeline.tracking import sweep_runs as tracking_sweep
from qad_pipeline.tracking import write as tracking_write
from tests.tracking_fakes import BROKEN, GOOD, children, logged_run_files, write_sweep


def sweep_params(root: Path):
    """The project's params with a local model folder and two budgets."""
    model_dir = root / "base-model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    return load_params(PROJECT_PARAMS, {"base_model.path": str(model_dir), "sweep.budgets": [5.0, 8.0]})


@pytest.fixture
def store(tmp_path, monkeypatch):
    """(params, layout with a sweep's files started an hour ago, its start in ms, client) on a
    SQLite store in tmp_path."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params, layout, t0 = sweep_params(tmp_path), Layout(tmp_path), time.time() - 3600
    write_sweep(layout, params, t0)
    uri = tracking.tracking_uri(tmp_path)
    return params, layout, int(1000 * t0), MlflowClient(uri, uri)


def experiment_id(client, params) -> str:
    return client.get_experiment_by_name(tracking.experiment_name(params.base_model.path)).experiment_id


def test_a_sweep_is_logged_as_a_sweep_run_with_a_child_per_budget(store):
    params, layout, start_ms, client = store
    run_id = tracking.log_sweep(layout, params, flow_run_id="flow", git_commit="0" * 40, start_ms=start_ms)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.start_time == start_ms
    assert run.data.tags["qad.kind"] == "sweep" and run.info.run_name.startswith("bpe-sweep-")
    assert run.data.tags["knee"] == f"{params.sweep.recipe}@5.0"
    assert run.data.metrics["knee.budget"] == 5.0
    kids = children(client, run_id)
    assert sorted(kids) == ["sweep-5.0", "sweep-8.0"]
    assert all(k.info.status == "FINISHED" and k.data.tags["qad.kind"] == "stage" for k in kids.values())
    assert kids["sweep-8.0"].data.metrics["median_recovery"] == pytest.approx(0.98)
    with pytest.raises(ConfigError, match="holds no qad-pipeline run"):  # a sweep is not a pipeline run
        tracking.latest_pipeline_run(client, experiment_id(client, params))


def test_a_sweep_whose_logging_fails_part_way_ends_failed_and_is_not_the_latest_pipeline_run(store, monkeypatch):
    params, layout, start_ms, client = store
    earlier = tracking.start_pipeline_run(layout, params, flow_run_id=None, git_commit=None,
                                          start_ms=start_ms - 3_600_000)
    client.set_terminated(earlier)
    logged = []

    def second_budget_fails(client, experiment_id, parent_run_id, child):
        if logged:
            raise RuntimeError("the store went away")
        logged.append(tracking_write.log_child(client, experiment_id, parent_run_id, child))
        return logged[-1]

    monkeypatch.setattr(tracking_sweep, "log_child", second_budget_fails)
    with pytest.raises(RuntimeError, match="the store went away"):
        tracking.log_sweep(layout, params, flow_run_id="flow", git_commit=None, start_ms=start_ms)
    exp_id = experiment_id(client, params)
    [sweep] = client.search_runs([exp_id], filter_string="tags.`qad.kind` = 'sweep'")
    assert sweep.info.status == "FAILED"
    assert sweep.info.run_name.startswith("bpe-sweep-") and sweep.info.start_time == start_ms
    assert "the store went away" in sweep.data.tags["qad.logging_error"]
    assert [client.get_run(r).data.tags["mlflow.parentRunId"] for r in logged] == [sweep.info.run_id]
    assert tracking.latest_pipeline_run(client, exp_id).info.run_id == earlier  # not the later, failed sweep
    assert [r.info.run_id for r in client.search_runs([exp_id], "attributes.status = 'RUNNING'")] == []


def test_a_parent_run_whose_start_fails_part_way_ends_failed(store, monkeypatch):
    params, layout, start_ms, client = store

    def store_gone(*args, **kwargs):
        raise RuntimeError("the store went away")

    monkeypatch.setattr(tracking_write, "log_batch", store_gone)  # the configuration, after the run exists
    with pytest.raises(RuntimeError, match="the store went away"):
        tracking.log_sweep(layout, params, flow_run_id=None, git_commit=None, start_ms=start_ms)
    [run] = client.search_runs([experiment_id(client, params)])
    assert run.info.status == "FAILED" and run.data.tags["qad.kind"] == "sweep"


def test_a_run_without_budgets_logs_no_sweep_though_an_old_one_is_on_disk(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params, layout = logged_run_files(tmp_path)
    write_sweep(layout, params, time.time() - 7200)  # an earlier `qad-pipeline sweep`'s files
    swept = params.model_copy(update={"selection": params.selection.model_copy(update={"sweep": "knee"})})
    assert with_sweep(swept)  # budgets and selection.sweep: the sweep's runs are read
    assert {"sweep-5.0", "sweep-8.0", "bpe_sweep"} <= {c.name for c in tracking.read_children(layout, swept)}
    params = swept.model_copy(update={"sweep": swept.sweep.model_copy(update={"budgets": []})})
    assert not with_sweep(params)  # selection.sweep: knee, but no budget: this run did not sweep
    run_id = tracking.log_pipeline(layout, params, flow_run_id=None, git_commit=None)
    client = MlflowClient(tracking.tracking_uri(tmp_path))
    assert set(children(client, run_id)) == {"calibration", "baseline", *(f"ptq-{r}" for r in [*GOOD, BROKEN]),
                                             "selection", "qad", "final_eval", "export"}
    assert "plots/pareto.png" not in [a.path for a in client.list_artifacts(run_id, "plots")]
