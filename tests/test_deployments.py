"""`prefect deployment run qad-pipeline/default` against a real local Prefect server (SQLite), with
a control worker and two process workers standing in for two GPUs, deployed from prefect.yaml."""

import os
import shutil
import signal
import time
from datetime import timedelta

import psutil
import pytest

from qad_pipeline.core.config import PROJECT_ROOT
from tests.devstack import LocalPrefect
from tests.conftest import GOOD_RECIPES, TINY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalPrefect(tmp_path_factory.mktemp("prefect")) as stack:
        stack.worker("qad-control", "control", limit=4)
        for gpu in (0, 1):
            stack.worker("qad-gpu", f"gpu-{gpu}", {"CUDA_VISIBLE_DEVICES": str(gpu), "OMP_NUM_THREADS": "1"})
        stack.deploy()
        yield stack


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipes")
    for name in GOOD_RECIPES:
        shutil.copy(PROJECT_ROOT / "recipes" / f"{name}.yaml", folder)
    return folder


def params(out_root, recipe_dir) -> dict:
    # PTQ only: the policy ptq_final with nothing exported ends the flow at selection.
    return {"out_root": str(out_root), "recipes": GOOD_RECIPES,
            "overrides": [*TINY, f"ptq.recipe_dir={recipe_dir}", "selection.policy=ptq_final", "export.source=none"]}


def recipe_runs(stack, parent_id) -> dict:
    """The parent's ptq-recipe flow runs, by recipe."""
    runs = [r for r in stack.flow_runs("ptq-recipe") if r.parameters.get("out_root")]
    with stack.client() as client:
        parent_tasks = {t.id for t in client.read_task_runs() if str(t.flow_run_id) == str(parent_id)}
    return {r.parameters["recipe"]: r for r in runs if r.parent_task_run_id in parent_tasks}


def working_recipes(stack, parent_id, names, timeout: float = 300, completed_ok: bool = False) -> dict:
    """Wait until each recipe in `names` runs as a ptq-recipe flow run on a GPU worker and its
    stage process is at work; those runs, by recipe. `completed_ok`: one at work is enough if the
    others have completed (on a busy machine a worker can take its next run ~18 s after its last,
    later than a tiny recipe on the other worker takes to finish). Fails as soon as the parent ends."""
    def at_work():
        children = recipe_runs(stack, parent_id)
        runs = [children.get(name) for name in names]
        working = [r for r in runs if r and r.state.is_running() and r.infrastructure_pid and stage_process(r)]
        completed = [r for r in runs if r and r.state.is_completed()] if completed_ok else []
        if working and len(working) + len(completed) == len(names):
            return children
        with stack.client() as client:
            parent = client.read_flow_run(parent_id)
        if parent.state and parent.state.is_final():
            pytest.fail(f"the run ended ({parent.state.name}) before its recipe runs of {names} were at work: "
                        f"{ {n: r.state.name for n, r in children.items()} }")

    children = wait_until(at_work, timeout, f"the recipe runs of {names} at work")
    time.sleep(3)  # into the stage's work
    return {name: children[name] for name in names}


def final_recipe_runs(stack, parent_id, timeout: float) -> dict:
    """Wait until each of the parent's recipe runs is in a final state; those runs, by recipe."""
    def all_final():
        children = recipe_runs(stack, parent_id)
        return children if all(r.state.is_final() for r in children.values()) else None

    return wait_until(all_final, timeout, "final states of the recipe runs")


def stage_process(run) -> bool:
    """The flow run's `qad-pipeline stage ...` process has started."""
    try:
        return any("stage" in p.cmdline() for p in run_processes(run)[1:])
    except psutil.Error:
        return False


def run_processes(run) -> list[psutil.Process]:
    """A flow run's process (its infrastructure pid on a process worker) and its descendants."""
    pid = int(str(run.infrastructure_pid).rsplit(":", 1)[-1])  # "pid" or "host:pid"
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(process: psutil.Process) -> bool:
    """Still running: the same process (psutil compares its start time), not a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def mlflow_running(root) -> list[str]:
    """The MLflow runs in the out-root's store that still say RUNNING."""
    from mlflow import MlflowClient

    store = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = store.search_runs([e.experiment_id for e in store.search_experiments()])
    assert runs, "no MLflow run was logged"
    return [r.info.run_name for r in runs if r.info.status == "RUNNING"]


