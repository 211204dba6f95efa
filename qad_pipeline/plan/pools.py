"""What each stage's Job asks of its work pool, and whether the pool can give it.

With `recipe_deployment` or `stage_deployment` (Kubernetes: `ptq-recipe/gpu`, `gpu-stage/gpu`),
every GPU-heavy stage is a flow run of its own on the GPU pool, that is one Kubernetes Job whose
`nvidia.com/gpu` request and limit are its job variable `gpus` (infra/k8s/base/gpu-base-job-template.json).
Its flow run asks for what the stage needs on one node of the pool (`gpus.needed`): a PTQ recipe
`ptq.gpus_per_recipe` (one, or the node's GPUs with `hardware.device_map: auto`), QAD `qad.num_gpus`
(with `qad.num_nodes > 1`: none, its pod submits the Kubeflow TrainJob whose pods take
`qad.num_gpus` each), the other GPU-heavy stages one (or the node's, with `device_map: auto`).

A pool gives one Job at most the `maximum` of its template's `gpus` variable: the GPUs of one of
its nodes, which the pool's ConfigMap declares (`gpus=8`, infra/k8s/base/sync_work_pool.py), and
Prefect's server refuses a flow run that asks for more. So that a run never fails on that after
hours of PTQ, the run's preflight asks the server for each routed pool's limit and refuses the
run in one line before any work when a stage asks more (`check`); offline, the plan does the
same with the limit the params declare (`hardware.pool_gpus`, else `hardware.target`'s count).
"""

from __future__ import annotations

from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.plan.gpus import needed
from qad_pipeline.core.stages import STAGES, planned

GPU_VARIABLE = "gpus"  # the GPU pool's job variable: the Job's nvidia.com/gpu request and limit


def declared_limit(params: Params) -> int | None:
    """The most GPUs one Job of the GPU pool gets, as the params declare it (None: not declared)."""
    if params.hardware.pool_gpus is not None:
        return params.hardware.pool_gpus
    if params.hardware.target:
        from qad_pipeline.core.targets import parse

        return parse(params.hardware.target).count
    return None


def job_gpus(stage: str, params: Params, node_gpus: int) -> int:
    """The GPUs the Job of one process of `stage` asks for on a pool whose nodes have `node_gpus`."""
    declared = STAGES[stage]
    if declared.gpu and declared.load("gpus").elsewhere(params):
        return 0  # e.g. QAD across nodes: the pod submits the TrainJob (qad_pipeline/training/trainjob.py) and waits
    return needed(stage, params, node_gpus)


def knob(stage: str, params: Params) -> str:
    """The setting that makes `stage` ask for its GPUs, as the refusal names it."""
    return STAGES[stage].load("gpus").knob(params)


def deployment_of(stage: str, recipe_deployment: str | None, stage_deployment: str | None) -> str | None:
    """Where one process of `stage` runs: a recipe on `recipe_deployment` (`ptq-recipe`) when it is
    set; every GPU-heavy stage, a recipe too when there is no `recipe_deployment`, on
    `stage_deployment` (`gpu-stage`); None: a process on the run's own machine."""
    if STAGES[stage].over_recipes and recipe_deployment:
        return recipe_deployment
    return stage_deployment if STAGES[stage].gpu else None


def routed(params: Params, recipe_deployment: str | None, stage_deployment: str | None,
           sweep: bool = False) -> list[tuple[str, str | None, str]]:
    """(stage, item, deployment) of every planned stage process that runs as a flow run on a pool."""
    return [(declared.name, item, deployment) for declared, item in planned(params, sweep_only=sweep)
            if (deployment := deployment_of(declared.name, recipe_deployment, stage_deployment))]


def requests(params: Params, routes: list[tuple[str, str | None, str]], limits: dict[str, int | None]
             ) -> dict[str, int]:
    """The GPUs each routed stage process's Job asks for, by its summary key (`qad`, `ptq/<recipe>`).
    A pool of unknown limit (no `gpus` variable: a process pool) is asked for what one GPU node of
    `hardware.target` (or one GPU) needs."""
    fallback = declared_limit(params) or 1
    return {STAGES[stage].summary_key(item): job_gpus(stage, params, limits.get(deployment) or fallback)
            for stage, item, deployment in routes}


