"""Each stage's Job on a work pool asks for the GPUs the stage needs, and a run whose stage asks a
pool for more than its nodes have is refused in one line before any work (qad_pipeline/plan/pools.py);
the plan shows each Job. The pool's own limit against a real Prefect server: test_infra_kustomize."""

from types import SimpleNamespace

import pytest

from flows import runtime
from qad_pipeline.plan import pools
from qad_pipeline.core.config import PROJECT_ROOT, ConfigError, load_params

PROFILE = PROJECT_ROOT / "profiles" / "llama-3.1-8b_8xh100.yaml"
RECIPES, STAGES = "ptq-recipe/gpu", "gpu-stage/gpu"


def profile(**overrides):
    return load_params(PROFILE, [f"{k}={v}" for k, v in overrides.items()])


def test_each_stage_asks_for_what_it_needs_on_a_node_of_the_pool():
    params = profile(**{"hardware.device_map": "single"})
    asked = pools.requests(params, pools.routed(params, RECIPES, STAGES), {RECIPES: 8, STAGES: 8})
    assert asked["qad"] == 8  # qad.num_gpus
    assert {asked[k] for k in asked if k.startswith("ptq/")} == {1}  # device_map single: one GPU per recipe
    assert asked["baseline"] == asked["final_eval"] == asked["export"] == 1
    spread = profile()  # device_map auto, gpus_per_recipe not settled: the node's
    assert pools.requests(spread, pools.routed(spread, RECIPES, STAGES), {RECIPES: 4, STAGES: 4})["baseline"] == 4
    nodes = profile(**{"qad.num_nodes": 2})  # its pod submits the TrainJob, whose pods take the GPUs
    assert pools.requests(nodes, pools.routed(nodes, RECIPES, STAGES), {RECIPES: 8, STAGES: 8})["qad"] == 0
    # no stage deployment: only the recipes are flow runs on a pool
    assert [stage for stage, _, _ in pools.routed(params, RECIPES, None)] == ["ptq"] * len(params.ptq.recipes)


def test_a_run_whose_stage_asks_a_pool_for_more_gpus_than_it_gives_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(pools, "server_limits", lambda deployments: {RECIPES: 8, STAGES: 4})
    with pytest.raises(ConfigError) as err:
        pools.for_run(profile(), RECIPES, STAGES)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("qad needs 8 GPUs in one Job (qad.num_gpus=8) but gpu-stage/gpu's pool gives a Job at most 4")
    # the same run on pools that can: each Job's request, as the flow runs pass it
    monkeypatch.setattr(pools, "server_limits", lambda deployments: {RECIPES: 8, STAGES: 8})
    from qad_pipeline.plan import capacity, memory

    settled = memory.settled(profile(), capacity.target_capacity("8xH100-80GB"))  # as the flow passes them
    jobs = dict(pools.for_run(settled, RECIPES, STAGES))
    assert jobs["qad"] == 8 and jobs["ptq/nvfp4_max-mamba_fp8-kv_fp8"] == 1
    # a pool without the variable (a process pool): nothing passed, the declared limit still checked
    monkeypatch.setattr(pools, "server_limits", lambda deployments: {RECIPES: None, STAGES: None})
    assert pools.for_run(profile(), RECIPES, STAGES) == ()
    with pytest.raises(ConfigError, match="at most 2"):
        pools.for_run(profile(**{"hardware.pool_gpus": 2}), RECIPES, STAGES)


def test_a_flow_run_on_a_pool_passes_its_gpus_as_the_job_variable(monkeypatch, tmp_path):
    import prefect.deployments

    seen = {}

    def fake_run_deployment(name, **kwargs):
        seen.update(kwargs, name=name)
        return SimpleNamespace(state=SimpleNamespace(is_completed=lambda: True, name="Completed"), name="r",
                               work_pool_name="qad-gpu", start_time=None, end_time=None)

    monkeypatch.setattr(prefect.deployments, "run_deployment", fake_run_deployment)
    monkeypatch.setattr(runtime, "get_run_logger", lambda: SimpleNamespace(info=lambda *a: None))
    job = runtime.Job(str(PROFILE), [], runtime.Layout(tmp_path), RECIPES, STAGES, job_gpus=(("qad", 8),))
    runtime.run_on_pool(STAGES, "qad", {"stage": "qad"}, job, dict(job.job_gpus)["qad"])
    assert (seen["name"], seen["job_variables"]) == (STAGES, {"gpus": 8})
    runtime.run_on_pool(STAGES, "qad", {"stage": "qad"}, job, None)  # a pool without the variable
    assert seen["job_variables"] is None


def test_the_plan_shows_each_job_and_refuses_a_pool_too_small_in_one_line():
    from typer.testing import CliRunner

    from qad_pipeline.cli import app

    def plan(*extra):
        return CliRunner().invoke(app, ["plan", "--params", str(PROFILE), *extra])

    shown = plan()
    assert shown.exit_code == 0, shown.output
    (line,) = [ln for ln in shown.stdout.splitlines() if ln.startswith("on the GPU pool")]
    assert "qad 8" in line and "ptq 1 each x4" in line and "at most 8 (hardware.target 8xH100-80GB)" in line
    refused = plan("--set", "hardware.pool_gpus=4")
    assert refused.exit_code == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "error: qad needs 8 GPUs in one Job (qad.num_gpus=8) but gpu-stage/gpu's pool gives a Job at most 4 "
        "(hardware.pool_gpus): lower qad.num_gpus, or give the stages a pool whose nodes have more GPUs "
        "(stage_deployment; infra/k8s/components/gpu-pool-4 shows how)"]
