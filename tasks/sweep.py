"""One point of the BPE sweep: `qad-pipeline stage sweep <budget>` (e.g. `sweep 5.0`).

The sweep's AutoQuantize recipe (`sweep.recipe`) at one budget, re-solved from the search state
the `sweep_search` stage wrote (no calibration or scoring again), then evaluated exactly like a
PTQ recipe (`tasks/ptq.py: run_ptq`: the same tasks, KL against the same BF16 reference). Writes
`artifacts/sweep/<budget>/` with a PTQ recipe's files (`checkpoint/`, `scores.json` named
`<recipe>@<budget>`, `items.json`), so selection, QAD and export take a point like a recipe.
"""

from __future__ import annotations

from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.core.layout import Layout
from tasks.ptq import run_ptq
from tasks.sweep_search import STATE


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """One budget of the sweep: `qad-pipeline stage sweep <budget>`."""
    budget = recipe
    if budget not in params.sweep.points:
        raise ConfigError(f"unknown sweep budget {budget!r}: sweep.budgets lists {params.sweep.points}")
    state = layout.sweep_search / STATE
    if not state.is_file():
        raise ConfigError(f"no search state at {state}: run `qad-pipeline stage sweep_search` first")
    result = run_ptq(params, params.sweep.recipe, layout.data, layout.reference, layout.sweep(budget),
                     budget=float(budget), search_state=state, name=params.sweep.point(budget))
    searched = result["auto_quantize"]
    return (f"sweep {budget}: {searched['searched_effective_bits']:.3f} bits over the searched layers, "
            f"{result['effective_bpe']:.3f} bits per element over the whole model")
