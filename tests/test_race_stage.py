"""The race stage on the demo model (tasks/race.py): PTQ scores round 1's items, the race scores
the rest for the candidates still in contention from their saved checkpoints, the items it scores
are the ones a full evaluation gives, selection reads the merged scores and says what racing
spent, and a race run again reads its stored rounds back instead of scoring them again."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from qad_pipeline.scoring import racing
from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import read_result
from qad_pipeline.results.race_metrics import RaceResult
from qad_pipeline.results.selection_metrics import SelectionResult
from qad_pipeline.core.stages import STAGES
from tasks import race
from tasks.baseline import run_baseline
from tasks.calibration import build_calibration
from tests.conftest import GOOD_RECIPES, TINY

pytestmark = pytest.mark.slow  # calibration, baseline, two PTQ recipes, the race: ~40 s on two cores

SETTINGS = [*TINY, "race.enabled=true", f"ptq.recipes=[{', '.join(GOOD_RECIPES)}]"]


@pytest.fixture(scope="module")
def raced(tmp_path_factory, demo_model_path):
    layout = Layout(tmp_path_factory.mktemp("race"))
    params = load_params(overrides=SETTINGS)
    build_calibration(params, AutoTokenizer.from_pretrained(demo_model_path), layout.data)
    run_baseline(params, layout.data, layout.baseline_metrics, layout.reference)
    for recipe in GOOD_RECIPES:
        STAGES["ptq"].run(params, layout, recipe)
    STAGES["race"].run(params, layout)
    STAGES["selection"].run(params, layout)
    return params, layout


def test_ptq_scores_round_one_and_the_race_the_rest_as_a_full_evaluation_would(raced):
    params, layout = raced
    from qad_pipeline.scoring.evaluation import evaluate_model
    from qad_pipeline.core.modeling import load_model, load_tokenizer

    baseline_items = read_json(layout.items("baseline"))
    rounds = racing.round_ids(baseline_items, params.race.fractions, params.race.seed)
    for recipe in GOOD_RECIPES:  # PTQ scored round 1's items, no more
        held = read_json(layout.ptq(recipe) / "items.json")
        assert {t: v["ids"] for t, v in held.items()} == rounds[0]
    result = read_result(layout.race_metrics, RaceResult)
    finished = [c for c in result.candidates if c.stopped is None]
    assert finished and result.items_full == 2 * racing.count(baseline_items)
    assert result.items_spent == sum(c.items for c in result.candidates) <= result.items_full
    for c in result.candidates:
        assert c.items == (racing.count(baseline_items) if c.stopped is None else c.stopped.items)
    # a finisher's items, round 1 scored in its PTQ process and the rest from its saved checkpoint,
    # are the items a full evaluation of that checkpoint gives, up to BF16 rounding: lm-eval batches
    # an item with other items in a slice than in the full set (measured: 3 of 16 cloze items differ,
    # by at most 0.008 nats of log-likelihood, 2 of 8 continuation items by at most 0.0007 in
    # probability)
    name = finished[0].name
    merged = read_json(layout.race(name) / "items.json")
    model = load_model(params.base_model, params.hardware, folder=layout.ptq(name) / "checkpoint")
    full = evaluate_model(model, load_tokenizer(params.base_model), params.eval, layout.data, layout.reference)
    assert {t: v["ids"] for t, v in merged.items()} == {t: v["ids"] for t, v in full["items"].items()}
    for task, items in full["items"].items():
        np.testing.assert_allclose(merged[task]["values"], items["values"], rtol=5e-3, atol=5e-3, err_msg=task)
    scores = read_json(layout.race(name) / "scores.json")
    assert scores["kl_divergence"] == pytest.approx(full["kl_divergence"], rel=1e-3)

    selection = read_result(layout.selection_metrics, SelectionResult)
    assert selection.racing.items_spent == result.items_spent and selection.racing.items_full == result.items_full
    assert f"Racing scored {result.items_spent} of {result.items_full} eval items" in selection.reason
    for c in result.candidates:
        if c.stopped is not None:
            assert c.stopped.text in selection.reason and selection.selected != c.name


def test_a_race_run_again_reads_its_rounds_back(raced, monkeypatch):
    params, layout = raced
    before = read_result(layout.race_metrics, RaceResult)

    def no_scoring(self, name, ids):
        raise AssertionError(f"{name} scored again")

    monkeypatch.setattr(race.Scorer, "_score", no_scoring)
    again = race.run_race(params, layout)
    assert again.items_spent == before.items_spent
    assert [c.stopped for c in again.candidates] == [c.stopped for c in before.candidates]
    round_one = racing.count(racing.round_ids(read_json(layout.items("baseline")), params.race.fractions,
                                              params.race.seed)[0])
    assert sum(c.reused for c in again.candidates) == again.items_spent - round_one * len(again.candidates)
