"""Logging a pipeline run (qad_pipeline/tracking/runs.py, children.py, write.py): the parent run,
one child run per stage and recipe, their metrics, spans, params and description, read back
through MLflow's own client from a SQLite store in tmp_path."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from qad_pipeline import tracking
from qad_pipeline.core.artifacts import write_json
from qad_pipeline.core.config import ConfigError
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import read_result, write_result
from qad_pipeline.results.export_metrics import ExportMetrics
from qad_pipeline.results.selection_metrics import RecipeRow
from qad_pipeline.tracking.children import ptq_child
from tests import samples
from tests.tracking_fakes import (AWS_SECRET, BROKEN, GOOD, HF_TOKEN, RECIPES, SPANS, build_layout, children, fp,
                                  logged_run_files, logged_store, make_params, markdown_tables, settings_of,
                                  task_scores, touch)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The shared store with two logged pipeline runs (tracking_fakes.logged_store)."""
    return logged_store(tmp_path_factory)


def test_parent_and_one_child_per_stage_and_recipe(logged):
    client, first = logged["client"], logged["runs"][0]
    parent = client.get_run(first["run_id"])
    exp = client.get_experiment(parent.info.experiment_id)
    assert exp.name == f"qad-pipeline/{logged['params'].base_model.path}"
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["qad.kind"] == "pipeline"
    assert parent.data.tags["prefect.flow_run_id"] == "flow-0"
    assert parent.data.tags["mlflow.source.git.commit"] == "0" * 40
    assert parent.data.tags["base_model.path"] == logged["params"].base_model.path
    assert parent.data.tags["base_model.sha256"] == fp("model")
    kids = children(client, first["run_id"])
    assert set(kids) == {"calibration", "baseline", *(f"ptq-{r}" for r in [*GOOD, BROKEN]),
                         "selection", "qad", "final_eval", "export"}
    for name, run in kids.items():
        assert run.data.tags["mlflow.parentRunId"] == first["run_id"]
        assert run.info.status == ("FAILED" if name == f"ptq-{BROKEN}" else "FINISHED"), name
    broken = kids[f"ptq-{BROKEN}"]
    assert broken.data.tags["error"] == first["ptq"][BROKEN]["error"]
    log = Path(client.download_artifacts(broken.info.run_id, f"logs/ptq-{BROKEN}.log")).read_text()
    assert "no_such_algorithm" in log
    good = kids[f"ptq-{GOOD[0]}"]
    scores = first["ptq"][GOOD[0]]
    assert good.info.start_time == int(scores["started_at"] * 1000)
    assert good.info.end_time == int(scores["finished_at"] * 1000)
    assert parent.info.start_time == min(r.info.start_time for r in kids.values())
    # the configuration, flattened with dots, on the parent
    assert parent.data.params["qad.steps"] == "5"
    assert json.loads(parent.data.params["ptq.recipes"]) == [*GOOD, BROKEN]
    assert parent.data.params["selection.band"] == "[0.5, 1.0]"
    # the selection: table + reason as a JSON artifact and as tags
    sel = first["selection"]
    assert parent.data.tags["qad.selected"] == sel["selected"]
    assert parent.data.tags["qad.selection.reason"] == tracking.short_reason(sel["reason"])
    sel_file = client.download_artifacts(kids["selection"].info.run_id, "selection.json")
    logged_sel = json.loads(Path(sel_file).read_text())
    assert logged_sel["table"] == sel["table"]
    report = Path(client.download_artifacts(first["run_id"], "report.txt")).read_text()
    assert report.startswith("report 0: token ") and HF_TOKEN not in report


