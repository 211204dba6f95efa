"""The task module of a stage that tests/test_stages.py adds to a copy of the registry: the one file
a new stage brings besides its `Stage(...)` (docs/architecture.md, "Adding a stage"). It writes a model
card's JSON, and names its result model, its cost models, its MLflow reader and its report section,
which the registry entry references as `module:name`."""

from __future__ import annotations

from qad_pipeline.plan.costs import CostModel
from qad_pipeline.plan.eval_costs import EvalCost
from qad_pipeline.results.base import Strict, write_result

CARD_BYTES = 4096


class ModelCard(Strict):  # metrics/model_card.json
    passed: bool
    lines: int


def main(params, layout, recipe=None) -> str:
    """Write the card's JSON; the one line the stage prints."""
    write_result(layout.metrics / "model_card.json", ModelCard(passed=True, lines=3))
    return "model card written"


# its plan: a JSON file and a short evaluation (its own cost model, `Stage.cost` and `Stage.eval_cost`)
COST = CostModel(disk=lambda params, shape, item: CARD_BYTES, seconds=lambda work: 1.0 + work.evaluation)


def eval_cost(params) -> EvalCost:
    return EvalCost(items=10, requests=10, tokens=1000, note="the card's spot check")


def card_run(child, result: ModelCard, params) -> None:
    """Its MLflow run: what it logs from its result."""
    child.metrics = {"card_passed": float(result.passed)}


def report(result: ModelCard, params) -> list[str]:
    """Its report section."""
    return [f"Model card: {'passed' if result.passed else 'FAILED'} ({result.lines} lines)."]
