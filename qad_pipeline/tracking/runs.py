"""Logging one pipeline run: the parent run (configuration, identity, provenance, headline
metrics, description) and one child run per stage and recipe, read from the files."""

from __future__ import annotations

import json
from typing import Any

from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.core.redaction import redact_text
from qad_pipeline.reporting.report import read_summary, report_markdown, run_description
from qad_pipeline.results.base import dump_result, read_result, write_result
from qad_pipeline.results.export_metrics import ExportMetrics
from qad_pipeline.results.run import TrackingRecord
from qad_pipeline.results.scores import BaselineMetrics
from qad_pipeline.results.selection_metrics import SelectionResult
from qad_pipeline.core.stages import (CALIBRATION, EXPORT, FINAL_EVAL, RECIPES, SELECTION, STAGES, SWEEPING, planned,
                                 with_sweep)
from qad_pipeline.tracking.children import REASON_FILE, SHORT_REASON, ChildRun, read_children, result_file
from qad_pipeline.tracking.datasets import log_inputs
from qad_pipeline.tracking.stale import mark_stale_runs
from qad_pipeline.tracking.store import NOTE, STALE, client_for, tracking_uri
from qad_pipeline.tracking.write import end_quietly, log_batch, log_children, log_files, start_parent_run

HEADLINE = ("median_recovery", "median_recovery_ci_low", "median_recovery_ci_high", "kl_divergence",
            "effective_bpe", "weight_error.median", "size_bytes")


def start_pipeline_run(layout: Layout, params: Params, *, flow_run_id: str | None, git_commit: str | None,
                       uri: str | None = None, start_ms: int | None = None) -> str:
    """Create the parent run of one pipeline run (RUNNING): configuration, identity, provenance.

    Call it when the flow starts to have the run visible while it runs, then hand its id to
    `log_pipeline(..., run_id=...)` at the end; `log_pipeline` calls it itself otherwise.
    """
    return start_parent_run(layout, params, kind="pipeline", prefix="pipeline-", flow_run_id=flow_run_id,
                            git_commit=git_commit, uri=uri, start_ms=start_ms)


def _checkpoint_identity(layout: Layout, params: Params) -> dict:
    """The base checkpoint's path, revision and sha256, as the baseline stage recorded it; when
    there is no baseline yet, `checkpoint_identity` of the configured model (hashes a local folder)."""
    baseline = read_result(layout.baseline_metrics, BaselineMetrics, missing_ok=True)
    if baseline is not None and baseline.model.path:
        return dump_result(baseline.model)
    try:
        from qad_pipeline.core.modeling import checkpoint_identity

        return checkpoint_identity(params.base_model)
    except ConfigError:
        return {"path": params.base_model.path, "revision": params.base_model.revision, "sha256": "unavailable"}


def headline_metrics(children: list[ChildRun], selected: str | None) -> dict[str, float]:
    """The parent run's metrics, so the runs table compares pipeline runs at a glance.

    `selected.*`: the selected recipe's PTQ run (recovery, its interval, KL, bits, weight error);
    `qad.*`: the final eval of the QAD model (recovery, interval, KL, PTQ's recovery);
    `export.*`: the exported checkpoint (bits, size); and unprefixed `median_recovery`,
    `median_recovery_ci_low/high`, `kl_divergence`, `effective_bpe`: those of the model the run
    delivers (QAD's when it ran, else the selected PTQ recipe's), the same keys the recipe runs have.
    """
    by_stage = {c.stage: c for c in children if c.stage != RECIPES.name}
    chosen = next((c for c in children if c.stage == RECIPES.name and c.recipe == selected), None)
    out: dict[str, float] = {}
    if chosen is not None:
        out.update({f"selected.{k}": chosen.metrics[k] for k in HEADLINE if k in chosen.metrics})
        out.update({k: chosen.metrics[k] for k in HEADLINE[:5] if k in chosen.metrics})
    if FINAL_EVAL.name in by_stage:
        final = by_stage[FINAL_EVAL.name].metrics
        keep = (*HEADLINE[:4], "ptq_median_recovery")
        out.update({f"qad.{k}": final[k] for k in keep if k in final})
        out.update({k: final[k] for k in HEADLINE[:4] if k in final})
        for k in HEADLINE[1:3]:  # an interval from the selected recipe must not stand beside QAD's recovery
            if k not in final:
                out.pop(k, None)
    if EXPORT.name in by_stage:
        export = by_stage[EXPORT.name].metrics
        out.update({f"export.{k}": export[k] for k in ("effective_bpe", "size_bytes", "size_ratio", "passed")
                    if k in export})
        if "effective_bpe" in export:
            out["effective_bpe"] = export["effective_bpe"]
    return out