def test_metrics_equal_the_files(logged):
    client, first = logged["client"], logged["runs"][0]
    kids = children(client, first["run_id"])
    for recipe in GOOD:
        m, expected = kids[f"ptq-{recipe}"].data.metrics, first["ptq"][recipe]
        for key in ("median_recovery", "effective_bpe", "size_bytes", "kl_divergence"):
            assert m[key] == pytest.approx(expected[key]), (recipe, key)
        for task, score in expected["tasks"].items():
            assert m[f"score.{task}"] == pytest.approx(score["value"])
            assert m[f"recovery.{task}"] == pytest.approx(score["recovery"])
    qad = kids["final_eval"].data.metrics
    assert qad["median_recovery"] == pytest.approx(first["qad"]["median_recovery"])
    assert qad["qad_beats_ptq"] == float(first["qad"]["qad_beats_ptq"])
    export = kids["export"].data
    for key in ("size_bytes", "bf16_size_bytes", "size_ratio", "effective_bpe"):
        assert export.metrics[key] == pytest.approx(first["export"][key])
    assert export.metrics["checks.reload.kl_divergence"] == pytest.approx(
        first["export"]["checks"]["reload"]["kl_divergence"])
    assert export.metrics["passed"] == 1.0
    assert export.tags["check.formats"] == export.tags["check.size"] == export.tags["check.reload"] == "passed"
    assert export.tags["check.serving"] == "passed" and export.tags["serving_check"] == "full"
    assert export.metrics["checks.serving.kl_divergence"] == pytest.approx(5e-5)
    assert export.metrics["checks.serving.top1_agreement"] == pytest.approx(0.99)
    cal = kids["calibration"].data.metrics
    assert cal["calibration.samples"] == first["manifest"]["calibration"]["samples"]


def test_loss_curve_is_one_metric_per_step(logged):
    client, first = logged["client"], logged["runs"][0]
    qad_run = children(client, first["run_id"])["qad"]
    history = sorted(client.get_metric_history(qad_run.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, logged["params"].qad.steps + 1))
    assert [m.value for m in history] == pytest.approx([0.5 / s for s in range(1, logged["params"].qad.steps + 1)])
    assert history[0].timestamp <= history[-1].timestamp


def test_datasets_carry_the_manifest_fingerprints(logged):
    client, first = logged["client"], logged["runs"][0]
    manifest = first["manifest"]
    for run_id in (first["run_id"], children(client, first["run_id"])["calibration"].info.run_id):
        inputs = {d.dataset.name: d for d in client.get_run(run_id).inputs.dataset_inputs}
        assert set(inputs) == {"calibration", "eval"}
        for name in ("calibration", "eval"):
            full = manifest[name]["fingerprint"]
            dataset = inputs[name].dataset
            # MLflow stores at most 36 characters of a digest; the full fingerprint is an input tag
            assert dataset.digest == full[:36]
            assert {t.key: t.value for t in inputs[name].tags}["fingerprint"] == full
            assert json.loads(dataset.profile)["fingerprint"] == full
            assert manifest["source"] in dataset.source
        contexts = {name: {t.key: t.value for t in d.tags}["mlflow.data.context"] for name, d in inputs.items()}
        assert contexts == {"calibration": "calibration", "eval": "evaluation"}


def test_stage_runs_span_their_process_times(logged):
    client, first = logged["client"], logged["runs"][0]
    kids = children(client, first["run_id"])
    for stage, (start, end) in SPANS.items():
        run = kids[stage]
        assert run.info.start_time == int(1000 * (first["t0"] + start)), stage
        assert run.info.end_time == int(1000 * (first["t0"] + end)), stage
        assert run.info.end_time - run.info.start_time > 0, stage


def test_stage_span_falls_back_to_the_output_time_when_the_usage_file_is_of_another_run(tmp_path):
    layout = Layout(tmp_path)
    out = tmp_path / "metrics" / "selection.json"
    write_result(out, samples.selection(None, []))
    touch(out, 2_000.0)
    write_json(layout.logs / "selection.usage.json", {"started_at": 1_000.0, "finished_at": 1_001.0})
    assert tracking.stage_span(layout, "selection", out) == (2_000_000, 2_000_000)
    write_json(layout.logs / "selection.usage.json", {"seconds": 30.0})  # an older usage file: no times
    touch(layout.logs / "selection.usage.json", 2_001.0)
    assert tracking.stage_span(layout, "selection", out) == (1_971_000, 2_001_000)


