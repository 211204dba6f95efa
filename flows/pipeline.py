"""The `qad-pipeline` Prefect flow: `qad-pipeline run` (locally) or `prefect deployment run qad-pipeline/...`.

    calibration ── baseline (BF16 eval + reference) ── ptq × 5 recipes, in parallel ── selection
                                                          ── qad ── final_eval ── export

With `selection.policy: ptq_final` the flow ends at selection (PTQ is the last step); when no
recipe qualifies it ends there too, and the report says why.

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
import importlib.util
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from qad_pipeline import tracking, versioning
from qad_pipeline.artifacts import list_files, read_json
from qad_pipeline.config import load_params, resolve
from qad_pipeline.flows.publish import link_tracking, publish_recipe_table, publish_report
from qad_pipeline.flows.stages import StageFailed, run_stage_process
from qad_pipeline.layout import Layout, output_root
from qad_pipeline.plots import write_plots
from qad_pipeline.report import recipe_rows, report_text, weight_error_rows
from qad_pipeline.runlock import TOKEN_ENV, dvc_write_lock, run_lock

__all__ = ["StageFailed", "qad_pipeline"]

_ptq_slots: dict[int, threading.Semaphore] = {}
# The code a baseline result depends on, and a PTQ result in addition: a change to any of these
# makes the stage run again.
BASELINE_CODE = ["qad_pipeline.tasks.evaluate", "qad_pipeline.reference", "qad_pipeline.modeling",
                 "qad_pipeline.tasks.calibration", "qad_pipeline.sizes"]
PTQ_CODE = [*BASELINE_CODE, "qad_pipeline.tasks.ptq", "qad_pipeline.nvfp4_cpu"]


def _hash_files(digest, paths) -> None:
    for path in paths:
        digest.update(str(path).encode())
        digest.update(Path(path).read_bytes() if Path(path).is_file() else b"<missing>")


def _inputs_key(params, layout: Layout, include: dict, files: list[Path], code: list[str], extra: str) -> str:
    """sha256 of what a stage reads: its parameters, input files, code and the base model."""
    digest = hashlib.sha256()
    digest.update(json.dumps([extra, str(layout.root), params.model_dump(include=include)], sort_keys=True).encode())
    _hash_files(digest, [*files, layout.data / "manifest.json",
                         *(importlib.util.find_spec(module).origin for module in code)])
    model = resolve(params.base_model.path)
    if model.is_dir():
        digest.update(json.dumps(list_files(model)).encode())
    return digest.hexdigest()[:32]


def baseline_cache_key(context, arguments: dict[str, Any]) -> str:
    """The baseline's inputs: base model, eval parameters, calibration data, code, out-root."""
    params = load_params(Path(arguments["params_file"]), arguments["overrides"])
    return "baseline-" + _inputs_key(params, arguments["layout"], {"base_model": True, "eval": True}, [],
                                     BASELINE_CODE, "baseline")


def ptq_cache_key(context, arguments: dict[str, Any]) -> str:
    """A PTQ recipe's inputs: its recipe file, its parameters, the calibration data, the BF16
    reference, the base model (file listing with sizes and times, or hub id and revision), the
    code and the out-root."""
    params = load_params(Path(arguments["params_file"]), arguments["overrides"])
    layout: Layout = arguments["layout"]
    recipe = arguments["recipe"]
    include = {"base_model": True, "ptq": {"calib_batch_size"}, "eval": True}
    files = [params.recipe_path(recipe), layout.reference / "manifest.json"]
    return f"ptq-{recipe}-" + _inputs_key(params, layout, include, files, PTQ_CODE, recipe)


def baseline_done(layout: Layout) -> bool:
    """The baseline's outputs are on disk (else a cached result would point at nothing)."""
    return layout.baseline_metrics.is_file() and (layout.reference / "manifest.json").is_file()


def recipe_done(layout: Layout, recipe: str) -> bool:
    """The recipe's outputs are on disk (else a cached result would point at nothing)."""
    scores = layout.ptq(recipe) / "scores.json"
    return (scores.is_file() and read_json(scores).get("status") == "ok"
            and (layout.ptq(recipe) / "checkpoint").is_dir())


@task(name="calibration", task_run_name="calibration")
def calibration(params_file: str, overrides: list[str], layout: Layout) -> float:
    return run_stage_process(["calibration"], params_file, overrides, layout)


def run_heavy_stage(stage: str, params_file: str, overrides: list[str], layout: Layout,
                    deployment: str | None) -> float:
    """A GPU-heavy stage: a process here, or a `gpu-stage` flow run on `deployment`'s work pool."""
    if deployment:
        return run_on_pool(deployment, stage, {"stage": stage}, params_file, overrides, layout)
    return run_stage_process([stage], params_file, overrides, layout)


@task(name="baseline", task_run_name="baseline", cache_key_fn=baseline_cache_key, persist_result=True)
def baseline(params_file: str, overrides: list[str], layout: Layout, deployment: str | None = None) -> float:
    return run_heavy_stage("baseline", params_file, overrides, layout, deployment)


