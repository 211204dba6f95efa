"""What both flows share beneath their diagrams: how one stage becomes a Prefect task run.

`submit_stages` submits the stages of a run (`qad_pipeline.core.stages.planned`) as task runs, each
waiting for the task runs of the stages its `Stage.after` names (the edges in Prefect's graph).
`run_stage` is the one generic task: a stage process here (`flows/stage_process.py`), or a flow run on a
GPU pool (`run_on_pool`) with `recipe_deployment`/`stage_deployment`; a cached stage's key is
`stage_cache_key`. `start_job` loads and checks the params before any stage starts, and
`holding_outputs` takes every hold a run keeps on its out-root; `stop_everything` is what a
stopped run does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import allow_failure, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from flows.stage_process import StageFailed, run_stage_process, warm_fork_server
from qad_pipeline.plan import gpus, pools
from qad_pipeline.platform import processes
from qad_pipeline.core.artifacts import list_files
from qad_pipeline.core.config import Params, load_params, resolve
from qad_pipeline.core.layout import Layout, output_root
from qad_pipeline.plan.preflight import preflight
from qad_pipeline.results.base import read_result
from qad_pipeline.results.selection_metrics import SelectionResult
from qad_pipeline.platform.runlock import TOKEN_ENV, dvc_write_lock, run_lock
from qad_pipeline.core.stage_types import Stage, fill
from qad_pipeline.core.stages import STAGES


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
    gpus: tuple[str, ...] = ()  # the GPUs this machine hands to its stage processes (qad_pipeline.plan.gpus)
    placed: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (summary key, the GPUs it claims first: gpus.layout)
    job_gpus: tuple[tuple[str, int], ...] = ()  # (summary key, the GPUs its Job on a pool asks for: qad_pipeline.plan.pools)
    settled: tuple[str, ...] = ()  # what the memory plan chose for the `auto` keys, as overrides (memory.settled_overrides)

    @property
    def stage_overrides(self) -> list[str]:
        """A stage process's overrides: the run's, then the plan's choices (not in the cache key: a
        different choice computes the same thing)."""
        return [*self.overrides, *self.settled]


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
    """A registry path: `${section.key}` paths are the params file's (relative to its folder),
    `{selected}/...` the selected candidate's folder (none selected: a path that does not exist),
    the others the out-root's."""
    path = fill(template, recipe)
    if path.startswith("{selected}"):
        selected = layout.selection_metrics.is_file() and read_result(layout.selection_metrics, SelectionResult).selected
        return (layout.candidate(selected) if selected else layout.root / "none-selected") / path.partition("/")[2]
    if "${" not in path:
        return layout.root / path
    values = params.model_dump()
    return resolve(re.sub(r"\$\{([\w.]+)\}", lambda m: str(_picked(values, (m[1],))[m[1]]), path))


def stage_cache_key(context, arguments: dict[str, Any]) -> str:
    """A cached stage's inputs: its params keys, the files standing for its data inputs (`_identity`),
    its code (the registry's import graph), the base model
    (file listing with sizes and times, or hub id and revision) and the out-root. Unchanged inputs:
    Prefect takes the last result from cache."""
    stage, recipe, job = STAGES[arguments["stage"]], arguments["recipe"], arguments["job"]
    params = load_params(Path(job.params_file), job.overrides)
    digest = hashlib.sha256(json.dumps(
        [stage.run_name(recipe), str(job.layout.root), _picked(params.model_dump(), stage.params)],
        sort_keys=True, default=str).encode())
    files = [_declared_path(f, params, job.layout, recipe) for f in stage.fingerprints] + stage.code_files()
    for path in files:
        digest.update(str(path).encode())
        digest.update(_identity(path))
    model = resolve(params.base_model.path)
    if model.is_dir():
        digest.update(json.dumps(list_files(model)).encode())
    return f"{stage.run_name(recipe)}-{digest.hexdigest()[:32]}"


def _identity(path: Path) -> bytes:
    """What stands for one input in a cache key: a small file's bytes; a large file's (calibration
    text) or a folder's files' names, sizes and times (read in a stat, not hours of hashing)."""
    if path.is_dir():
        return json.dumps(list_files(path)).encode()
    if not path.is_file():
        return b"<missing>"
    stat = path.stat()
    return path.read_bytes() if stat.st_size <= 2**20 else f"{stat.st_size}:{stat.st_mtime_ns}".encode()


def outputs_present(stage: Stage, layout: Layout, recipe: str | None) -> bool:
    """The files a cached result points at are still there (else it must run again)."""
    return all((layout.root / fill(p, recipe)).exists() for p in stage.done)


def route(stage: str, item: str | None, job: Job) -> tuple[str | None, dict]:
    """Where a stage runs (`pools.deployment_of`): (a deployment, its flow run's parameters), or
    (None, {}) for a process here."""
    deployment = pools.deployment_of(stage, job.recipe_deployment, job.stage_deployment)
    if deployment is None:
        return None, {}
    if deployment == job.recipe_deployment and STAGES[stage].over_recipes:
        return deployment, {"recipe": item}
    return deployment, {"stage": stage, **({"item": item} if item else {})}


