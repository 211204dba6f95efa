"""Shared fixtures: the bundled demo model and one tiny run of the whole flow.

The suite runs on two workers (`python -m pytest -q -n 2 --dist loadfile`, pytest-xdist): each
test file on one worker, so a module's fixtures run once; `pipeline_run`, which tests in several
files read, runs once for the session, by whichever worker asks first (the other waits for it).
"""

import os
import pickle
import shutil
from pathlib import Path

# Each pytest-xdist worker's processes (the worker, the stage processes of its flow runs, vLLM) get
# its share of the cores, as CPU threads: with the default (every core per process) two workers'
# tiny-model work oversubscribes the cores and OpenMP's spinning threads wait on each other. Measured
# on 2 cores, test_flow_e2e.py and test_families_other.py on two workers: 237 s -> 141 s.
if os.environ.get("PYTEST_XDIST_WORKER"):  # in a worker (the controller's environment is the workers')
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest
import torch

if os.environ.get("OMP_NUM_THREADS"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # the worker's own: a plugin imported torch already

from qad_pipeline.core.config import PROJECT_ROOT
from qad_pipeline.core.layout import Layout

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

DEMO_MODEL = PROJECT_ROOT / "demo" / "model"
GOOD_RECIPES = ["nvfp4_max-mamba_fp8-kv_fp8", "nvfp4_4o6-mamba_w4a16-kv_nvfp4"]
BROKEN_RECIPE = "broken-recipe"
# Small enough for CI on two cores, large enough that every stage does real work.
TINY = [
    "calibration.num_samples=4", "calibration.seq_len=64", "ptq.calib_batch_size=4",
    "eval.seq_len=64", "eval.ppl_samples=4", "eval.num_cloze=16", "eval.num_continuation=8",
    "eval.batch_size=16", "qad.steps=4", "qad.batch_size=4", "qad.seq_len=64", "qad.checkpoint_every=2",
    "qad.warmup_steps=1", "selection.band=[0.5, 1.0]",
]


@pytest.fixture(scope="session")
def demo_model_path():
    if not (DEMO_MODEL / "config.json").is_file():
        pytest.fail(f"the bundled demo model is missing at {DEMO_MODEL}; retrain it with demo/train_demo_model.py")
    return DEMO_MODEL


def pytest_collection_modifyitems(items):
    """A test on the session's flow run is slow, whatever its file says."""
    for item in items:
        if "pipeline_run" in item.fixturenames:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory, demo_model_path):
    """The qad-pipeline flow, run once: two real recipes and a broken one, then QAD and export.

    Returns (summary, layout, overrides, {"artifacts": Prefect's latest artifacts, "task_runs": its task runs}).
    The run's folder is shared by every test (and every pytest-xdist worker): a test that changes
    a run works on a copy of it.
    """
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's folder
    kept = shared / "pipeline_run.pickle"
    with FileLock(str(shared / "pipeline_run.lock")):
        if not kept.is_file():
            kept.write_bytes(pickle.dumps(_run_the_flow(shared / "pipeline_run")))
    summary, root, overrides, prefect = pickle.loads(kept.read_bytes())
    return summary, Layout(Path(root)), overrides, prefect


@pytest.fixture(scope="session")
def real_export(tmp_path_factory):
    """SmolLM2-135M's PTQ export with the full serving check (`tests.test_serving.export_real_model`),
    built once for the session and shared by every file (and pytest-xdist worker) that reads it, as
    `pipeline_run` is. Returns (export metrics, layout, PTQ result); a test that changes it works
    on a copy."""
    from filelock import FileLock

    from tests.test_serving import export_real_model

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    kept = shared / "real_export.pickle"
    with FileLock(str(shared / "real_export.lock")):
        if not kept.is_file():
            root = shared / "real_export"
            shutil.rmtree(root, ignore_errors=True)  # a failed attempt of this session's
            export, layout, ptq = export_real_model(root)
            kept.write_bytes(pickle.dumps((export, str(layout.root), ptq)))
    export, root, ptq = pickle.loads(kept.read_bytes())
    return export, Layout(Path(root)), ptq


def _run_the_flow(root: Path) -> tuple:
    from prefect.client.orchestration import get_client
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import qad_pipeline

    shutil.rmtree(root, ignore_errors=True)  # a failed attempt of this session's
    root.mkdir()
    recipes = root / "recipes"
    recipes.mkdir()
    for name in GOOD_RECIPES:
        shutil.copy(PROJECT_ROOT / "recipes" / f"{name}.yaml", recipes)
    (recipes / f"{BROKEN_RECIPE}.yaml").write_text(
        "metadata:\n  recipe_type: ptq\nquantize:\n  algorithm: no_such_algorithm\n  quant_cfg: []\n"
    )
    overrides = TINY + [f"ptq.recipe_dir={recipes}", f"ptq.recipes=[{', '.join(GOOD_RECIPES + [BROKEN_RECIPE])}]"]
    with prefect_test_harness(server_startup_timeout=120):
        summary = qad_pipeline(params_file=str(PROJECT_ROOT / "params.yaml"), overrides=overrides, out_root=str(root))
        with get_client(sync_client=True) as client:
            prefect = {"artifacts": client.read_latest_artifacts(), "task_runs": client.read_task_runs()}
    return summary, str(root), overrides, prefect