@task(name="ptq", task_run_name="ptq-{recipe}", cache_key_fn=ptq_cache_key, persist_result=True)
def ptq(recipe: str, params_file: str, overrides: list[str], layout: Layout, max_parallel: int, threads: int,
        deployment: str | None = None) -> float:
    """One recipe: a stage process here, or a `ptq-recipe` flow run on `deployment`'s work pool."""
    if deployment:
        return run_on_pool(deployment, f"ptq-{recipe}", {"recipe": recipe}, params_file, overrides, layout)
    slots = _ptq_slots.setdefault(max_parallel, threading.Semaphore(max_parallel))
    with slots:
        return run_stage_process(["ptq", recipe], params_file, overrides, layout, threads)


def run_on_pool(deployment: str, name: str, what: dict, params_file: str, overrides: list[str],
                layout: Layout) -> float:
    """Run `deployment` (ptq-recipe/gpu or gpu-stage/gpu) for one stage and wait for it."""
    from prefect.deployments import run_deployment

    run = run_deployment(
        deployment, flow_run_name=name, poll_interval=2,
        parameters={**what, "params_file": params_file, "overrides": overrides,
                    "out_root": str(layout.root), "lock_token": os.environ.get(TOKEN_ENV)},
    )
    if not run.state or not run.state.is_completed():
        state = run.state.name if run.state else "unknown"
        raise StageFailed(f"{name}: flow run {run.name!r} on {deployment} ended {state}"
                          + (f": {run.state.message}" if run.state and run.state.message else ""))
    get_run_logger().info("%s: flow run %s completed on %s", name, run.name, run.work_pool_name)
    return (run.end_time - run.start_time).total_seconds() if run.start_time and run.end_time else 0.0


@task(name="selection", task_run_name="selection")
def selection(params_file: str, overrides: list[str], layout: Layout) -> float:
    return run_stage_process(["selection"], params_file, overrides, layout)


@task(name="qad", task_run_name="qad")
def qad(params_file: str, overrides: list[str], layout: Layout, deployment: str | None = None) -> float:
    return run_heavy_stage("qad", params_file, overrides, layout, deployment)


@task(name="final_eval", task_run_name="final_eval")
def final_eval(params_file: str, overrides: list[str], layout: Layout, deployment: str | None = None) -> float:
    return run_heavy_stage("final_eval", params_file, overrides, layout, deployment)


@task(name="export", task_run_name="export")
def export(params_file: str, overrides: list[str], layout: Layout, deployment: str | None = None) -> float:
    return run_heavy_stage("export", params_file, overrides, layout, deployment)


def parameter_overrides(base_model: str | None, recipes: list[str] | None, qad: dict[str, Any] | None) -> list[str]:
    """The flow's typed parameters as `section.key=value` overrides of params.yaml."""
    items = [f"base_model.path={base_model}"] if base_model else []
    if recipes is not None:
        items.append(f"ptq.recipes={json.dumps(recipes)}")
    items += [f"qad.{key}={json.dumps(value)}" for key, value in (qad or {}).items()]
    return items


