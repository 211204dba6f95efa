"""The `qad-pipeline` Prefect flow: `qad-pipeline run` (locally) or `prefect deployment run qad-pipeline/...`.

    calibration ── baseline (BF16 eval + reference) ── ptq × 5 recipes, in parallel ── selection
                                                          ── qad ── final_eval ── export

With `selection.policy: ptq_final` (PTQ is the last step) the selected PTQ recipe goes straight
to the export, through the same checks; when no recipe qualifies the flow ends at selection, and
the report says why. With `selection.sweep: knee` (or `all`) the BPE sweep's stages
(sweep_search, sweep × budgets, bpe_sweep; `flows/sweep.py`) run beside the recipes, and its knee
(or every point) is a candidate in selection.

Each heavy stage runs as its own process (`qad-pipeline stage ...`, the same command that
`dvc repro` runs), so a recipe that crashes or runs out of memory fails alone: the flow reports
it and selection goes on among the survivors. With `recipe_deployment` set (the deployed
`qad-pipeline/default` sets `ptq-recipe/gpu`), each recipe is a flow run of its own on that
deployment's work pool instead, one GPU each, and this flow waits for all of them; with
`stage_deployment` set (`gpu-stage/gpu`), the other GPU-heavy stages (baseline, qad,
final_eval, export) run as flow runs on the GPU pool too, so the parent on the CPU-only control
pool never loads a model. How many recipes run at once here is `ptq.max_parallel` (`auto`: what
the memory plan fits, `qad_pipeline.memory`).

The baseline writes the BF16 reference distribution that every recipe's KL is measured against,
so the recipes wait for it. A baseline or a recipe whose inputs (parameters, calibration data,
base model, code, and for a recipe its file and the reference) are unchanged since its last
successful run is taken from Prefect's cache instead of running again, so a re-run after a crash,
or with only `selection.*` changed, runs only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import allow_failure, flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, wait
from prefect.task_runners import ThreadPoolTaskRunner

from qad_pipeline import processes, tracking, versioning
from qad_pipeline.artifacts import list_files
from qad_pipeline.config import load_params, resolve
from flows.publish import link_tracking, publish_recipe_table, publish_report
from flows.stages import StageFailed, run_stage_process
from qad_pipeline.layout import Layout, output_root
from qad_pipeline.plots import write_plots
from qad_pipeline.preflight import preflight
from qad_pipeline.report import recipe_rows, report_text, weight_error_rows
from qad_pipeline.results import BPESweep, ExportMetrics, QADMetrics, SelectionResult, dump_result, read_result
from qad_pipeline.runlock import TOKEN_ENV, dvc_write_lock, run_lock
from qad_pipeline.stages import STAGES, Stage, fill, planned, with_sweep

__all__ = ["StageFailed", "qad_pipeline"]

_ptq_slots: dict[int, threading.Semaphore] = {}


@dataclass(frozen=True)
class Job:
    """What every stage task of one flow run shares: where its params are and where it writes."""

    params_file: str
    overrides: list[str]
    layout: Layout
    recipe_deployment: str | None = None
    stage_deployment: str | None = None
    at_once: int = 1  # PTQ recipes at once here (the memory plan's `recipe_parallelism`)
    threads: int = 1  # CPU threads per PTQ process


def _picked(data: dict, keys: tuple[str, ...]) -> dict:
    """The values of dotted params keys (`eval`, `ptq.recipe_dir`) out of a params dump."""
    picked = {}
    for key in keys:
        value = data
        for part in key.split("."):
            value = value[part]
        picked[key] = value
    return picked


def _declared_path(template: str, params, layout: Layout, recipe: str | None) -> Path:
    """A registry path: `${section.key}` paths are the params file's (relative to its folder), the
    others the out-root's."""
    path = fill(template, recipe)
    if "${" not in path:
        return layout.root / path
    values = params.model_dump()
    return resolve(re.sub(r"\$\{([\w.]+)\}", lambda m: str(_picked(values, (m[1],))[m[1]]), path))