def pipeline_status(layout: Layout, params: Params) -> tuple[str, str]:
    """(MLflow status, why) of a pipeline run, judged from which files exist.

    FINISHED when the flow reached its end: selection chose nothing (the report says why),
    nothing was to be exported, or the export (of the QAD student, or with ptq_final of the
    selected recipe) passed its checks. Otherwise FAILED, naming the first stage whose result is
    missing.
    """
    if not layout.selection_metrics.is_file():
        missing = next(s for s in STAGES if STAGES[s].result and not STAGES[s].gated_by(SWEEPING)
                       and not result_file(layout, s).is_file())
        return "FAILED", f"no result from {missing}"
    selection = read_result(layout.selection_metrics, SelectionResult)
    if selection.selected is None:
        return "FINISHED", "no recipe selected: " + selection.reason
    for stage in (declared.name for declared, _ in planned(params) if declared.after_selection and declared.result):
        if not result_file(layout, stage).is_file():
            return "FAILED", f"no result from {stage}"
    if params.export.source == "none":
        return "FINISHED", "nothing exported (export.source none)"
    if not read_result(layout.export_metrics, ExportMetrics).passed:
        return "FAILED", "export verification failed"
    return "FINISHED", "exported"


def log_pipeline(layout: Layout, params: Params, *, flow_run_id: str | None, git_commit: str | None,
                 report: str | None = None, uri: str | None = None, run_id: str | None = None,
                 status: str | None = None) -> str:
    """Log one pipeline run from its files; returns the parent run's id.

    Creates the parent run (or completes `run_id`: one from `start_pipeline_run`, or one an
    earlier logging left incomplete), one child per stage and recipe whose files exist (see
    `read_children`; children already logged whole are not logged again), logs the datasets, the
    selection, the report text and headline metrics on the parent and ends it with `status`
    (default: judged from the files by `pipeline_status`). Runs left RUNNING by a killed earlier
    logger of this host are marked first (`mark_stale_runs`).
    """
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    uri = uri or tracking_uri(layout.root)
    client = client_for(uri)
    mark_stale_runs(uri, keep=(run_id,) if run_id else ())
    children = read_children(layout, params)
    if run_id is None:
        first = min((c.start_ms for c in children), default=None)
        run_id = start_pipeline_run(layout, params, flow_run_id=flow_run_id, git_commit=git_commit, uri=uri,
                                    start_ms=first)
    parent = client.get_run(run_id)
    try:
        child_ids = log_children(client, parent, children)
        by_stage = {c.stage: c for c in children}
        log_inputs(client, run_id, by_stage[CALIBRATION.name].datasets if CALIBRATION.name in by_stage else [])

        derived_status, why = pipeline_status(layout, params)
        tags: dict[str, Any] = {"qad.result": why, "qad.children": json.dumps(child_ids),
                                **{f"base_model.{k}": v for k, v in _checkpoint_identity(layout, params).items()}}
        if SELECTION.name in by_stage:
            sel = by_stage[SELECTION.name]
            tags.update({"qad.selected": sel.tags["selected"], "qad.policy": sel.tags["policy"],
                         "qad.runner_up": sel.tags.get("runner_up"), "qad.selection.reason": sel.tags["reason"]})
            log_files(client, run_id, {"selection.json": sel.dicts["selection.json"]},
                       {REASON_FILE: sel.texts[REASON_FILE]})
        metrics = headline_metrics(children, tags.get("qad.selected"))
        tags[NOTE] = f"**Result:** {why if len(why) <= SHORT_REASON else why[:SHORT_REASON] + ' …'}\n"
        if SELECTION.name in by_stage and layout.baseline_metrics.is_file():
            summary = read_summary(layout, params)
            tags[NOTE] += "\n" + run_description(summary, reason_file=REASON_FILE, max_chars=MAX_TAG_VAL_LENGTH - 500)
            client.log_text(run_id, redact_text(report_markdown(summary)), "report.md")
        if report:
            client.log_text(run_id, redact_text(report), "report.txt")
        pareto = layout.bpe_plot  # the BPE sweep's, when the run swept first
        for png in [*sorted((layout.metrics / "plots").glob("*.png")),
                    *([pareto] if with_sweep(params) and pareto.is_file() else [])]:
            client.log_artifact(run_id, str(png), "plots")
        end_ms = max([c.end_ms for c in children] + [parent.info.start_time or 0])
        log_batch(client, run_id, tags=tags, metrics=metrics, timestamp_ms=end_ms)
        if STALE in parent.data.tags:  # ended by mark_stale_runs while its logging was cut short: complete now
            client.delete_tag(run_id, STALE)
    except BaseException as err:
        end_quietly(client, run_id, "FAILED", err)
        raise
    client.set_terminated(run_id, status or derived_status, end_time=end_ms)
    return run_id


def record_run(layout: Layout, uri: str, run_id: str, *, logged: bool, model_version: str | None = None) -> None:
    """Write which run holds this out-root's pipeline run (`Layout.tracking_record`)."""
    write_result(layout.tracking_record, TrackingRecord(uri=redact_text(uri), run_id=run_id, logged=logged,
                                                        model_version=model_version))


def recorded_run(layout: Layout, uri: str) -> TrackingRecord | None:
    """The recorded run of this out-root in the store `uri`, if it is recorded and still there."""
    from mlflow.exceptions import MlflowException

    record = read_result(layout.tracking_record, TrackingRecord, missing_ok=True)
    if record is None or record.uri != redact_text(uri):
        return None
    try:
        run = client_for(uri).get_run(record.run_id)
    except MlflowException:
        return None
    return record if run.info.lifecycle_stage == "active" else None