def test_recipe_settings_are_params_of_each_recipe_run(logged):
    client, first = logged["client"], logged["runs"][0]
    kids = children(client, first["run_id"])
    rows = {r["name"]: r for r in first["selection"]["table"]}
    for recipe in GOOD:
        params = kids[f"ptq-{recipe}"].data.params
        assert params["recipe"] == recipe
        assert params == {"recipe": recipe, **{k: str(v) for k, v in rows[recipe]["settings"].items()}}
        for key in ("weight_scale", "mamba_format", "kv_cache", "effective_bpe"):
            assert key in params
        metrics = kids[f"ptq-{recipe}"].data.metrics
        low, high = first["ptq"][recipe]["median_recovery_ci"]
        assert (metrics["median_recovery_ci_low"], metrics["median_recovery_ci_high"]) == pytest.approx((low, high))
        assert metrics["weight_error.median"] == pytest.approx(first["ptq"][recipe]["weight_error"]["median"])


def test_parent_metrics_hold_the_selected_and_the_qad_recovery(logged):
    client, first = logged["client"], logged["runs"][0]
    m = client.get_run(first["run_id"]).data.metrics
    ptq = first["ptq"][first["selection"]["selected"]]
    assert m["selected.median_recovery"] == pytest.approx(ptq["median_recovery"])
    assert (m["selected.median_recovery_ci_low"], m["selected.median_recovery_ci_high"]) == pytest.approx(
        tuple(ptq["median_recovery_ci"]))
    assert m["selected.kl_divergence"] == pytest.approx(ptq["kl_divergence"])
    assert m["selected.effective_bpe"] == pytest.approx(ptq["effective_bpe"])
    qad = first["qad"]
    assert m["qad.median_recovery"] == pytest.approx(qad["median_recovery"])
    assert (m["qad.median_recovery_ci_low"], m["qad.median_recovery_ci_high"]) == pytest.approx(
        tuple(qad["median_recovery_ci"]))
    assert m["qad.kl_divergence"] == pytest.approx(qad["kl_divergence"])
    # the delivered model's numbers under the recipe runs' own keys: one runs-table column for all
    assert m["median_recovery"] == pytest.approx(qad["median_recovery"])
    assert m["median_recovery_ci_low"] == pytest.approx(qad["median_recovery_ci"][0])
    assert m["effective_bpe"] == pytest.approx(first["export"]["effective_bpe"])


def test_run_description_is_markdown_with_tables_and_the_full_reason_is_an_artifact(logged):
    client, first = logged["client"], logged["runs"][0]
    parent = client.get_run(first["run_id"])
    note = parent.data.tags["mlflow.note.content"]
    headline, recipes = markdown_tables(note)
    assert [len(r) for r in headline] == [6] * 3  # header, selected PTQ, QAD
    assert headline[1][1] == first["selection"]["selected"]
    assert headline[2][2] == f"{100 * first['qad']['median_recovery']:.2f}"  # rounded, not 0.98765432
    assert len({len(r) for r in recipes}) == 1 and len(recipes) == 1 + 1 + 3  # header, bf16, recipes
    assert f"{BROKEN} FAILED" in note and "★ selected" in note
    reason = first["selection"]["reason"]
    assert len(reason) > 300 and len(parent.data.tags["qad.selection.reason"]) < 300
    logged_reason = Path(client.download_artifacts(first["run_id"], "selection_reason.txt")).read_text()
    assert logged_reason == reason
    report = Path(client.download_artifacts(first["run_id"], "report.md")).read_text()
    assert len(markdown_tables(report)) >= 3


