"""GPU slots (qad_pipeline/plan/gpus.py): the environment each stage process gets on a multi-GPU node.

No GPU here: the node is faked by the free memory `gpus.free_bytes` reports (one entry per GPU
the process sees), and the stage process by a stand-in for `run_stage_process` that records the
`CUDA_VISIBLE_DEVICES` it was given and how long it held it.
"""

import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flows import recipe as recipe_flow
from flows import runtime
from qad_pipeline.plan import capacity, gpus, memory, plan_table
from qad_pipeline.core.config import PROJECT_ROOT, ConfigError, load_params

PARAMS = str(PROJECT_ROOT / "params.yaml")
ON_CUDA = ["hardware.device=cuda", "export.serving_check=skip"]  # no vLLM needed to plan a CUDA run here
GiB = 1 << 30


@pytest.fixture
def node(monkeypatch, tmp_path):
    """A node of `n` 80 GB GPUs (`node(n)`), with its own lock folder; returns the recorded runs."""
    monkeypatch.setenv(gpus.LOCK_DIR_ENV, str(tmp_path / "locks"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(runtime, "get_run_logger", lambda: logging.getLogger("test"))
    runs, lock = [], threading.Lock()

    def stage_process(stage, params_file, overrides, layout, threads=None, env=None, fork=True):
        start = time.monotonic()
        time.sleep(0.3)
        with lock:
            runs.append({"stage": stage, "env": env or {}, "span": (start, time.monotonic())})
        return 0.3

    monkeypatch.setattr(runtime, "run_stage_process", stage_process)
    monkeypatch.setattr(recipe_flow, "run_stage_process", stage_process)

    def make(n):
        monkeypatch.setattr(gpus, "free_bytes", lambda: [80 * GiB] * n)
        return runs

    return make


def _recipes(job, params):
    with ThreadPoolExecutor(len(params.ptq.recipes)) as pool:
        list(pool.map(lambda r: runtime.run_stage.fn("ptq", r, job), params.ptq.recipes))


def _devices(run):
    return run["env"]["CUDA_VISIBLE_DEVICES"].split(",")


def _no_gpu_shared_at_once(runs):
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            overlap = a["span"][0] < b["span"][1] and b["span"][0] < a["span"][1]
            assert not (overlap and set(_devices(a)) & set(_devices(b))), (a, b)


def test_each_recipe_on_its_own_gpu_of_an_eight_gpu_node(node, tmp_path):
    runs = node(8)
    params, job = runtime.start_job(PARAMS, ON_CUDA, str(tmp_path / "out"), None, None)
    assert job.gpus == tuple(str(i) for i in range(8)) and job.at_once == len(params.ptq.recipes) == 5
    recipes = [f"ptq/{r}" for r in params.ptq.recipes]
    assert dict(job.placed) == {"calibration": (), **{r: (str(i),) for i, r in enumerate(recipes)}, "baseline": ("0",),
                                "selection": (), "qad": ("0",), "final_eval": ("0",), "export": ("0",)}
    _recipes(job, params)
    # five recipes at once, each on the GPU the plan gave it
    assert {run["stage"][1]: run["env"]["CUDA_VISIBLE_DEVICES"] for run in runs} == {
        r: str(i) for i, r in enumerate(params.ptq.recipes)}
    assert [(e.stage, e.gpus) for e in memory.plan(params, capacity.capacity(params.hardware))] == list(job.placed)
    assert all(len(_devices(run)) == 1 for run in runs)
    _no_gpu_shared_at_once(runs)
    runtime.run_stage.fn("selection", None, job)  # loads no model: its environment is left alone
    assert runs[-1]["env"] == {}


def test_five_recipes_on_two_gpus_take_turns(node, tmp_path):
    runs = node(2)
    params, job = runtime.start_job(PARAMS, ON_CUDA, str(tmp_path / "out"), None, None)
    assert job.at_once == 2
    _recipes(job, params)
    assert sorted({d for run in runs for d in _devices(run)}) == ["0", "1"] and len(runs) == 5
    _no_gpu_shared_at_once(runs)


def test_gpus_per_recipe_spreads_each_recipe_over_its_own_gpus(node, tmp_path):
    runs = node(8)
    overrides = [*ON_CUDA, "hardware.device_map=auto", "ptq.gpus_per_recipe=2", "qad.num_gpus=4"]
    params, job = runtime.start_job(PARAMS, overrides, str(tmp_path / "out"), None, None)
    assert job.at_once == 4  # 8 GPUs, 2 per recipe
    _recipes(job, params)
    assert all(len(_devices(run)) == 2 for run in runs)
    _no_gpu_shared_at_once(runs)
    runtime.run_stage.fn("qad", None, job)
    runtime.run_stage.fn("baseline", None, job)  # device_map auto: as many as a recipe
    assert [len(_devices(run)) for run in runs[-2:]] == [4, 2]
    # the plan says the same
    rows = {e.stage: e for e in memory.plan(params, capacity.capacity(params.hardware))}
    assert [rows["ptq/" + r].gpus for r in params.ptq.recipes] == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7"),
                                                                  ("0", "1")]
    assert (rows["ptq/" + params.ptq.recipes[0]].max_parallel, rows["qad"].gpus, rows["baseline"].gpus) == (
        4, ("0", "1", "2", "3"), ("0", "1"))
    assert [gpus.shown(g) for g in [(), ("3",), ("3", "5"), ("0", "1", "2", "3")]] == ["-", "3", "3,5", "0-3"]


def test_a_worker_given_some_gpus_hands_out_those(node, tmp_path, monkeypatch):
    """A GPU worker started with CUDA_VISIBLE_DEVICES=3,5: its runs get 3 or 5, never each other's."""
    runs = node(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    params = load_params(PROJECT_ROOT / "params.yaml", ON_CUDA)
    with ThreadPoolExecutor(3) as pool:  # three recipe flow runs on this worker at once
        said = list(pool.map(lambda r: recipe_flow._run_here(["ptq", r], PARAMS, ON_CUDA, str(tmp_path), None),
                             params.ptq.recipes[:3]))
    assert sorted(d for run in runs for d in _devices(run)) == sorted(s["devices"] for s in said)
    assert {s["devices"] for s in said} == {"3", "5"}
    _no_gpu_shared_at_once(runs)
    cap = capacity.capacity(params.hardware)
    rows = memory.plan(params, cap)
    assert [(e.stage, e.gpus) for e in rows[:4]] == [("calibration", ()), ("baseline", ("3",)),
                                                     ("ptq/" + params.ptq.recipes[0], ("3",)),
                                                     ("ptq/" + params.ptq.recipes[1], ("5",))]
    assert "GPUs" in plan_table.table(rows, cap).splitlines()[0].split()


def test_a_claim_waits_for_a_gpu_another_process_holds(node, tmp_path):
    node(2)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from qad_pipeline.plan import gpus\n"
        "with gpus.claim(1, ('0',)):\n    print('held', flush=True); time.sleep(1.5)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with gpus.claim(1, ("0", "1")) as got:
        assert got == ("1",)  # the free one, at once
    said, start = [], time.monotonic()
    with gpus.claim(2, ("0", "1"), "qad", said.append, poll_s=0.1) as got:
        waited = time.monotonic() - start
    holder.wait()
    assert got == ("0", "1") and waited > 0.5 and said == ["qad: waiting for 2 free GPU(s) of 0, 1"]


def test_no_gpu_leaves_the_environment_alone(node, tmp_path):
    runs = node(0)
    params, job = runtime.start_job(PARAMS, ["export.serving_check=skip"], str(tmp_path / "out"), None, None)
    assert job.gpus == () and job.placed == ()
    runtime.run_stage.fn("ptq", params.ptq.recipes[0], job)
    assert runs[0]["env"] == {}


@pytest.mark.parametrize("overrides, message", [
    (["hardware.device_map=auto", "ptq.gpus_per_recipe=3"], r"ptq.gpus_per_recipe = 3 but this machine sees 2 GPU"),
    (["hardware.device_map=single", "ptq.gpus_per_recipe=2"], r"ptq.gpus_per_recipe = 2 needs hardware.device_map=auto"),
])
def test_more_gpus_per_recipe_than_there_are_is_refused(node, tmp_path, overrides, message):
    node(2)
    with pytest.raises(ConfigError, match=message):
        runtime.start_job(PARAMS, [*ON_CUDA, *overrides], str(tmp_path / "out"), None, None)
