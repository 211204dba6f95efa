"""The `qad-pipeline` Prefect flow: `qad-pipeline run` (locally) or `prefect deployment run qad-pipeline/...`.

    calibration ──┬── baseline (BF16 eval) ──────────┐
                  └── ptq × 5 recipes, in parallel ──┴── selection ── qad ── final_eval ── export

With `selection.policy: ptq_final` the flow ends at selection (PTQ is the last step); when no
recipe qualifies it ends there too, and the report says why.

Each heavy stage runs as its own process (`qad-pipeline stage ...`, the same command that
`dvc repro` runs), so a recipe that crashes or runs out of memory fails alone: the flow reports
it and selection goes on among the survivors. The flow body only wires stages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from qad_pipeline.artifacts import read_json
from qad_pipeline.config import load_params
from qad_pipeline.layout import Layout
from qad_pipeline.plots import write_plots
from qad_pipeline import tracking, versioning
from qad_pipeline.runlock import TOKEN_ENV, dvc_write_lock, run_lock
from qad_pipeline.report import recipe_rows, report_markdown, report_text

_ptq_slots: dict[int, threading.Semaphore] = {}


class StageFailed(RuntimeError):
    pass


def run_stage_process(
    stage: list[str], params_file: str, overrides: list[str], layout: Layout, threads: int | None = None
) -> float:
    """Run `qad-pipeline stage ...` in a child process; its output goes to artifacts/logs/.

    `threads` caps the child's CPU threads (OMP_NUM_THREADS) when several stages share the
    machine's cores, unless the caller's environment already sets OMP_NUM_THREADS.
    """
    logger = get_run_logger()
    name = "-".join(stage)
    layout.logs.mkdir(parents=True, exist_ok=True)
    log_path = layout.logs / f"{name}.log"
    cmd = [sys.executable, "-m", "qad_pipeline", "stage", *stage, "--params", params_file,
           "--out-root", str(layout.root)]
    for item in overrides:
        cmd += ["--set", item]
    logger.info("%s: started (log: %s)", name, log_path)
    started = time.time()
    env = dict(os.environ)
    if threads and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads)
    with log_path.open("w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(params_file).parent, env=env).returncode
    elapsed = time.time() - started
    if code != 0:
        tail = log_path.read_text().strip().splitlines()[-5:]
        why = "killed (out of memory?)" if code < 0 else f"exit code {code}"
        raise StageFailed(f"{name} failed after {elapsed:.0f}s, {why}; last lines of {log_path}:\n" + "\n".join(tail))
    logger.info("%s: done in %.1fs", name, elapsed)
    return elapsed


@task(name="calibration")
def calibration(params_file: str, overrides: list[str], layout: Layout) -> float:
    return run_stage_process(["calibration"], params_file, overrides, layout)


@task(name="baseline")
def baseline(params_file: str, overrides: list[str], layout: Layout, threads: int) -> float:
    return run_stage_process(["baseline"], params_file, overrides, layout, threads)


@task(name="ptq", task_run_name="ptq-{recipe}")
def ptq(recipe: str, params_file: str, overrides: list[str], layout: Layout, max_parallel: int, threads: int) -> float:
    slots = _ptq_slots.setdefault(max_parallel, threading.Semaphore(max_parallel))
    with slots:
        return run_stage_process(["ptq", recipe], params_file, overrides, layout, threads)


@task(name="selection")
def selection(params_file: str, overrides: list[str], layout: Layout) -> float:
    return run_stage_process(["selection"], params_file, overrides, layout)


@task(name="qad")
def qad(params_file: str, overrides: list[str], layout: Layout) -> float:
    return run_stage_process(["qad"], params_file, overrides, layout)


@task(name="final_eval")
def final_eval(params_file: str, overrides: list[str], layout: Layout) -> float:
    return run_stage_process(["final_eval"], params_file, overrides, layout)


@task(name="export")
def export(params_file: str, overrides: list[str], layout: Layout) -> float:
    return run_stage_process(["export"], params_file, overrides, layout)


@flow(name="qad-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=16), log_prints=True)
def qad_pipeline(
    params_file: str = "params.yaml",
    overrides: list[str] | None = None,
    out_root: str | None = None,
) -> dict:
    """Calibration -> BF16 baseline and PTQ recipes in parallel -> selection -> QAD -> eval -> export.

    `params_file` is relative to the working directory; `out_root` defaults to its folder.
    """
    overrides = list(overrides or [])
    params_file = str(Path(params_file).resolve())  # the stage processes run in its folder
    params = load_params(Path(params_file), overrides)
    layout = Layout(Path(out_root or Path(params_file).parent).resolve())
    logger = get_run_logger()
    with run_lock(layout.root, "run the pipeline", on_stale=logger.warning) as token:
        previous, os.environ[TOKEN_ENV] = os.environ.get(TOKEN_ENV), token  # the stage processes pass it on
        try:
            with dvc_write_lock(layout.root, f"qad-pipeline run (Prefect flow run {_flow_run_name()}) is writing "
                                             "this project's outputs; wait for it to finish or cancel it"):
                summary = _run_stages(params_file, overrides, params, layout)
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


def _run_stages(params_file: str, overrides: list[str], params, layout: Layout) -> dict:
    parent_run = start_tracking(layout, params)
    try:
        seconds = {"calibration": calibration(params_file, overrides, layout)}

        started = time.time()
        at_once = min(params.ptq.max_parallel, len(params.ptq.recipes)) + 1  # + the baseline
        threads = max(1, (os.cpu_count() or 1) // at_once)
        base = baseline.submit(params_file, overrides, layout, threads)
        recipes = {
            name: ptq.submit(name, params_file, overrides, layout, params.ptq.max_parallel, threads)
            for name in params.ptq.recipes
        }
        wait([base, *recipes.values()])
        seconds["baseline"] = base.result()  # no baseline, no recovery: a failed baseline fails the flow
        seconds.update({f"ptq/{n}": f.result() for n, f in recipes.items() if f.state.is_completed()})
        seconds["baseline+ptq (wall)"] = time.time() - started
        failed = [name for name, fut in recipes.items() if not fut.state.is_completed()]
        if failed:
            get_run_logger().warning("PTQ failed for %s; selecting among the others", ", ".join(failed))

        seconds["selection"] = selection(params_file, overrides, layout)
        chosen = read_json(layout.selection_metrics)
        summary = {"selection": chosen, "recipes": recipe_rows(layout, params.ptq.recipes),
                   "failed": failed, "seconds": seconds, "root": str(layout.root)}
        create_table_artifact(key="recipe-table", table=summary["recipes"], description=chosen["reason"])

        if chosen["selected"] is not None and params.selection.policy == "qad":
            seconds["qad"] = qad(params_file, overrides, layout)
            seconds["final_eval"] = final_eval(params_file, overrides, layout)
            seconds["export"] = export(params_file, overrides, layout)
            summary["qad"] = read_json(layout.qad_metrics)
            summary["export"] = read_json(layout.export_metrics)
    except StageFailed as err:
        track(layout, params, f"FAILED: {err}", parent_run, None, status="FAILED")
        raise
    create_markdown_artifact(key="qad-pipeline-report", markdown=report_markdown(summary))
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