def stage_cache_key(context, arguments: dict[str, Any]) -> str:
    """A cached stage's inputs: its params keys, the files standing for its data inputs, its code
    (the registry's import graph), the base model (file listing with sizes and times, or hub id
    and revision) and the out-root. Unchanged inputs: Prefect takes the last result from cache."""
    stage, recipe, job = STAGES[arguments["stage"]], arguments["recipe"], arguments["job"]
    params = load_params(Path(job.params_file), job.overrides)
    digest = hashlib.sha256(json.dumps(
        [stage.run_name(recipe), str(job.layout.root), _picked(params.model_dump(), stage.params)],
        sort_keys=True, default=str).encode())
    files = [_declared_path(f, params, job.layout, recipe) for f in stage.fingerprints] + stage.code_files()
    for path in files:
        digest.update(str(path).encode())
        digest.update(path.read_bytes() if path.is_file() else b"<missing>")
    model = resolve(params.base_model.path)
    if model.is_dir():
        digest.update(json.dumps(list_files(model)).encode())
    return f"{stage.run_name(recipe)}-{digest.hexdigest()[:32]}"


def outputs_present(stage: Stage, layout: Layout, recipe: str | None) -> bool:
    """The files a cached result points at are still there (else it must run again)."""
    return all((layout.root / fill(p, recipe)).exists() for p in stage.done)


@task(persist_result=True)
def run_stage(stage: str, recipe: str | None, job: Job) -> float:
    """One stage: a process here (`qad-pipeline stage ...`), or a flow run on a GPU deployment's pool."""
    declared = STAGES[stage]
    if declared.name == "ptq" and job.recipe_deployment:
        return run_on_pool(job.recipe_deployment, declared.run_name(recipe), {"recipe": recipe}, job)
    if declared.gpu and job.stage_deployment and (declared.name != "ptq" or not job.recipe_deployment):
        return run_on_pool(job.stage_deployment, declared.run_name(recipe),
                           {"stage": stage, **({"item": recipe} if recipe else {})}, job)
    if not declared.per_recipe:
        return run_stage_process([stage], job.params_file, job.overrides, job.layout)
    with _ptq_slots.setdefault(job.at_once, threading.Semaphore(job.at_once)):
        return run_stage_process([stage, recipe], job.params_file, job.overrides, job.layout, job.threads)


def stage_task(job: Job, stage: str, recipe: str | None = None):
    """The generic stage task with one stage's name and run name (`ptq-<recipe>`: no random
    suffix), and for a cached stage its cache key; one whose outputs are gone runs again."""
    declared = STAGES[stage]
    options: dict[str, Any] = {"name": stage, "task_run_name": declared.run_name(recipe)}
    if declared.cached:
        options.update(cache_key_fn=stage_cache_key,
                       refresh_cache=not outputs_present(declared, job.layout, recipe))
    else:
        options.update(cache_policy=NO_CACHE, persist_result=False)
    return run_stage.with_options(**options)


def submit(job: Job, stage: str, recipe: str | None = None, after: list | None = None) -> PrefectFuture:
    """Submit one stage's task run, waiting for `after` (its edges in the Prefect graph)."""
    return stage_task(job, stage, recipe).submit(stage, recipe, job, wait_for=after or [])


def run_on_pool(deployment: str, name: str, what: dict, job: Job) -> float:
    """Run `deployment` (ptq-recipe/gpu or gpu-stage/gpu) for one stage and wait for it."""
    from prefect.deployments import run_deployment

    run = run_deployment(
        deployment, flow_run_name=name, poll_interval=2,
        parameters={**what, "params_file": job.params_file, "overrides": job.overrides,
                    "out_root": str(job.layout.root), "lock_token": os.environ.get(TOKEN_ENV)},
    )
    if not run.state or not run.state.is_completed():
        state = run.state.name if run.state else "unknown"
        raise StageFailed(f"{name}: flow run {run.name!r} on {deployment} ended {state}"
                          + (f": {run.state.message}" if run.state and run.state.message else ""))
    get_run_logger().info("%s: flow run %s completed on %s", name, run.name, run.work_pool_name)
    return (run.end_time - run.start_time).total_seconds() if run.start_time and run.end_time else 0.0