def test_an_alias_recipe_run_has_the_metrics_of_the_recipe_it_equals_and_no_duration(tmp_path):
    params = make_params(tmp_path, tmp_path)
    layout = Layout(tmp_path)
    ran, alias = GOOD[0], "nvfp4_max-mamba_w4a16-kv_fp8"
    write_result(layout.ptq_metrics(ran), samples.recipe_metrics(
        ran, task_scores(RECIPES[ran][0]), 0.98, median_recovery_ci=(0.97, 0.99), effective_bpe=4.75,
        started_at=1000.0, finished_at=1030.0))
    write_result(layout.selection_metrics, samples.selection(None, []))
    row = RecipeRow(alias, "alias", alias_of=ran, settings=settings_of(alias, 4.75))
    child = ptq_child(layout, params, alias, row)
    assert child.status == "FINISHED" and child.tags["alias_of"] == ran
    assert child.metrics["median_recovery"] == 0.98 and child.metrics["median_recovery_ci_high"] == 0.99
    assert child.params["mamba_format"] == "w4a16" and child.start_ms == child.end_ms


def test_a_logging_cut_short_is_completed_and_nothing_is_logged_twice(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params, layout = logged_run_files(tmp_path)
    uri = tracking.tracking_uri(tmp_path)
    client = MlflowClient(uri, uri)
    run_id = tracking.start_pipeline_run(layout, params, flow_run_id="flow", git_commit="0" * 40)
    tracking.record_run(layout, uri, run_id, logged=False)
    tracking.log_pipeline(layout, params, flow_run_id="flow", git_commit="0" * 40, run_id=run_id)
    before = children(client, run_id)
    # the store went away while the export's child run was being logged: not complete, parent not ended
    cut = before["export"].info.run_id
    client.delete_tag(cut, "qad.complete")
    client.update_run(cut, status="FAILED")
    client.update_run(run_id, status="RUNNING")
    record = tracking.recorded_run(layout, uri)
    assert record is not None and record.run_id == run_id and not record.logged

    assert tracking.log_pipeline(layout, params, flow_run_id=None, git_commit="0" * 40, run_id=run_id) == run_id
    after = children(client, run_id)
    assert after.keys() == before.keys()  # one child per stage and recipe, none twice
    assert {n: r.info.run_id for n, r in after.items() if n != "export"} == \
        {n: r.info.run_id for n, r in before.items() if n != "export"}  # the complete ones were kept
    assert after["export"].info.run_id != cut and client.get_run(cut).info.lifecycle_stage == "deleted"
    assert after["export"].info.status == "FINISHED" and client.get_run(run_id).info.status == "FINISHED"
    name = tracking.registered_model_name(params.base_model.path)
    versions = [tracking.register_export(layout, params, run_id) for _ in range(2)]
    assert versions == ["1", "1"] and len(client.search_model_versions(f"name='{name}'")) == 1
    pipeline_runs = client.search_runs([client.get_run(run_id).info.experiment_id],
                                       filter_string="tags.`qad.kind` = 'pipeline'")
    assert [r.info.run_id for r in pipeline_runs] == [run_id]


def test_failed_export_is_a_failed_run_and_is_not_registered(logged, tmp_path, monkeypatch):
    uri, client = logged["uri"], logged["client"]
    # logged into the shared store, whose database test_secrets_never_reach_params_tags_or_artifacts
    # reads: the secrets that make_params puts in are the environment's, as when `logged` logged
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    params = make_params(tmp_path, model_dir)
    layout = build_layout(tmp_path, params, time.time() - 100)
    export = read_result(layout.export_metrics, ExportMetrics)
    export.checks["size"]["passed"] = False
    export.passed = False
    write_result(layout.export_metrics, export)
    run_id = tracking.log_pipeline(layout, params, flow_run_id=None, git_commit=None, uri=uri)
    assert client.get_run(run_id).info.status == "FAILED"
    run = children(client, run_id)["export"]
    assert run.info.status == "FAILED" and run.data.tags["check.size"] == "FAILED"
    assert "size" in run.data.tags["error"]
    with pytest.raises(ConfigError, match="did not pass its checks"):
        tracking.register_export(layout, params, run_id, uri=uri)
