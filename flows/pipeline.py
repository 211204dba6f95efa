"""The `qad-pipeline` Prefect flow: `qad-pipeline run` (locally) or `prefect deployment run qad-pipeline/...`.

    calibration ── baseline (BF16 eval + reference) ── ptq × 5 recipes, in parallel ── selection
                                                          ── qad ── final_eval ── export ── (served_eval)

With `selection.policy: ptq_final` (PTQ is the last step) the selected PTQ recipe goes straight
to the export, through the same checks; when no recipe qualifies the flow ends at selection, and
the report says why. With `selection.sweep: knee` (or `all`) the BPE sweep's stages
(sweep_search, sweep × budgets, bpe_sweep; `flows/sweep_flow.py`) run beside the recipes, and its knee
(or every point) is a candidate in selection.

The flow body is the diagram: `run_dag` submits the stages of `qad_pipeline.core.stages.planned(params)`
in registry order, each waiting for the stages its `Stage.after` names (`flows/runtime.py:
submit_stages`), and stops at selection when no candidate qualifies. Each heavy stage runs as its own process (`qad-pipeline stage ...`, the same command that
`dvc repro` runs), so a recipe that crashes or runs out of memory fails alone: the flow reports
it and selection goes on among the survivors. With `recipe_deployment` set (the deployed
`qad-pipeline/default` sets `ptq-recipe/gpu`), each recipe is a flow run of its own on that
deployment's work pool instead, one GPU each, and this flow waits for all of them; with
`stage_deployment` set (`gpu-stage/gpu`), the other GPU-heavy stages (baseline, qad,
final_eval, export) run as flow runs on the GPU pool too, so the parent on the CPU-only control
pool never loads a model. How many recipes run at once here is `ptq.max_parallel` (`auto`: what
the memory plan fits, `qad_pipeline.plan.memory`).

The baseline writes the BF16 reference distribution that every recipe's KL is measured against,
so the recipes wait for it. Every stage but selection, the BPE curve and the race is cached (`Stage.cached`): one whose inputs
(parameters, code, base model, and the files standing for its data: for a recipe its file and the
reference, for QAD the selected checkpoint) are unchanged since its last successful run is taken
from Prefect's cache instead of running again, so a re-run after a crash anywhere, or with only
`selection.*` changed, runs only what is missing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from flows.publish import link_tracking, publish_recipe_table, publish_report, start_tracking, track
from flows.runtime import (Job, fail_on_required, holding_outputs, parameter_overrides, start_job, stop_everything,
                           submit_stages)
from flows.stage_process import StageFailed
from qad_pipeline.platform import dvc_remote
from qad_pipeline.reporting.run_plots import write_plots
from qad_pipeline.reporting.report import read_summary, report_text
from qad_pipeline.results.base import dump_result, read_result
from qad_pipeline.results.run import RunSummary
from qad_pipeline.results.selection_metrics import SelectionResult
from qad_pipeline.core.stages import BASELINE, STAGES, SWEEPING, planned

__all__ = ["StageFailed", "qad_pipeline"]


@flow(name="qad-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=16), log_prints=True)
def qad_pipeline(
    params_file: str = "params.yaml",  # config.DEFAULT_PARAMS; a literal, for the deployment's schema
    overrides: list[str] | None = None,
    out_root: str | None = None,
    base_model: str | None = None,
    recipes: list[str] | None = None,
    qad: dict[str, Any] | None = None,
    recipe_deployment: str | None = None,
    stage_deployment: str | None = None,
) -> dict:
    """Calibration -> BF16 baseline -> PTQ recipes in parallel -> selection -> QAD -> eval -> export.

    Every parameter overrides params.yaml, which holds the defaults: `base_model` (a local folder
    or hub id), `recipes` (names in ptq.recipe_dir), `qad` (e.g. {"steps": 80, "lr": 5e-5}) and
    `overrides` (any `section.key=value`). `params_file` is relative to the working directory;
    `out_root` defaults as `qad_pipeline.core.layout.output_root` says (`runs/<params stem>` for the
    image's own params files). `recipe_deployment` (e.g. "ptq-recipe/gpu") runs each recipe
    as a flow run of that deployment instead of a process here; `stage_deployment` (e.g.
    "gpu-stage/gpu") does the same for the GPU-heavy stages (and the recipes, without a
    `recipe_deployment`). Returns the run summary (`results.RunSummary`, as JSON).
    """
    overrides = list(overrides or []) + parameter_overrides(base_model, recipes, qad)
    params, job = start_job(params_file, overrides, out_root, recipe_deployment, stage_deployment)
    layout = job.layout
    with holding_outputs(params, layout):
        parent_run = start_tracking(layout, params)
        if parent_run:
            link_tracking(layout, params, parent_run)
        try:
            summary, ran = run_dag(job, params)
        except StageFailed as err:
            track(layout, params, f"FAILED: {err}", parent_run, None, status="FAILED")
            raise
        except BaseException as err:  # SIGTERM or a Prefect cancel (TerminationSignal), Ctrl-C
            stop_everything(err)
            track(layout, params, f"KILLED: stopped ({type(err).__name__})", parent_run, None, status="KILLED")
            raise
        summary.plots = [str(p) for p in write_plots(layout, params.ptq.recipes)]
        export = summary.export.model_dump(mode="json") if summary.export else None
        summary.mlflow = track(layout, params, report_text(summary), parent_run, export)
    # after the holds are released (DVC takes its own lock): commit the outputs to DVC, push them
    done, summary.dvc = dvc_remote.after_run(layout.root, Path(job.params_file), overrides, ran,
                                             dvc_remote.remote_for(params), get_run_logger().info)
    if done and summary.mlflow.get("run_id") and dvc_remote.run_project(layout.root):  # `dvc pull` anywhere
        summary.dvc += "; " + dvc_remote.log_pointers(layout.root, summary.mlflow["uri"], summary.mlflow["run_id"])
    (get_run_logger().info if done else get_run_logger().warning)(summary.dvc)
    return dump_result(summary)


def run_dag(job: Job, params) -> tuple[RunSummary, list[tuple[str, str | None]]]:
    """The diagram: every planned stage up to selection, then, when a candidate was selected, the
    stages after it. A failed calibration, baseline or selection fails the flow; a recipe, a sweep
    point or the sweep's curve fails alone and selection goes on among the rest. Returns the run
    summary and the (stage, item) pairs that completed."""
    logger, started = get_run_logger(), time.time()
    runs = planned(params)
    futures = submit_stages(job, [run for run in runs if not run[0].after_selection])
    wait([f for items in futures.values() for f in items.values()])
    up_to_selection = time.time() - started
    log_states(futures, logger)  # before QAD starts: what failed alone and what came from the cache
    fail_on_required(futures, lambda declared: not declared.may_fail and not declared.gated_by(SWEEPING))
    chosen = read_result(job.layout.selection_metrics, SelectionResult)
    publish_recipe_table(params, read_summary(job.layout, params))  # on show while QAD runs
    if chosen.selected is not None:  # QAD and final_eval with policy qad; the export of whatever is final
        later = [run for run in runs if run[0].after_selection]
        futures = submit_stages(job, later, futures)
        for declared, _ in later:
            futures[declared.name][None].result()  # in order: the first failure fails the flow
        log_states({declared.name: futures[declared.name] for declared, _ in later}, logger)
    states = {(name, item): f.state for name, items in futures.items() for item, f in items.items()}
    ran = [key for key, state in states.items() if state.is_completed()]
    seconds = {STAGES[name].summary_key(item): futures[name][item].result() for name, item in ran}
    seconds.update({"up to selection (wall)": up_to_selection, "run (wall)": time.time() - started})
    summary = read_summary(
        job.layout, params, seconds=seconds, settled=list(job.settled),
        failed=[item for (name, item), state in states.items() if STAGES[name].over_recipes and not state.is_completed()],
        cached=[item for (name, item), state in states.items() if STAGES[name].over_recipes and state.name == "Cached"],
        baseline_cached=states[(BASELINE.name, None)].name == "Cached")
    publish_report(params, summary)
    return summary, ran


def log_states(futures, logger) -> None:
    """What failed alone and what came from Prefect's cache, one line per stage: "PTQ failed for
    <recipes>; selecting among the others", "PTQ taken from cache (inputs unchanged): <recipes>"."""
    for name, items in futures.items():
        label = "PTQ" if STAGES[name].over_recipes else name
        failed = [item or "" for item, future in items.items() if not future.state.is_completed()]
        cached = [item or "" for item, future in items.items() if future.state.name == "Cached"]
        if failed:
            logger.warning("%s failed%s; selecting among the others", label,
                           f" for {', '.join(failed)}" if any(failed) else "")
        if cached:
            logger.info("%s taken from cache (inputs unchanged)%s", label, f": {', '.join(cached)}" if any(cached) else "")