def cancel_pool_runs(why: str) -> int:
    """Cancel the flow runs this run started on pools (`run_on_pool`) that have not ended; how many.

    Their workers then stop their processes. Prefect's server would cancel them only once this
    run is Cancelled (its cancellation-cleanup loop), and never when this run is stopped any
    other way; meanwhile the threads waiting for them would keep this run from ending.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Cancelling

    me = _flow_run_id()
    if me is None:
        return 0
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[me])))
            running = [r for r in runs if r.deployment_id and r.state and not r.state.is_final()
                       and not r.state.is_cancelling()]
            for run in running:
                client.set_flow_run_state(run.id, Cancelling(message=why))
    except Exception as err:  # noqa: BLE001  (the run is stopping either way; Prefect's server cleans up later)
        get_run_logger().warning("could not cancel the flow runs started on pools (%s)", err)
        return 0
    return len(running)


def parameter_overrides(base_model: str | None, recipes: list[str] | None, qad: dict[str, Any] | None) -> list[str]:
    """The flow's typed parameters as `section.key=value` overrides of params.yaml."""
    items = [f"base_model.path={base_model}"] if base_model else []
    if recipes is not None:
        items.append(f"ptq.recipes={json.dumps(recipes)}")
    items += [f"qad.{key}={json.dumps(value)}" for key, value in (qad or {}).items()]
    return items


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
    `out_root` defaults to its folder. `recipe_deployment` (e.g. "ptq-recipe/gpu") runs each recipe
    as a flow run of that deployment instead of a process here; `stage_deployment` (e.g.
    "gpu-stage/gpu") does the same for baseline, qad, final_eval and export.
    """
    from qad_pipeline.memory import recipe_parallelism

    overrides = list(overrides or []) + parameter_overrides(base_model, recipes, qad)
    params_file = str(Path(params_file).resolve())  # the stage processes run in its folder
    params = load_params(Path(params_file), overrides)  # a bad value fails here, before any model loads
    layout = Layout(output_root(out_root, params_file))
    # On a deployment the stages run on GPU workers: this (control) machine's memory says nothing.
    preflight(params, layout.root, memory=not (recipe_deployment or stage_deployment))
    at_once = recipe_parallelism(params, sweep=with_sweep(params))
    job = Job(params_file, overrides, layout, recipe_deployment, stage_deployment,
              at_once, max(1, (os.cpu_count() or 1) // at_once))
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
        summary["plots"] = [str(p) for p in write_plots(layout, params.ptq.recipes)]
        summary["mlflow"] = track(layout, params, report_text(summary), parent_run, summary.get("export"))
    recorded, summary["dvc"] = versioning.record_run(layout.root, Path(params_file), overrides,
                                                     versioning.stage_names(ran))
    (get_run_logger().info if recorded or not versioning.dvc_project(layout.root) else get_run_logger().warning)(
        summary["dvc"])
    return summary


def run_dag(job: Job, params) -> tuple[dict, list[tuple[str, str | None]]]:
    """The stages, each a task run waiting for the ones it reads (the edges of the Prefect graph).

    A failed calibration or baseline fails the flow; a failed recipe fails alone and selection
    goes on among the others. When a recipe was selected, QAD and final_eval follow (policy `qad`),
    then the export of what is final (`ptq_final`: the selected recipe). Returns the run summary
    and the (stage, recipe) pairs that completed.
    """
    layout, logger = job.layout, get_run_logger()
    calibration = submit(job, "calibration")
    seconds = {"calibration": calibration.result()}
    started = time.time()
    baseline = submit(job, "baseline", after=[calibration])
    seconds["baseline"] = baseline.result()  # no baseline, no recovery: a failed baseline fails the flow
    from flows.sweep import submit_sweep, sweep_ran  # it builds on this module

    recipes = {name: submit(job, "ptq", name, after=[calibration, baseline]) for name in params.ptq.recipes}
    if with_sweep(params):
        sweep = [submit_sweep(job, params, calibration, baseline, recipes)]
    elif layout.bpe_sweep_metrics.is_file():  # an earlier sweep's curve holds these recipes: it follows them
        sweep = [submit(job, "bpe_sweep", after=[baseline, *map(allow_failure, recipes.values())])]
    else:
        sweep = []
    wait(list(recipes.values()) + sweep)
    seconds.update({STAGES["ptq"].summary_key(n): f.result() for n, f in recipes.items() if f.state.is_completed()})
    seconds["baseline+ptq (wall)"] = time.time() - started
    failed = [name for name, fut in recipes.items() if not fut.state.is_completed()]
    cached = [name for name, fut in recipes.items() if fut.state.name == "Cached"]
    if failed:
        logger.warning("PTQ failed for %s; selecting among the others", ", ".join(failed))
    if cached:
        logger.info("PTQ taken from cache (inputs unchanged): %s", ", ".join(cached))
    if baseline.state.name == "Cached":
        logger.info("baseline taken from cache (inputs unchanged)")
    ran = [("calibration", None), ("baseline", None), *(("ptq", n) for n in recipes if n not in failed)]
    if with_sweep(params):
        ran += sweep_ran(params, layout)
    elif sweep and sweep[0].state.is_completed():
        ran.append(("bpe_sweep", None))

    if sweep and not sweep[0].state.is_completed():
        logger.warning("the BPE sweep's curve failed; selecting among the recipes only")
    selection = submit(job, "selection", after=[baseline, *map(allow_failure, [*recipes.values(), *sweep])])
    seconds["selection"] = selection.result()
    ran.append(("selection", None))
    chosen = read_result(layout.selection_metrics, SelectionResult)
    names = [*params.ptq.recipes, *(r.name for r in chosen.table if r.name not in params.ptq.recipes)]  # + sweep's
    summary = {"selection": dump_result(chosen), "recipes": recipe_rows(layout, names),
               "weight_error": weight_error_rows(layout, names),
               "failed": failed, "cached": cached, "baseline_cached": baseline.state.name == "Cached",
               "seconds": seconds, "root": str(layout.root)}
    if with_sweep(params) and layout.bpe_sweep_metrics.is_file():
        summary["sweep"] = dump_result(read_result(layout.bpe_sweep_metrics, BPESweep))
    publish_recipe_table(params, summary)
    if chosen.selected is not None:  # QAD and final_eval with policy qad; export of whatever is final
        upstream = selection
        for declared, _ in planned(params):
            if declared.after_selection:
                upstream = submit(job, declared.name, after=[upstream])
                seconds[declared.name] = upstream.result()
                ran.append((declared.name, None))
        if params.selection.policy == "qad":
            summary["qad"] = dump_result(read_result(layout.qad_metrics, QADMetrics))
        if params.export.source != "none":
            summary["export"] = dump_result(read_result(layout.export_metrics, ExportMetrics))
    publish_report(params, summary)
    return summary, ran


def stop_everything(err: BaseException) -> None:
    """A stopped run (SIGTERM, a Prefect cancel, Ctrl-C): cancel its flow runs on pools, stop its
    stage processes."""
    cancelled = cancel_pool_runs(f"the run that started it was stopped ({type(err).__name__})")
    stopped = processes.stop_all()
    get_run_logger().warning("stopped (%s): %d stage process(es) stopped, %d flow run(s) on pools cancelled",
                             type(err).__name__, len(stopped), cancelled)


@contextmanager
def holding_outputs(params, layout: Layout):
    """Every hold this run takes on its outputs, for as long as it writes them: the base-model slot
    (deployment runs), the run lock on the out-root (its token passed to the stage processes) and
    DVC's write lock (so a `dvc repro` there waits)."""
    logger = get_run_logger()
    with base_model_slot(params), run_lock(layout.root, "run the pipeline", on_stale=logger.warning) as token:
        previous, os.environ[TOKEN_ENV] = os.environ.get(TOKEN_ENV), token
        try:
            with dvc_write_lock(layout.root, f"qad-pipeline run (Prefect flow run {_flow_run_name()}) is writing "
                                             "this project's outputs; wait for it to finish or cancel it"):
                yield token
        finally:
            if previous is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = previous


