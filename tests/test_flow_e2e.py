"""One tiny end-to-end run of the qad-pipeline flow on the bundled demo model.

Two real recipes plus one broken one run as parallel processes; the broken one fails alone,
selection goes on among the survivors, and the metrics contract holds.
"""

import shutil

import pytest
from prefect.testing.utilities import prefect_test_harness

from qad_pipeline.artifacts import read_json
from qad_pipeline.config import PROJECT_ROOT
from qad_pipeline.layout import Layout

GOOD = ["nvfp4_max-mamba_fp8-kv_fp8", "nvfp4_4o6-mamba_w4a16-kv_nvfp4"]
BROKEN = "broken-recipe"
TINY = [
    "calibration.num_samples=4", "calibration.seq_len=64", "ptq.calib_batch_size=4",
    "eval.seq_len=64", "eval.ppl_samples=4", "eval.num_cloze=16", "eval.num_continuation=8",
    "eval.batch_size=16",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_model_path):
    from qad_pipeline.flows.pipeline import qad_pipeline

    root = tmp_path_factory.mktemp("run")
    recipes = root / "recipes"
    recipes.mkdir()
    for name in GOOD:
        shutil.copy(PROJECT_ROOT / "recipes" / f"{name}.yaml", recipes)
    (recipes / f"{BROKEN}.yaml").write_text(
        "metadata:\n  recipe_type: ptq\nquantize:\n  algorithm: no_such_algorithm\n  quant_cfg: []\n"
    )
    overrides = TINY + [f"ptq.recipe_dir={recipes}", f"ptq.recipes=[{', '.join(GOOD + [BROKEN])}]"]
    with prefect_test_harness(server_startup_timeout=120):
        summary = qad_pipeline(overrides=overrides, out_root=str(root))
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            artifact = client.read_latest_artifacts()
    return summary, Layout(root), artifact


def test_metrics_contract(run):
    _, layout, _ = run
    baseline = read_json(layout.baseline_metrics)
    assert {"heldout_cloze", "heldout_continuation", "perplexity"} <= set(baseline["tasks"])
    for name in GOOD:
        m = read_json(layout.ptq_metrics(name))
        assert m["status"] == "ok"
        for key in ("median_recovery", "effective_bpe", "size_bytes", "tasks", "kl_divergence"):
            assert key in m
        assert 4.5 < m["effective_bpe"] < 16 and m["size_bytes"] < baseline["size_bytes"]
        assert m["kl_divergence"] > 0  # fake quantization really changed the outputs
        assert (layout.ptq(name) / "checkpoint" / "modelopt_state.pth").is_file()
    sel = read_json(layout.selection_metrics)
    assert {"selected", "policy", "band", "reason", "table"} <= set(sel)


def test_broken_recipe_fails_alone(run):
    summary, layout, _ = run
    assert read_json(layout.ptq_metrics(BROKEN))["status"] == "failed"
    assert summary["selection"]["selected"] in GOOD + [None]
    assert BROKEN in summary["selection"]["reason"]
    assert [r["status"] for r in summary["recipes"] if r["name"] == BROKEN] == ["failed"]


def test_recipes_ran_concurrently(run):
    _, layout, _ = run
    spans = [read_json(layout.ptq(n) / "scores.json") for n in GOOD]
    (a0, a1), (b0, b1) = [(s["started_at"], s["finished_at"]) for s in spans]
    assert a0 < b1 and b0 < a1, "the two PTQ processes did not overlap in time"


def test_recipe_table_published_as_prefect_artifact(run):
    _, _, artifacts = run
    keys = {a.key for a in artifacts}
    assert {"recipe-table", "recipe-selection"} <= keys