def check(params: Params, routes: list[tuple[str, str | None, str]], limits: dict[str, int | None],
          source: str) -> dict[str, int]:
    """The Jobs' GPU requests (`requests`); ConfigError, one line, for the first stage whose Job
    would ask its pool for more GPUs than the pool gives. `source` says where the limits come from."""
    asked = requests(params, routes, limits)
    for stage, item, deployment in routes:
        limit, wants = limits.get(deployment), asked[STAGES[stage].summary_key(item)]
        if limit is not None and wants > limit:
            raise ConfigError(
                f"{STAGES[stage].run_name(item)} needs {wants} GPUs in one Job ({knob(stage, params)}) but {deployment}'s "
                f"pool gives a Job at most {limit} ({source}): lower {knob(stage, params).split('=')[0]}, or give the "
                "stages a pool whose nodes have more GPUs (stage_deployment; infra/k8s/components/gpu-pool-4 shows how)")
    return asked


def server_limits(deployments: set[str]) -> dict[str, int | None]:
    """Each deployment's pool limit as Prefect's server has it: its work pool's `gpus` maximum (None
    for a pool without that variable, such as a process pool)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    limits: dict[str, int | None] = {}
    with get_client(sync_client=True) as client:
        for name in sorted(deployments):
            try:
                deployment = client.read_deployment_by_name(name)
            except ObjectNotFound:
                raise ConfigError(f"deployment {name!r} does not exist on this Prefect server: deploy it first "
                                  "(prefect deploy --all, infra/README.md)") from None
            pool = client.read_work_pool(deployment.work_pool_name) if deployment.work_pool_name else None
            variable = (pool.base_job_template.get("variables", {}).get("properties", {}).get(GPU_VARIABLE, {})
                        if pool else {})
            limits[name] = variable.get("maximum")
    return limits


def plan_line(params: Params) -> str | None:
    """The plan's line on the pool path: each GPU stage's Job and its GPUs, against the declared limit;
    None when the params declare no limit. Raises ConfigError when a Job asks more than the limit."""
    limit = declared_limit(params)
    if limit is None:
        return None
    source = "hardware.pool_gpus" if params.hardware.pool_gpus is not None else f"hardware.target {params.hardware.target}"
    routes = routed(params, "ptq-recipe/gpu", "gpu-stage/gpu")
    asked = check(params, routes, {"ptq-recipe/gpu": limit, "gpu-stage/gpu": limit}, source)
    jobs: dict[str, list[int]] = {}
    for key, count in asked.items():
        jobs.setdefault(key.split("/")[0], []).append(count)
    parts = [f"{name} {counts[0]}" + (f" each x{len(counts)}" if len(counts) > 1 else "") for name, counts in jobs.items()]
    return (f"on the GPU pool (deployments ptq-recipe/gpu, gpu-stage/gpu): one Job per stage process, GPUs: "
            f"{', '.join(parts)}; a Job gets at most {limit} ({source})")


def for_run(params: Params, recipe_deployment: str | None, stage_deployment: str | None,
            sweep: bool = False) -> tuple[tuple[str, int], ...]:
    """A deployment run's Jobs: (summary key, the GPUs its flow run asks for) of each stage process
    routed to a pool whose template has the `gpus` variable, after `check` against each pool's limit
    (its server's, else the declared one). Nothing routed: ()."""
    routes = routed(params, recipe_deployment, stage_deployment, sweep)
    if not routes:
        return ()
    on_server = server_limits({deployment for *_, deployment in routes})
    limits = {name: limit if limit is not None else declared_limit(params) for name, limit in on_server.items()}
    asked = check(params, routes, limits, "the gpus maximum of its base job template, or hardware.pool_gpus")
    return tuple((STAGES[stage].summary_key(item), asked[STAGES[stage].summary_key(item)])
                 for stage, item, deployment in routes if on_server[deployment] is not None)
