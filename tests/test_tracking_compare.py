"""Reading runs back (qad_pipeline/tracking/compare.py): the compare table and a run's page."""

from __future__ import annotations

import pytest

from qad_pipeline import tracking
from qad_pipeline.core.config import ConfigError
from tests.tracking_fakes import BROKEN, GOOD, logged_store


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The shared store with two logged pipeline runs (tracking_fakes.logged_store)."""
    return logged_store(tmp_path_factory)


def test_compare_table_reads_back_the_latest_run(logged):
    first, second = logged["runs"]
    base = logged["params"].base_model.path
    rows = tracking.compare_table(logged["uri"], base)
    assert [r["name"] for r in rows] == ["bf16", *GOOD, BROKEN, "qad"]
    by_name = {r["name"]: r for r in rows}
    qad = by_name["qad"]
    assert qad["median_recovery"] == pytest.approx(second["qad"]["median_recovery"])
    assert qad["median_recovery"] != pytest.approx(first["qad"]["median_recovery"])
    assert qad["effective_bpe"] == pytest.approx(second["export"]["effective_bpe"])
    assert by_name["bf16"]["median_recovery"] == 1.0 and by_name["bf16"]["effective_bpe"] == 16.0
    assert by_name[BROKEN]["status"] == "failed" and "no scores" in by_name[BROKEN]["error"]
    selected = second["selection"]["selected"]
    assert [r["name"] for r in rows if r["selected"]] == [selected]
    assert by_name[selected]["median_recovery"] == pytest.approx(second["ptq"][selected]["median_recovery"])
    assert by_name[selected]["recovery.heldout_cloze"] == pytest.approx(
        second["ptq"][selected]["tasks"]["heldout_cloze"]["recovery"])
    # an explicit run id (parent or child) gives the older run; the experiment name works too
    older = tracking.compare_table(logged["uri"], f"qad-pipeline/{base}", run_id=first["run_id"])
    assert {r["name"]: r for r in older}["qad"]["median_recovery"] == pytest.approx(first["qad"]["median_recovery"])
    assert by_name[selected]["median_recovery_ci_low"] == pytest.approx(second["ptq"][selected]["median_recovery_ci"][0])
    text = tracking.compare_text(rows)
    assert f"* {selected}" in text and f"{BROKEN} FAILED" in text and "heldout_cloze" in text
    with pytest.raises(ConfigError, match="no MLflow experiment"):
        tracking.compare_table(logged["uri"], "no/such-model")


def test_run_url_points_at_the_server_or_the_local_ui():
    assert tracking.run_url("http://mlflow.example:5000/", "3", "abc") == "http://mlflow.example:5000/#/experiments/3/runs/abc"
    assert tracking.run_url("sqlite:////x/mlflow.db", "3", "abc") == "http://127.0.0.1:5000/#/experiments/3/runs/abc"
