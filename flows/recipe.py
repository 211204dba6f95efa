"""The GPU flows: `ptq-recipe` (one PTQ recipe, deployed as `ptq-recipe/gpu`) and `gpu-stage`
(baseline, qad, final_eval or export, deployed as `gpu-stage/gpu`), each as its own flow run.

The `qad-pipeline` flow, run from a deployment with `recipe_deployment` set, starts one
`ptq-recipe` run per recipe on that deployment's work pool and waits for all of them. Each run
takes its GPUs (`qad_pipeline.plan.gpus`: one per recipe unless `ptq.gpus_per_recipe` says more) out of
those its worker sees: a process worker's own `CUDA_VISIBLE_DEVICES`, or a Kubernetes job's
`nvidia.com/gpu` request; two runs of one worker never share a GPU (a run waits for a free one),
and the worker's `--limit` keeps it from taking more runs than it has GPUs. The run executes the same
`qad-pipeline stage ptq <recipe>` command as every other way of running the pipeline, in the
project folder, writing under `out_root` (a filesystem every worker shares). With
`stage_deployment` set, the parent runs its other GPU-heavy stages the same way, as `gpu-stage`
flow runs on the GPU pool, so no model is loaded on the CPU-only control pool. The stage itself
decides its device from `hardware.device` (`auto`: the GPU the worker gives it).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from prefect import flow

from flows.stage_process import run_stage_process
from qad_pipeline.plan import gpus
from qad_pipeline.plan.memory import settled_here
from qad_pipeline.core.config import load_params
from qad_pipeline.core.layout import Layout, output_root
from qad_pipeline.platform.runlock import TOKEN_ENV
from qad_pipeline.core.stages import GPU_STAGES, RECIPES


def _run_here(stage: list[str], params_file: str, overrides: list[str] | None, out_root: str | None,
              lock_token: str | None) -> dict:
    """Run `qad-pipeline stage ...` on this worker, on the GPUs it claims of the worker's; say where
    it ran (host, process, devices)."""
    params_file = str(Path(params_file).resolve())
    layout = Layout(output_root(out_root, params_file))
    params = load_params(Path(params_file), list(overrides or []))
    seen = gpus.of_worker(params)
    params = settled_here(params) if seen else params  # the GPUs a recipe's model spreads over, for this worker
    with gpus.claim(gpus.needed(stage[0], params, len(seen)), seen, "-".join(stage), print) as claimed:
        env = {**({TOKEN_ENV: lock_token} if lock_token else {}), **gpus.env_for(claimed)}
        # a flow run of one stage: a fresh process (a fork server's imports would only add to it)
        seconds = run_stage_process(stage, params_file, list(overrides or []), layout, env=env, fork=False)
    return {"seconds": seconds, "host": socket.gethostname(), "pid": os.getpid(),
            "devices": ",".join(claimed) if claimed else os.environ.get("CUDA_VISIBLE_DEVICES")}


@flow(name="ptq-recipe", flow_run_name="ptq-{recipe}", log_prints=True)
def ptq_recipe(
    recipe: str,
    params_file: str = "params.yaml",
    overrides: list[str] | None = None,
    out_root: str | None = None,
    lock_token: str | None = None,
) -> dict:
    """Quantize, calibrate and evaluate one recipe; fails when the stage fails.

    `lock_token` is the parent run's hold on `out_root` (see qad_pipeline.platform.runlock).
    """
    return {"recipe": recipe, **_run_here([RECIPES.name, recipe], params_file, overrides, out_root, lock_token)}


@flow(name="gpu-stage", flow_run_name="{stage}", log_prints=True)
def gpu_stage(
    stage: str,
    params_file: str = "params.yaml",
    overrides: list[str] | None = None,
    out_root: str | None = None,
    lock_token: str | None = None,
    item: str | None = None,
) -> dict:
    """Run one of the GPU-heavy stages (baseline, sweep_search, qad, final_eval, export, or `sweep`
    with its budget as `item`); fails when it fails."""
    if stage not in GPU_STAGES:
        raise ValueError(f"gpu-stage runs one of {list(GPU_STAGES)}, not {stage!r}")
    return {"stage": stage, **_run_here([stage, *([item] if item else [])], params_file, overrides, out_root,
                                        lock_token)}
