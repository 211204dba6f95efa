"""What a run shows besides its task runs: in Prefect, the recipe table, the report and the link
to the run's MLflow run, as artifacts keyed per base model, and the flow run's tags; in MLflow,
the parent run opened at the start (`start_tracking`) and everything logged at the end (`track`).

Prefect artifact keys are lowercase letters, digits and dashes, and a key is shared by every flow
run that publishes it (the Artifacts page shows its latest version); so each key ends in the base
model's slug (`recipe-table-demo-model`) and one base model's run does not replace another's.
"""

from __future__ import annotations

import os

from prefect import get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from flows.runtime import flow_run_id
from qad_pipeline import tracking
from qad_pipeline.core.layout import Layout
from qad_pipeline.reporting.report import report_markdown
from qad_pipeline.results.run import RunSummary


def artifact_key(name: str, params) -> str:
    """`<name>-<base model slug>`, e.g. `recipe-table-demo-model` for base_model.path demo/model:
    the registered model's name (`registered_model_name`) folded into a valid Prefect key."""
    stem = tracking.registered_model_name(params.base_model.path).removesuffix(tracking.MODEL_SUFFIX)
    words = "".join(c if c.isascii() and c.isalnum() else "-" for c in stem.lower()).split("-")
    return f"{name}-{'-'.join(w for w in words if w)}"[:200].rstrip("-")


def publish_recipe_table(params, summary: RunSummary) -> None:
    """The recipe table (`report.recipe_rows`): an empty cell, not "null", where a value is missing."""
    chosen = summary.selection
    rows = [{k: "" if v is None else v for k, v in r.items()} for r in summary.recipes]
    create_table_artifact(key=artifact_key("recipe-table", params), table=rows,
                          description=f"Selected: {chosen.selected or 'none'}. {chosen.reason}")


def publish_report(params, summary: RunSummary) -> None:
    create_markdown_artifact(key=artifact_key("qad-pipeline-report", params), markdown=report_markdown(summary))


def link_tracking(layout: Layout, params, run_id: str) -> None:
    """Tag the flow run with its MLflow run (`mlflow`, `mlflow-run:<id>`), publish a link to that
    run (`mlflow-run-<slug>`), and tag the MLflow run with the flow run's page
    (`prefect.flow_run_url`) when the flow talks to a Prefect server of its own (PREFECT_API_URL;
    a temporary server's page is gone after the run). A failure here is logged; it never stops
    the pipeline."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.utilities.urls import url_for

    try:
        uri = tracking.tracking_uri(layout.root)
        store = tracking.client_for(uri)
        url = tracking.run_url(uri, store.get_run(run_id).info.experiment_id, run_id)
        page = url_for("flow-run", obj_id=flow_run.id) if flow_run.id and os.environ.get("PREFECT_API_URL") else None
        if page:
            store.set_tag(run_id, "prefect.flow_run_url", page)
        if flow_run.id:
            with get_client(sync_client=True) as client:
                tags = client.read_flow_run(flow_run.id).tags
                client.update_flow_run(flow_run.id, tags=sorted({*tags, "mlflow", f"mlflow-run:{run_id}"}))
        shown = tracking.redact_text(uri)
        ui = "" if url.startswith(shown.rstrip("/")) else f" (start the UI with `mlflow ui --backend-store-uri {shown}`)"
        create_link_artifact(key=artifact_key("mlflow-run", params), link=url, link_text=f"MLflow run {run_id}",
                             description=f"This flow run's MLflow run in {shown}{ui}")
    except Exception as err:  # noqa: BLE001  (a missing link must never cost the pipeline its results)
        get_run_logger().warning("could not link the flow run to MLflow run %s (%s)", run_id, err)


def publish_sweep_table(params, sweep: dict) -> None:
    """The BPE sweep's table (`report.sweep_rows`), the knee's reason as its description."""
    from qad_pipeline.reporting.report import sweep_rows

    rows = [{k: "" if v is None else v for k, v in r.items()} for r in sweep_rows(sweep)]
    knee = sweep["knee"]
    create_table_artifact(key=artifact_key("bpe-sweep", params), table=rows,
                          description=f"Knee: {knee['reason']}")  # the reason starts with the knee's name


def start_tracking(layout: Layout, params) -> str | None:
    """Open the MLflow parent run at the start, so the run shows while it runs."""
    try:
        run_id = tracking.start_pipeline_run(layout, params, flow_run_id=flow_run_id(),
                                             git_commit=tracking.git_commit())
        tracking.record_run(layout, tracking.tracking_uri(layout.root), run_id, logged=False)
        return run_id
    except Exception as err:  # noqa: BLE001  (tracking must never cost the pipeline its results)
        get_run_logger().warning("MLflow: could not start the run (%s); results stay on disk", err)
        return None


def track(layout: Layout, params, report: str, parent_run: str | None, export_metrics: dict | None,
          status: str | None = None) -> dict:
    """Log the run's files to MLflow and register the export; on failure, say how to log later
    (the run stays recorded as not logged whole: `log-mlflow` completes it, logging nothing twice)."""
    try:
        uri = tracking.tracking_uri(layout.root)
        tracking.check_reachable(uri)  # a store that went away: seconds, not the client's minutes of retries
        run_id = tracking.log_pipeline(layout, params, flow_run_id=flow_run_id(), git_commit=tracking.git_commit(),
                                       report=report, run_id=parent_run, status=status)
        version = None
        if (export_metrics or {}).get("passed"):
            version = tracking.register_export(layout, params, run_id)
        tracking.record_run(layout, uri, run_id, logged=True, model_version=version)
        return {"uri": uri, "run_id": run_id, "model_version": version,
                "registered_model": tracking.registered_model_name(params.base_model.path) if version else None}
    except Exception as err:  # noqa: BLE001
        get_run_logger().warning(
            "MLflow logging failed (%s). Every result is on disk under %s; log it later with "
            "`qad-pipeline log-mlflow --out-root %s`", err, layout.root, layout.root)
        return {"error": str(err)}
