"""Where each stage runs, for every combination of `recipe_deployment` and `stage_deployment`
(flows/runtime.py: route), and that the GPU flow accepts every stage routed to it."""

import pytest

from flows.recipe import gpu_stage
from flows.runtime import Job, route
from qad_pipeline.core.config import PROJECT_PARAMS
from qad_pipeline.core.layout import Layout
from qad_pipeline.core.stages import GPU_STAGES, STAGES

RECIPES, STAGE_POOL = "ptq-recipe/gpu", "gpu-stage/gpu"
CPU_STAGES = {"calibration", "bpe_sweep", "selection"}  # light: always a process on the run's own machine


@pytest.mark.parametrize("recipe_deployment", [None, RECIPES])
@pytest.mark.parametrize("stage_deployment", [None, STAGE_POOL])
def test_every_stage_goes_where_the_deployments_say(tmp_path, recipe_deployment, stage_deployment):
    job = Job(str(PROJECT_PARAMS), [], Layout(tmp_path), recipe_deployment, stage_deployment)
    for name, declared in STAGES.items():
        item = "r1" if declared.per_recipe else None
        deployment, parameters = route(name, item, job)
        if name in CPU_STAGES:
            assert (deployment, parameters) == (None, {}), name
        elif name == "ptq" and recipe_deployment:
            assert (deployment, parameters) == (RECIPES, {"recipe": "r1"})
        elif stage_deployment:  # with no recipe deployment, the recipes go to the GPU stage flow too
            assert deployment == STAGE_POOL, name
            assert parameters == {"stage": name, **({"item": item} if item else {})}
            assert name in GPU_STAGES  # gpu-stage would refuse it otherwise
        else:
            assert (deployment, parameters) == (None, {}), name


def test_the_gpu_stage_flow_refuses_a_cpu_stage():
    with pytest.raises(ValueError, match="gpu-stage runs one of"):
        gpu_stage.fn(stage="selection")
