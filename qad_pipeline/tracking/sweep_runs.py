"""The BPE sweep in MLflow: a parent run per sweep (tag `qad.kind=sweep`) in the base model's
experiment, with the sweep's configuration, the knee as metrics and tags, `bpe_sweep.json` and the
Pareto plot as artifacts, and one child run per budget (`sweep-<budget>`: budget, both bit counts,
median recovery and its interval, KL, layers per format; its layer map as an artifact), read from
the files the sweep's stages wrote.
"""

from __future__ import annotations

from qad_pipeline.core.config import Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import dump_result, read_result
from qad_pipeline.results.sweep_metrics import BPESweep
from qad_pipeline.tracking.children import bpe_sweep_child, sweep_children
from qad_pipeline.tracking.store import NOTE, client_for, tracking_uri
from qad_pipeline.tracking.write import end_quietly, log_batch, log_child, log_files, start_parent_run

SWEEP_KIND = "sweep"  # the sweep's parent run: tag qad.kind=sweep (a pipeline run's is "pipeline")


def description(sweep: BPESweep) -> str:
    """The sweep run's description (Markdown): the knee and why, then the table."""
    from qad_pipeline.reporting.report import markdown_table, sweep_rows

    rows = sweep_rows(dump_result(sweep))
    return "\n".join([f"**Knee:** {sweep.knee.name or 'none'}", "", sweep.knee.reason, *markdown_table(rows),
                      f"Eval noise (widest half interval): {100 * sweep.noise:.2f} points."])


def log_sweep(layout: Layout, params: Params, *, flow_run_id: str | None, git_commit: str | None,
              start_ms: int | None = None) -> str:
    """Log one sweep (started at `start_ms`): its parent run (`qad.kind=sweep`, named
    `bpe-sweep-<time>` from the start, so `compare` never takes it for a pipeline run) and a child
    per budget; the parent's id. A failure part-way ends the parent FAILED and raises."""
    from mlflow.entities import RunStatus

    sweep = read_result(layout.bpe_sweep_metrics, BPESweep)
    client = client_for(tracking_uri(layout.root))
    run_id = start_parent_run(layout, params, kind=SWEEP_KIND, prefix="bpe-sweep-", flow_run_id=flow_run_id,
                              git_commit=git_commit, start_ms=start_ms)
    try:
        experiment_id = client.get_run(run_id).info.experiment_id
        children = sweep_children(layout, params, sweep)
        for child in children:
            log_child(client, experiment_id, run_id, child)
        curve = bpe_sweep_child(layout, sweep)  # its knee metrics, tags and bpe_sweep.json go on the parent
        log_batch(client, run_id, metrics=curve.metrics, tags={NOTE: description(sweep), **curve.tags})
        log_files(client, run_id, curve.dicts, {})
        if layout.bpe_plot.is_file():
            client.log_artifact(run_id, str(layout.bpe_plot), "plots")
        end_ms = max([c.end_ms for c in children] + [int(layout.bpe_sweep_metrics.stat().st_mtime * 1000)])
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED), end_time=end_ms)
    except BaseException as err:
        end_quietly(client, run_id, "FAILED", err)
        raise
    return run_id
