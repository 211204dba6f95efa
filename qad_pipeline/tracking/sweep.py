"""The BPE sweep in MLflow: a parent run per sweep (tag `qad.kind=sweep`) in the base model's
experiment, with the sweep's configuration, the knee as metrics and tags, `bpe_sweep.json` and the
Pareto plot as artifacts, and one child run per budget (`sweep-<budget>`: budget, both bit counts,
median recovery and its interval, KL, layers per format; its layer map as an artifact), read from
the files the sweep's stages wrote.
"""

from __future__ import annotations

import time

from qad_pipeline.config import Params
from qad_pipeline.layout import Layout
from qad_pipeline.results.base import dump_result, read_result
from qad_pipeline.results.scores import PTQScores
from qad_pipeline.results.sweep import BPESweep
from qad_pipeline.tracking.children import ChildRun, stage_span
from qad_pipeline.tracking.runs import _log_batch, _log_files, log_child, start_pipeline_run
from qad_pipeline.tracking.store import KIND, NOTE, client_for, tracking_uri


def sweep_children(layout: Layout, params: Params, sweep: BPESweep) -> list[ChildRun]:
    """One child run per sweep point that ran."""
    children = []
    for point in sweep.points:
        budget = str(point.budget)
        folder = layout.sweep(budget)
        scores = read_result(folder / "scores.json", PTQScores)
        start_ms, end_ms = stage_span(layout, f"sweep-{budget}", folder / "scores.json")
        searched = scores.auto_quantize
        children.append(ChildRun(
            name=f"sweep-{budget}", stage="sweep", start_ms=start_ms, end_ms=end_ms, recipe=point.name,
            params={"budget": point.budget, "sweep.recipe": params.sweep.recipe, "method": searched.method,
                    "formats": ",".join(searched.formats), "kv_cache": searched.kv_cache},
            metrics={"budget": point.budget, "searched_effective_bits": point.searched_effective_bits,
                     "effective_bpe": point.effective_bpe, "median_recovery": point.median_recovery,
                     "median_recovery_ci_low": point.median_recovery_ci[0],
                     "median_recovery_ci_high": point.median_recovery_ci[1], "kl_divergence": point.kl_divergence,
                     "size_bytes": scores.size_bytes,
                     **{f"layers.{fmt}": n for fmt, n in point.layers_by_format.items()}},
            tags={"knee": str(point.name == sweep.knee.name).lower()},
            dicts={"auto_quantize.json": dump_result(searched)},
        ))
    return children


def knee_metrics(sweep: BPESweep) -> dict[str, float]:
    """The knee's figures and the eval's noise, as metrics."""
    knee = next((p for p in sweep.points if p.name == sweep.knee.name), None)
    metrics = {"noise": sweep.noise}
    if knee is not None:
        metrics.update({"knee.budget": knee.budget, "knee.searched_effective_bits": knee.searched_effective_bits,
                        "knee.effective_bpe": knee.effective_bpe, "knee.median_recovery": knee.median_recovery,
                        "knee.kl_divergence": knee.kl_divergence})
    return metrics


def bpe_sweep_child(layout: Layout, sweep: BPESweep) -> ChildRun:
    """The curve's stage run (`bpe_sweep`): the knee and its reason, `bpe_sweep.json`."""
    start_ms, end_ms = stage_span(layout, "bpe_sweep", layout.bpe_sweep_metrics)
    return ChildRun(name="bpe_sweep", stage="bpe_sweep", start_ms=start_ms, end_ms=end_ms,
                    params={"knee_epsilon": sweep.knee_epsilon}, metrics=knee_metrics(sweep),
                    tags={"knee": sweep.knee.name or "none", "knee.reason": sweep.knee.reason[:5000]},
                    dicts={"bpe_sweep.json": dump_result(sweep)})


def description(sweep: BPESweep) -> str:
    """The sweep run's description (Markdown): the knee and why, then the table."""
    from qad_pipeline.report import markdown_table, sweep_rows

    rows = sweep_rows(dump_result(sweep))
    return "\n".join([f"**Knee:** {sweep.knee.name or 'none'}", "", sweep.knee.reason, *markdown_table(rows),
                      f"Eval noise (widest half interval): {100 * sweep.noise:.2f} points."])


def log_sweep(layout: Layout, params: Params, *, flow_run_id: str | None, git_commit: str | None,
              start_ms: int | None = None) -> str:
    """Log one sweep (started at `start_ms`): its parent run and a child per budget; the parent's id."""
    from mlflow.entities import RunStatus

    sweep = read_result(layout.bpe_sweep_metrics, BPESweep)
    client = client_for(tracking_uri(layout.root))
    run_id = start_pipeline_run(layout, params, flow_run_id=flow_run_id, git_commit=git_commit, start_ms=start_ms)
    name = "bpe-sweep-" + time.strftime("%Y%m%d-%H%M%S", time.localtime((start_ms or time.time() * 1000) / 1000))
    experiment_id = client.get_run(run_id).info.experiment_id
    children = sweep_children(layout, params, sweep)
    for child in children:
        log_child(client, experiment_id, run_id, child)
    curve = bpe_sweep_child(layout, sweep)  # its knee metrics, tags and bpe_sweep.json go on the parent
    _log_batch(client, run_id, metrics=curve.metrics,
               tags={KIND: "sweep", "mlflow.runName": name, NOTE: description(sweep), **curve.tags})
    _log_files(client, run_id, curve.dicts, {})
    if layout.bpe_plot.is_file():
        client.log_artifact(run_id, str(layout.bpe_plot), "plots")
    end_ms = max([c.end_ms for c in children] + [int(layout.bpe_sweep_metrics.stat().st_mtime * 1000)])
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED), end_time=end_ms)
    return run_id