def base_model_slot(params):
    """In a deployment run, one run per base model at a time: Prefect's global concurrency limit
    `qad-pipeline:<base model>` (limit 1, created on first use). Local runs need none."""
    from contextlib import nullcontext

    from prefect.runtime import deployment

    if deployment.id is None:
        return nullcontext()
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    model = resolve(params.base_model.path)
    name = "qad-pipeline:" + hashlib.sha256(
        f"{model if model.exists() else params.base_model.path}@{params.base_model.revision}".encode()).hexdigest()[:16]
    with get_client(sync_client=True) as client:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass
    get_run_logger().info("waiting for base-model slot %s (%s)", name, params.base_model.path)
    # A renewal that fails (the server lost the lease: a restart of one that keeps leases in memory)
    # warns and lets the run go on rather than stopping it; the run lock still guards the out-root.
    return concurrency(name, occupy=1, strict=True, raise_on_lease_renewal_failure=False)


def start_tracking(layout: Layout, params) -> str | None:
    """Open the MLflow parent run at the start, so the run shows while it runs."""
    try:
        run_id = tracking.start_pipeline_run(layout, params, flow_run_id=_flow_run_id(),
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
        run_id = tracking.log_pipeline(layout, params, flow_run_id=_flow_run_id(), git_commit=tracking.git_commit(),
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


def _flow_run_name() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.name


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.id
