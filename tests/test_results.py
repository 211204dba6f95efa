"""The stages' result models (qad_pipeline/results.py): every file round-trips through
write_result/read_result, and a file that does not match its model is refused with the file and
the key named. That the real stages' files match is checked on the end-to-end run
(tests/test_flow_e2e.py)."""

import json
from pathlib import Path

import pytest

from qad_pipeline.results.base import ResultFileError, dump_result, read_result, write_result
from qad_pipeline.results.scores import PTQResult
from qad_pipeline.results.selection_metrics import RecipeResult, SelectionResult
from tests.samples import every_model, recipe_metrics, score, selection


@pytest.mark.parametrize("index", range(len(every_model(Path("/out")))))
def test_every_model_round_trips(index, tmp_path):
    model = every_model(tmp_path)[index]
    kind = {"PTQScores": PTQResult, "PTQAlias": PTQResult, "RecipeMetrics": RecipeResult,
            "RecipeFailed": RecipeResult, "RecipeAlias": RecipeResult}.get(type(model).__name__, type(model))
    path = write_result(tmp_path / "result.json", model)
    again = read_result(path, kind)
    assert type(again) is type(model) and again == model
    assert json.loads(path.read_text()) == dump_result(model)
    assert write_result(tmp_path / "again.json", again).read_text() == path.read_text()  # the same bytes


def test_an_optional_key_a_writer_left_out_stays_out():
    perplexity = score(40.0, "perplexity", False)  # no "all", no recovery: as the baseline writes it
    assert list(dump_result(perplexity)) == ["metric", "value", "higher_is_better"]
    data = dump_result(selection(None, []))
    assert data["selected"] is None and data["runner_up"] is None  # a None the writer set is written


@pytest.mark.parametrize("where", ["top", "nested"])
def test_an_unknown_key_is_refused_naming_the_key_and_the_file(where, tmp_path):
    data = dump_result(recipe_metrics("a", {"perplexity": score(40.0, "perplexity", False, recovery=1.0)}))
    (data if where == "top" else data["weight_error"])["median_error"] = 0.1
    path = tmp_path / "metrics" / "ptq" / "a.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    with pytest.raises(ResultFileError) as err:
        read_result(path, RecipeResult)
    message = str(err.value)
    assert str(path) in message
    assert ("median_error" if where == "top" else "weight_error.median_error") in message
    assert "Extra inputs are not permitted" in message


def test_a_missing_field_and_an_unknown_status_are_refused(tmp_path):
    path = tmp_path / "selection.json"
    data = dump_result(selection("a", []))
    del data["reason"]
    path.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match=r"selection\.json is not a valid SelectionResult file: reason: Field required"):
        read_result(path, SelectionResult)
    path.write_text(json.dumps({"recipe": "a", "status": "skipped"}))
    with pytest.raises(ResultFileError, match="status: Input tag 'skipped'"):
        read_result(path, RecipeResult)


def test_a_missing_file_is_an_error_unless_it_may_be_missing(tmp_path):
    assert read_result(tmp_path / "none.json", SelectionResult, missing_ok=True) is None
    with pytest.raises(FileNotFoundError):
        read_result(tmp_path / "none.json", SelectionResult)
