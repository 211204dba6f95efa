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
from qad_pipeline.config import DEFAULT_PARAMS, PROJECT_ROOT, load_params
from qad_pipeline.layout import Layout
from qad_pipeline.report import recipe_rows, report_markdown

_ptq_slots: dict[int, threading.Semaphore] = {}


class StageFailed(RuntimeError):
    pass


def run_stage_process(stage: list[str], params_file: str, overrides: list[str], layout: Layout) -> float:
    """Run `qad-pipeline stage ...` in a child process; its output goes to artifacts/logs/."""
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
    with log_path.open("w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT).returncode
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
def baseline(params_file: str, overrides: list[str], layout: Layout) -> float:
    return run_stage_process(["baseline"], params_file, overrides, layout)


@task(name="ptq", task_run_name="ptq-{recipe}")
def ptq(recipe: str, params_file: str, overrides: list[str], layout: Layout, max_parallel: int) -> float:
    slots = _ptq_slots.setdefault(max_parallel, threading.Semaphore(max_parallel))
    with slots:
        return run_stage_process(["ptq", recipe], params_file, overrides, layout)


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
    params_file: str = str(DEFAULT_PARAMS),
    overrides: list[str] | None = None,
    out_root: str = str(PROJECT_ROOT),
) -> dict:
    """Calibration -> BF16 baseline and PTQ recipes in parallel -> selection -> QAD -> eval -> export."""
    overrides = list(overrides or [])
    params_file = str(Path(params_file).resolve())  # the stage processes run in the project root
    params = load_params(Path(params_file), overrides)
    layout = Layout(Path(out_root).resolve())
    seconds = {"calibration": calibration(params_file, overrides, layout)}

    started = time.time()
    base = baseline.submit(params_file, overrides, layout)
    recipes = {
        name: ptq.submit(name, params_file, overrides, layout, params.ptq.max_parallel)
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
    create_markdown_artifact(key="qad-pipeline-report", markdown=report_markdown(summary))
    return summary
