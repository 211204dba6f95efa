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

import os
import time
from pathlib import Path

from prefect import allow_failure, flow, get_run_logger
from prefect.futures import PrefectFuture, wait
from prefect.task_runners import ThreadPoolTaskRunner

from qad_pipeline import tracking, versioning
from qad_pipeline.config import load_params
from flows.pipeline import (Job, StageFailed, holding_outputs, parameter_overrides,
                                         stop_everything, submit)
from flows.publish import publish_sweep_table
from qad_pipeline.layout import Layout, output_root
from qad_pipeline.preflight import preflight
from qad_pipeline.results import BPESweep, dump_result, read_result


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
    from qad_pipeline.memory import recipe_parallelism

    overrides = list(overrides or []) + parameter_overrides(base_model, None, None)
    overrides += [f"sweep.budgets={[float(b) for b in budgets]}"] if budgets is not None else []
    params_file = str(Path(params_file).resolve())
    params = load_params(Path(params_file), overrides)
    layout = Layout(output_root(out_root, params_file))
    preflight(params, layout.root, memory=not (recipe_deployment or stage_deployment), sweep=True)
    at_once = recipe_parallelism(params, sweep=True)
    job = Job(params_file, overrides, layout, recipe_deployment, stage_deployment,
              at_once, max(1, (os.cpu_count() or 1) // at_once))
    started_ms = int(time.time() * 1000)
    with holding_outputs(params, layout):
        try:
            calibration = submit(job, "calibration")
            calibration.result()
            baseline = submit(job, "baseline", after=[calibration])
            baseline.result()
            recipes = {name: submit(job, "ptq", name, after=[calibration, baseline]) for name in params.ptq.recipes}
            knee = submit_sweep(job, params, calibration, baseline, recipes)
            wait([knee, *recipes.values()])
            knee.result()  # no curve, no sweep: a failed bpe_sweep fails the flow
        except StageFailed:
            raise
        except BaseException as err:  # SIGTERM or a Prefect cancel (TerminationSignal), Ctrl-C
            stop_everything(err)
            raise
        sweep = dump_result(read_result(layout.bpe_sweep_metrics, BPESweep))
        publish_sweep_table(params, sweep)
        mlflow = track_sweep(layout, params, started_ms)
    ran = [("calibration", None), ("baseline", None),
           *(("ptq", n) for n, f in recipes.items() if f.state.is_completed()), *sweep_ran(params, layout)]
    _, recorded = versioning.record_run(layout.root, Path(params_file), overrides, versioning.stage_names(ran))
    get_run_logger().info(recorded)
    return {"sweep": sweep, "root": str(layout.root), "mlflow": mlflow, "dvc": recorded}


def submit_sweep(job: Job, params, calibration: PrefectFuture, baseline: PrefectFuture,
                 recipes: dict[str, PrefectFuture]) -> PrefectFuture:
    """The BPE sweep's stages: one search, then every budget (in the recipes' slots), then the
    curve and knee once they and the fixed recipes are done; its future is the knee's."""
    search = submit(job, "sweep_search", after=[calibration])
    points = [submit(job, "sweep", b, after=[calibration, baseline, search]) for b in params.sweep.points]
    return submit(job, "bpe_sweep", after=[baseline, *map(allow_failure, [*recipes.values(), *points])])


def sweep_ran(params, layout: Layout) -> list[tuple[str, str | None]]:
    """The sweep's (stage, item) pairs whose results are on disk."""
    ran = [("sweep_search", None)] if (layout.sweep_search / "search.json").is_file() else []
    ran += [("sweep", b) for b in params.sweep.points if (layout.sweep(b) / "scores.json").is_file()]
    return ran + ([("bpe_sweep", None)] if layout.bpe_sweep_metrics.is_file() else [])


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