@flow(name="qad-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=16), log_prints=True)
def qad_pipeline(
    params_file: str = "params.yaml",
    overrides: list[str] | None = None,
    out_root: str | None = None,
    base_model: str | None = None,
    recipes: list[str] | None = None,
    qad: dict[str, Any] | None = None,
    recipe_deployment: str | None = None,
    stage_deployment: str | None = None,
) -> dict:
    """Calibration -> BF16 baseline and PTQ recipes in parallel -> selection -> QAD -> eval -> export.

    Every parameter overrides params.yaml, which holds the defaults: `base_model` (a local folder
    or hub id), `recipes` (names in ptq.recipe_dir), `qad` (e.g. {"steps": 80, "lr": 5e-5}) and
    `overrides` (any `section.key=value`). `params_file` is relative to the working directory;
    `out_root` defaults to its folder. `recipe_deployment` (e.g. "ptq-recipe/gpu") runs each recipe
    as a flow run of that deployment instead of a process here; `stage_deployment` (e.g.
    "gpu-stage/gpu") does the same for baseline, qad, final_eval and export.
    """
    from qad_pipeline.cli import preflight

    overrides = list(overrides or []) + parameter_overrides(base_model, recipes, qad)
    params_file = str(Path(params_file).resolve())  # the stage processes run in its folder
    params = load_params(Path(params_file), overrides)  # a bad value fails here, before any model loads
    layout = Layout(output_root(out_root, params_file))
    # On a deployment the stages run on GPU workers: this (control) machine's memory says nothing.
    preflight(params, layout.root, memory=not (recipe_deployment or stage_deployment))
    logger = get_run_logger()
    with base_model_slot(params), run_lock(layout.root, "run the pipeline", on_stale=logger.warning) as token:
        previous, os.environ[TOKEN_ENV] = os.environ.get(TOKEN_ENV), token  # the stage processes pass it on
        try:
            with dvc_write_lock(layout.root, f"qad-pipeline run (Prefect flow run {_flow_run_name()}) is writing "
                                             "this project's outputs; wait for it to finish or cancel it"):
                summary = _run_stages(params_file, overrides, params, layout, recipe_deployment, stage_deployment)
        finally:
            if previous is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = previous
        recorded, message = versioning.record_run(
            layout.root, Path(params_file), overrides,
            versioning.stage_names([k for k in summary["seconds"] if "(wall)" not in k], params.ptq.recipes))
    (logger.info if recorded or not versioning.dvc_project(layout.root) else logger.warning)(message)
    summary["dvc"] = message
    return summary


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
    return concurrency(name, occupy=1, strict=True)


def _run_stages(params_file: str, overrides: list[str], params, layout: Layout, recipe_deployment: str | None,
                stage_deployment: str | None) -> dict:
    from qad_pipeline.memory import recipe_parallelism

    parent_run = start_tracking(layout, params)
    if parent_run:
        link_tracking(layout, params, parent_run)
    try:
        seconds = {"calibration": calibration(params_file, overrides, layout)}

        started = time.time()
        at_once = recipe_parallelism(params)
        threads = max(1, (os.cpu_count() or 1) // at_once)
        base = baseline.with_options(refresh_cache=not baseline_done(layout)).submit(
            params_file, overrides, layout, stage_deployment)
        recipes = {
            name: ptq.with_options(refresh_cache=not recipe_done(layout, name)).submit(
                name, params_file, overrides, layout, at_once, threads, recipe_deployment, wait_for=[base])
            for name in params.ptq.recipes
        }
        wait([base, *recipes.values()])
        seconds["baseline"] = base.result()  # no baseline, no recovery: a failed baseline fails the flow
        seconds.update({f"ptq/{n}": f.result() for n, f in recipes.items() if f.state.is_completed()})
        seconds["baseline+ptq (wall)"] = time.time() - started
        failed = [name for name, fut in recipes.items() if not fut.state.is_completed()]
        if failed:
            get_run_logger().warning("PTQ failed for %s; selecting among the others", ", ".join(failed))
        cached = [name for name, fut in recipes.items() if fut.state.name == "Cached"]
        if cached:
            get_run_logger().info("PTQ taken from cache (inputs unchanged): %s", ", ".join(cached))
        if base.state.name == "Cached":
            get_run_logger().info("baseline taken from cache (inputs unchanged)")

        seconds["selection"] = selection(params_file, overrides, layout)
        chosen = read_json(layout.selection_metrics)
        summary = {"selection": chosen, "recipes": recipe_rows(layout, params.ptq.recipes),
                   "weight_error": weight_error_rows(layout, params.ptq.recipes),
                   "failed": failed, "cached": cached, "baseline_cached": base.state.name == "Cached",
                   "seconds": seconds, "root": str(layout.root)}
        publish_recipe_table(params, summary)

        if chosen["selected"] is not None and params.selection.policy == "qad":
            seconds["qad"] = qad(params_file, overrides, layout, stage_deployment)
            seconds["final_eval"] = final_eval(params_file, overrides, layout, stage_deployment)
            seconds["export"] = export(params_file, overrides, layout, stage_deployment)
            summary["qad"] = read_json(layout.qad_metrics)
            summary["export"] = read_json(layout.export_metrics)
    except StageFailed as err:
        track(layout, params, f"FAILED: {err}", parent_run, None, status="FAILED")
        raise
    publish_report(params, summary)
    summary["plots"] = [str(p) for p in write_plots(layout, params.ptq.recipes)]
    summary["mlflow"] = track(layout, params, report_text(summary), parent_run, summary.get("export"))
    return summary



def start_tracking(layout: Layout, params) -> str | None:
    """Open the MLflow parent run at the start, so the run shows while it runs."""
    try:
        return tracking.start_pipeline_run(layout, params, flow_run_id=_flow_run_id(), git_commit=tracking.git_commit())
    except Exception as err:  # noqa: BLE001  (tracking must never cost the pipeline its results)
        get_run_logger().warning("MLflow: could not start the run (%s); results stay on disk", err)
        return None


def track(layout: Layout, params, report: str, parent_run: str | None, export_metrics: dict | None,
          status: str | None = None) -> dict:
    """Log the run's files to MLflow and register the export; on failure, say how to log later."""
    try:
        run_id = tracking.log_pipeline(layout, params, flow_run_id=_flow_run_id(), git_commit=tracking.git_commit(),
                                       report=report, run_id=parent_run, status=status)
        version = None
        if (export_metrics or {}).get("passed"):
            version = tracking.register_export(layout, params, run_id)
        return {"uri": tracking.tracking_uri(layout.root), "run_id": run_id, "model_version": version,
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