@task(persist_result=True)
def run_stage(stage: str, recipe: str | None, job: Job) -> float:
    """One stage: a process here (`qad-pipeline stage ...`) on the GPUs it claims, or a flow run on
    a GPU deployment's pool."""
    declared = STAGES[stage]
    deployment, parameters = route(stage, recipe, job)
    if deployment:
        return run_on_pool(deployment, declared.run_name(recipe), parameters, job,
                           dict(job.job_gpus).get(declared.summary_key(recipe)))
    at_once = _ptq_slots.setdefault(job.at_once, threading.Semaphore(job.at_once)) if declared.per_recipe else nullcontext()
    prefer = dict(job.placed).get(declared.summary_key(recipe), ())
    with at_once, gpus.claim(len(prefer), job.gpus, declared.run_name(recipe), get_run_logger().info,
                             prefer) as claimed:
        return run_stage_process([stage, *([recipe] if recipe else [])], job.params_file, job.stage_overrides, job.layout,
                                 job.threads if declared.per_recipe else None, env=gpus.env_for(claimed))


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


def submit_stages(job: Job, runs: list[tuple[Stage, str | None]],
                  futures: dict[str, dict[str | None, PrefectFuture]] | None = None
                  ) -> dict[str, dict[str | None, PrefectFuture]]:
    """Submit each (stage, item) of `runs`, in order, waiting for every task run of the stages its
    `Stage.after` names (those of this run: `futures`, and the ones submitted here). An upstream
    that may fail alone (`Stage.may_fail`: a recipe, a sweep point, the curve) is waited for
    whatever its end; any other failed upstream leaves its dependents unstarted (NotReady).
    Returns {stage: {item: future}}, `futures` included."""
    futures = dict(futures or {})
    for declared, item in runs:
        upstream = [allow_failure(f) if STAGES[name].may_fail else f
                    for name in declared.after for f in futures.get(name, {}).values()]
        futures.setdefault(declared.name, {})[item] = submit(job, declared.name, item, after=upstream)
    return futures


def fail_on_required(futures: dict[str, dict[str | None, PrefectFuture]], required: Callable[[Stage], bool]) -> None:
    """Raise the error of the first stage (in registry order) that failed and that `required` says
    may not fail alone (the pipeline's: all but a recipe and the sweep's stages; the sweep's: all
    but a budget's point)."""
    for name, items in futures.items():
        for future in items.values():
            if required(STAGES[name]) and not future.state.is_completed():
                future.result()  # raises the stage's own error (StageFailed)
                raise StageFailed(f"{name}: {future.state.name}")


def start_job(params_file: str, overrides: list[str], out_root: str | None, recipe_deployment: str | None,
              stage_deployment: str | None, sweep: bool = False) -> tuple[Params, Job]:
    """A run's params (a bad value fails here) and its `Job`, after the preflight: every input read
    before any model loads. `sweep`: the BPE sweep's flow."""
    from qad_pipeline.plan.capacity import capacity, target_capacity
    from qad_pipeline.plan.memory import recipe_parallelism, settled, settled_overrides
    from qad_pipeline.core.stages import planned, with_sweep

    params_file = str(Path(params_file).resolve())  # the stage processes run in its folder
    params = load_params(Path(params_file), overrides)
    layout = Layout(output_root(out_root, params_file))
    # On a deployment the stages run on GPU workers: this (control) machine's memory says nothing.
    preflight(params, layout.root, memory=not (recipe_deployment or stage_deployment), sweep=sweep)
    cap = capacity(params.hardware)
    on_pools = recipe_deployment or stage_deployment
    # every `auto` as the plan settles it: against this machine, or for the stages on GPU workers against
    # hardware.target (without one, each stage process settles its own on its worker)
    where = target_capacity(params.hardware.target) if on_pools and params.hardware.target else cap
    placing = settled(params, where, sweep=sweep or with_sweep(params))
    chosen = settled_overrides(params, placing) if not on_pools or params.hardware.target else []
    job_gpus = pools.for_run(placing, recipe_deployment, stage_deployment, sweep)  # each pool can give its Jobs
    at_once = recipe_parallelism(placing, cap, sweep=sweep or with_sweep(params))
    seen = gpus.visible(len(cap.gpu_bytes))
    runs = [(declared.name, item) for declared, item in planned(params, sweep_only=sweep)]
    placed = tuple(gpus.layout(runs, placing, seen, at_once).items()) if seen else ()
    return params, Job(params_file, overrides, layout, recipe_deployment, stage_deployment,
                       at_once, max(1, (os.cpu_count() or 1) // at_once), seen, placed, job_gpus, tuple(chosen))


def run_on_pool(deployment: str, name: str, what: dict, job: Job, gpus: int | None = None) -> float:
    """Run `deployment` (ptq-recipe/gpu or gpu-stage/gpu) for one stage and wait for it; `gpus`: its
    Job's GPU request (the pool's job variable; None for a pool without it)."""
    from prefect.deployments import run_deployment

    run = run_deployment(
        deployment, flow_run_name=name, poll_interval=2,
        job_variables={pools.GPU_VARIABLE: gpus} if gpus is not None else None,
        parameters={**what, "params_file": job.params_file, "overrides": job.stage_overrides,
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

    me = flow_run_id()
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
        warm_fork_server()  # its imports (CPU only) go on while the run starts its tracking
        try:
            with dvc_write_lock(layout.root, f"qad-pipeline run (Prefect flow run {flow_run_name()}) is writing "
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


def flow_run_name() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.name


def flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.id
