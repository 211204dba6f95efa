"""The `bpe-sweep` Prefect flow: `qad-pipeline sweep` (locally) or `prefect deployment run bpe-sweep/...`.

    calibration ── baseline ── ptq × fixed recipes ─────────────────────┐
               └── sweep_search ── sweep × budgets (in parallel) ── bpe_sweep (curve, knee, plot)

The same stage processes as the pipeline (`qad-pipeline stage ...`, cached the same way, so a
sweep after a pipeline run reuses its calibration, baseline and recipes): the sweep's AutoQuantize
recipe is searched once, each budget re-solves from that search and is evaluated like a recipe,
and `bpe_sweep` places the fixed recipes on the same curve and chooses the knee. The table is a
Prefect artifact (`bpe-sweep-<model>`); MLflow gets a parent run with one child run per budget,
the Pareto plot and `bpe_sweep.json`. To take the knee (or every point) into selection, QAD and
export, run the pipeline with `selection.sweep: knee` (or `all`).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from flows.publish import publish_sweep_table
from flows.runtime import (fail_on_required, holding_outputs, parameter_overrides, start_job, stop_everything,
                           submit_stages)
from flows.stage_process import StageFailed
from qad_pipeline import tracking
from qad_pipeline.platform import versioning
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import dump_result, read_result
from qad_pipeline.results.sweep_metrics import BPESweep
from qad_pipeline.core.stages import planned


@flow(name="bpe-sweep", task_runner=ThreadPoolTaskRunner(max_workers=16), log_prints=True)
def bpe_sweep(
    params_file: str = "params.yaml",
    overrides: list[str] | None = None,
    out_root: str | None = None,
    base_model: str | None = None,
    budgets: list[float] | None = None,
    recipe_deployment: str | None = None,
    stage_deployment: str | None = None,
) -> dict:
    """The sweep's recipe at every budget, the fixed recipes on the same curve, the knee.

    Every parameter overrides params.yaml: `budgets` (sweep.budgets, e.g. [4.5, 5.0, 6.0]),
    `base_model`, `overrides` (any `section.key=value`); the deployments as in `qad-pipeline`.
    """
    overrides = list(overrides or []) + parameter_overrides(base_model, None, None)
    overrides += [f"sweep.budgets={[float(b) for b in budgets]}"] if budgets is not None else []
    params, job = start_job(params_file, overrides, out_root, recipe_deployment, stage_deployment, sweep=True)
    layout, started_ms = job.layout, int(time.time() * 1000)
    with holding_outputs(params, layout):
        try:
            futures = submit_stages(job, planned(params, sweep_only=True))
            wait([f for items in futures.values() for f in items.values()])
            # a budget's point (a recipe) fails alone; anything else, the curve included, fails the flow
            fail_on_required(futures, lambda declared: not declared.may_fail or not declared.per_recipe)
        except StageFailed:
            raise
        except BaseException as err:  # SIGTERM or a Prefect cancel (TerminationSignal), Ctrl-C
            stop_everything(err)
            raise
        sweep = dump_result(read_result(layout.bpe_sweep_metrics, BPESweep))
        publish_sweep_table(params, sweep)
        mlflow = track_sweep(layout, params, started_ms)
    ran = [(name, item) for name, items in futures.items() for item, f in items.items() if f.state.is_completed()]
    _, recorded = versioning.record_in_dvc_lock(layout.root, Path(job.params_file), overrides, versioning.stage_names(ran))
    get_run_logger().info(recorded)
    return {"sweep": sweep, "root": str(layout.root), "mlflow": mlflow, "dvc": recorded}


def track_sweep(layout: Layout, params, started_ms: int) -> dict:
    """Log the sweep to MLflow; a failure is a warning (the files stay; nothing is lost)."""
    from prefect.runtime import flow_run

    try:
        uri = tracking.tracking_uri(layout.root)
        tracking.check_reachable(uri)
        run_id = tracking.log_sweep(layout, params, flow_run_id=flow_run.id, git_commit=tracking.git_commit(),
                                    start_ms=started_ms)
        return {"uri": uri, "run_id": run_id}
    except Exception as err:  # noqa: BLE001  (tracking must never cost the sweep its results)
        get_run_logger().warning("MLflow logging of the sweep failed (%s); its files are under %s", err, layout.root)
        return {"error": str(err)}