def wait_until(check, timeout: float, what: str):
    """Poll `check()` until it returns something true; that value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := check():
            return value
        time.sleep(1)
    pytest.fail(f"{what} not within {timeout:.0f} s")


def test_setup_created_the_pools_and_the_crash_automation(stack):
    from qad_pipeline.platform.prefect_setup import AUTOMATION

    with stack.client() as client:
        assert {p.name: p.type for p in client.read_work_pools()} == {"qad-control": "process", "qad-gpu": "process"}
        [automation] = client.read_automations_by_name(AUTOMATION)
        assert automation.trigger.posture == "Proactive" and automation.actions[0].state == "CRASHED"
        names = {d.name for d in client.read_deployments()}
    assert names == {"default", "gpu", "cron"}


def test_unknown_parameter_and_bad_value_fail_at_once(stack, tmp_path):
    done = stack.run("qad-pipeline/default", {"stepz": 3}, check=False)
    assert done.returncode != 0 and "'stepz'" in done.stdout + done.stderr

    run = stack.wait(stack.run("qad-pipeline/default", {"out_root": str(tmp_path), "qad": {"steps": -1}}), timeout=300)
    assert run.state.is_failed()
    assert "qad.steps = -1" in run.state.message, run.state.message
    assert not recipe_runs(stack, run.id)  # nothing was started: no worker loaded a model
    assert not (tmp_path / "artifacts").exists()


@pytest.fixture(scope="module")
def two_recipes(stack, tmp_path_factory, recipe_dir):
    """One deployed run of both recipes: (the flow run, its out-root, its parameters). The killed-
    recipe test goes on from it."""
    root = tmp_path_factory.mktemp("deployed") / "run"
    args = params(root, recipe_dir)
    return stack.wait(stack.run("qad-pipeline/default", args)), root, args


def test_recipes_run_at_once_on_two_gpu_workers(stack, two_recipes):
    run, root, _ = two_recipes
    assert run.state.is_completed(), run.state.message
    children = recipe_runs(stack, run.id)
    assert set(children) == set(GOOD_RECIPES)
    assert all(c.state.is_completed() and c.work_pool_name == "qad-gpu" for c in children.values())
    a, b = children.values()
    overlap = min(a.end_time, b.end_time) - max(a.start_time, b.start_time)
    assert overlap > timedelta(seconds=5), f"the recipe runs did not overlap: {a.start_time}..{a.end_time}, " \
                                            f"{b.start_time}..{b.end_time}"
    # Prefect's own record of which worker took each run
    submitted = {}
    for event in stack.events("prefect.worker.submitted-flow-run"):
        for related in event.get("related") or []:
            if related["prefect.resource.id"].startswith("prefect.flow-run."):
                submitted[related["prefect.resource.id"].removeprefix("prefect.flow-run.")] = \
                    event["resource"]["prefect.resource.id"]
    workers = {submitted[str(c.id)] for c in children.values()}
    assert workers == {"prefect.worker.process.gpu-0", "prefect.worker.process.gpu-1"}, workers
    assert len({c.infrastructure_pid for c in children.values()}) == 2
    for name in GOOD_RECIPES:
        assert (root / "artifacts/ptq" / name / "scores.json").is_file()


def test_killed_recipe_run_is_reported_and_rerun_takes_the_survivor_from_cache(stack, two_recipes, recipe_dir):
    survivor, victim = GOOD_RECIPES
    first, _, args = two_recipes  # both recipes computed
    assert first.state.is_completed()
    victim_file = recipe_dir / f"{victim}.yaml"
    victim_file.write_text(victim_file.read_text() + "\n# changed: only this recipe re-runs\n")

    parent = stack.run("qad-pipeline/default", args)
    child = working_recipes(stack, parent, [victim])[victim]
    for p in reversed(run_processes(child)):  # what a lost node or an OOM kill leaves
        os.kill(p.pid, signal.SIGKILL)
    second = stack.wait(parent)
    assert second.state.is_completed(), second.state.message  # selection went on with the survivor
    crashed = recipe_runs(stack, parent)[victim]
    assert crashed.state.name == "Crashed", crashed.state
    logs = stack.logs(parent, until=f"PTQ failed for {victim}")
    assert f"PTQ failed for {victim}" in logs and "Crashed" in logs
    assert survivor not in recipe_runs(stack, parent)  # taken from cache: no flow run at all

    third = stack.wait(stack.run("qad-pipeline/default", args))
    assert third.state.is_completed()
    assert set(recipe_runs(stack, third.id)) == {victim}  # only the missing recipe runs again
    logs = stack.logs(third.id, until=f"PTQ taken from cache (inputs unchanged): {survivor}")
    assert f"PTQ taken from cache (inputs unchanged): {survivor}" in logs
    assert "PTQ failed" not in logs


def test_cancelled_run_stops_its_recipe_runs_and_the_same_run_resumes(stack, tmp_path, recipe_dir):
    root = tmp_path / "cancel"
    args = params(root, recipe_dir)
    parent = stack.run("qad-pipeline/default", args)
    at_work = working_recipes(stack, parent, GOOD_RECIPES, completed_ok=True)
    processes = [p for child in at_work.values() if not child.state.is_completed() for p in run_processes(child)]
    stack.prefect("flow-run", "cancel", parent)  # what a user types

    run = stack.wait(parent, timeout=120)
    assert run.state.name == "Cancelled", run.state
    children = final_recipe_runs(stack, parent, timeout=60)
    # the parent cancels the recipe runs still at work; one that had just finished stays Completed
    assert {r.state.name for r in children.values()} <= {"Cancelled", "Completed"}, children
    assert any(r.state.name == "Cancelled" for r in children.values())
    wait_until(lambda: not any(alive(p) for p in processes), 30, "the end of every process of the recipe runs")
    assert not list(root.rglob("*.partial")), "a half-written output folder was left behind"
    assert not mlflow_running(root)

    finished = [name for name in GOOD_RECIPES if children[name].state.is_completed()]
    again = stack.wait(stack.run("qad-pipeline/default", args))
    assert again.state.is_completed(), again.state.message
    assert set(recipe_runs(stack, again.id)) == set(GOOD_RECIPES) - set(finished)  # only the cancelled ones run
    logs = stack.logs(again.id, until="baseline taken from cache (inputs unchanged)")
    assert "baseline taken from cache (inputs unchanged)" in logs
    if finished:
        assert f"PTQ taken from cache (inputs unchanged): {', '.join(finished)}" in logs


@pytest.mark.long  # ~8 min here: `python -m pytest -q -m long tests/test_deployments.py`
def test_server_restart_mid_run_leaves_no_run_unfinished_and_the_rerun_takes_survivors_from_cache(
        stack, tmp_path, recipe_dir):
    args = params(tmp_path / "restart", recipe_dir)
    parent = stack.run("qad-pipeline/default", args)
    working_recipes(stack, parent, GOOD_RECIPES[:1])
    away = stack.restart_server(down_s=10)

    run = stack.wait(parent, timeout=420)
    children = final_recipe_runs(stack, parent, timeout=120)
    final = {"Completed", "Crashed", "Failed"}
    assert run.state.name in final, (run.state, away)
    assert {r.state.name for r in children.values()} <= final, children

    survivors = [name for name in GOOD_RECIPES if name in children and children[name].state.is_completed()]
    again = stack.wait(stack.run("qad-pipeline/default", args), timeout=420)  # the base-model slot is free again
    assert again.state.is_completed(), again.state.message
    assert set(recipe_runs(stack, again.id)) == set(GOOD_RECIPES) - set(survivors)
    if survivors:
        cached = f"PTQ taken from cache (inputs unchanged): {', '.join(survivors)}"
        assert cached in stack.logs(again.id, until=cached)
