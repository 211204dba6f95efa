"""The selection policy (a pure function) and the recovery arithmetic it relies on."""

import pytest

from qad_pipeline.config import SelectionParams
from qad_pipeline.recovery import median_recovery, recoveries, task_recovery
from qad_pipeline.tasks.selection import RecipeRow, select_recipe

QAD = SelectionParams(policy="qad", band=(0.95, 0.99), ptq_final_min=0.99)
FINAL = SelectionParams(policy="ptq_final", band=(0.95, 0.99), ptq_final_min=0.99)


def ok(name, rec, bpe, kv="fp8"):
    return RecipeRow(name, "ok", rec, bpe, kv)


def test_recovery_direction():
    assert task_recovery(0.45, 0.5, higher_is_better=True) == pytest.approx(0.9)
    assert task_recovery(60.0, 55.0, higher_is_better=False) == pytest.approx(55 / 60)
    with pytest.raises(ValueError, match="positive"):
        task_recovery(0.0, 0.0, True)


def test_median_over_tasks():
    base = {"a": {"value": 0.5, "higher_is_better": True}, "ppl": {"value": 50.0, "higher_is_better": False},
            "b": {"value": 0.4, "higher_is_better": True}}
    quant = {"a": {"value": 0.49, "higher_is_better": True}, "ppl": {"value": 52.0, "higher_is_better": False},
             "b": {"value": 0.2, "higher_is_better": True}}
    per = recoveries(quant, base)
    assert per["b"] == pytest.approx(0.5)
    assert median_recovery(per) == pytest.approx(50 / 52)
    with pytest.raises(ValueError, match="lack tasks"):
        recoveries({"a": quant["a"]}, base)


def test_qad_takes_most_compressed_in_band():
    rows = [ok("safe", 0.998, 6.0), ok("mid", 0.985, 5.0), ok("aggr", 0.97, 4.6), ok("broken", 0.80, 4.5)]
    sel = select_recipe(rows, QAD)
    assert sel.selected == "aggr"
    assert "band" in sel.reason and "4.600" in sel.reason
    assert [r["name"] for r in sel.table] == ["aggr", "broken", "mid", "safe"]


def test_qad_tie_on_bits_goes_to_smaller_kv_cache():
    rows = [ok("kv8", 0.98, 4.6, "fp8"), ok("kv4", 0.97, 4.6, "nvfp4")]
    assert select_recipe(rows, QAD).selected == "kv4"


def test_qad_all_above_band_takes_most_compressed_above():
    rows = [ok("a", 0.999, 6.0), ok("b", 0.995, 5.0)]
    sel = select_recipe(rows, QAD)
    assert sel.selected == "b"
    assert "above" in sel.reason


def test_qad_all_below_band_selects_nothing():
    sel = select_recipe([ok("a", 0.90, 5.0), ok("b", 0.85, 4.6)], QAD)
    assert sel.selected is None
    assert "No recipe qualifies" in sel.reason and "a at 90.00 %" in sel.reason


def test_ptq_final_needs_99_percent():
    rows = [ok("a", 0.992, 6.0), ok("b", 0.991, 5.5), ok("c", 0.98, 4.6)]
    assert select_recipe(rows, FINAL).selected == "b"
    assert select_recipe([ok("c", 0.98, 4.6)], FINAL).selected is None


def test_failed_recipes_are_left_out_and_named():
    rows = [ok("a", 0.97, 4.6), RecipeRow("oom", "failed", error="killed")]
    sel = select_recipe(rows, QAD)
    assert sel.selected == "a"
    assert "oom" in sel.reason
    assert select_recipe([RecipeRow("oom", "failed")], QAD).selected is None


def test_task_the_baseline_cannot_solve_has_no_recovery():
    base = {"zero": {"value": 0.0, "higher_is_better": True}, "a": {"value": 0.5, "higher_is_better": True}}
    quant = {"zero": {"value": 0.0, "higher_is_better": True}, "a": {"value": 0.0, "higher_is_better": True}}
    assert recoveries(quant, base) == {"a": 0.0}
