"""The BPE sweep's one AutoQuantize search: `qad-pipeline stage sweep_search`.

Model Optimizer's `mtq.auto_quantize` calibrates every candidate format of the sweep's recipe
(`sweep.recipe`) and scores each layer's sensitivity to each, once, at the recipe's own budget.
Its search state (`state.pt`: each format's calibrated quantizers and the scores) is what every
budget of the sweep re-solves from (`tasks/sweep.py`), without calibrating or scoring again.
Writes `artifacts/sweep_search/`: `state.pt` and `search.json` (per layer: each candidate's
sensitivity score and cost, and the choice at the recipe's budget).
"""

from __future__ import annotations

import time

import torch

from qad_pipeline.nvfp4 import autoquant
from qad_pipeline.core.artifacts import staged_dir
from qad_pipeline.core.config import Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import write_result
from qad_pipeline.results.scores import SweepSearch

STATE = "state.pt"


def run_sweep_search(params: Params, layout: Layout) -> SweepSearch:
    """Stage core: search once with the sweep's recipe; keep Model Optimizer's search state."""
    from qad_pipeline.core.calibration_data import load_calibration
    from qad_pipeline.core.modeling import load_model, tied_embeddings

    recipe_path = params.recipe_path(params.sweep.recipe)
    spec = autoquant.check_recipe(recipe_path, params.sweep.budgets, params.base_model)
    started = time.time()
    model = load_model(params.base_model, params.hardware)
    samples = torch.from_numpy(load_calibration(layout.data))
    with staged_dir(layout.sweep_search) as tmp:
        state = autoquant.search(model, spec, samples, params.ptq.calib_batch_size, checkpoint=tmp / STATE,
                                 tied_lm_head=tied_embeddings(model))
        result = SweepSearch(recipe=params.sweep.recipe, method=spec.method, formats=list(spec.formats),
                             budget=spec.effective_bits, searched_effective_bits=autoquant.searched_bits(state),
                             minimum_bits=autoquant.minimum_budget(spec, params.base_model), layers=autoquant.layer_map(state),
                             seconds=time.time() - started)
        write_result(tmp / "search.json", result)
    return result


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """The sweep's search: `qad-pipeline stage sweep_search`."""
    result = run_sweep_search(params, layout)
    return (f"sweep_search: {len(result.layers)} layer groups scored for {', '.join(result.formats)} "
            f"({result.method}) in {result.seconds:.1f} s; minimum budget {result.minimum_bits:g} bits")
