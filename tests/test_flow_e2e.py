"""One tiny end-to-end run of the qad-pipeline flow on the bundled demo model (tests/conftest.py).

Two real recipes plus one broken one run as parallel processes; the broken one fails alone,
selection goes on among the survivors, and the metrics contract holds.
"""

import json
import math

import pytest

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.results.base import dump_result, read_result
from qad_pipeline.results.run import RunSummary
from tests.conftest import BROKEN_RECIPE as BROKEN
from tests.conftest import GOOD_RECIPES as GOOD
from tests.samples import result_files


@pytest.fixture(scope="module")
def run(pipeline_run):
    summary, layout, overrides, artifacts = pipeline_run
    return summary, layout, artifacts, overrides


def run_overrides(run):
    return run[3]


@pytest.mark.slow
def test_metrics_contract(run):
    _, layout, _, _ = run
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


@pytest.mark.slow
def test_every_result_file_matches_its_model(run):
    """The stages' real files validate against qad_pipeline/results.py, and reading and writing
    them back changes no byte; so does the flow's result."""
    summary, layout, _, _ = run
    missing = []
    for path, kind in result_files(layout, GOOD + [BROKEN]):
        if not path.is_file():
            missing.append(path)
            continue
        result = read_result(path, kind)
        assert json.dumps(dump_result(result), indent=2) + "\n" == path.read_text(), path
    # the broken recipe's PTQ process died; racing is off, so no race files; eval.backend is hf: no served eval
    assert missing == [layout.ptq(BROKEN) / "scores.json", layout.race_metrics,
                       *(layout.race(r) / "scores.json" for r in GOOD + [BROKEN]), layout.served_metrics]
    assert dump_result(RunSummary.model_validate(summary)) == json.loads(json.dumps(summary))


@pytest.mark.slow
def test_broken_recipe_fails_alone(run):
    summary, layout, _, _ = run
    assert read_json(layout.ptq_metrics(BROKEN))["status"] == "failed"
    assert summary["selection"]["selected"] in GOOD + [None]
    assert BROKEN in summary["selection"]["reason"]
    assert [r["status"] for r in summary["recipes"] if r["name"] == BROKEN] == ["failed"]


@pytest.mark.slow
def test_recipes_ran_concurrently(run):
    _, layout, _, _ = run
    spans = [read_json(layout.ptq(n) / "scores.json") for n in GOOD]
    (a0, a1), (b0, b1) = [(s["started_at"], s["finished_at"]) for s in spans]
    assert a0 < b1 and b0 < a1, "the two PTQ processes did not overlap in time"


@pytest.mark.slow
def test_recipe_table_published_as_prefect_artifact(run):
    _, _, prefect, _ = run
    keys = {a.key for a in prefect["artifacts"]}
    assert {"recipe-table-demo-model", "qad-pipeline-report-demo-model", "mlflow-run-demo-model"} <= keys, keys


@pytest.mark.slow
def test_prefect_graph_has_the_dag_edges(run):
    """The task runs' upstream dependencies, as Prefect's API records them (the UI draws these), are
    the registry's `Stage.after`: every task run of each stage it names, in this run."""
    from qad_pipeline.core.config import PROJECT_PARAMS, load_params
    from qad_pipeline.core.stages import planned

    _, _, prefect, overrides = run
    runs = prefect["task_runs"]
    names = {r.id: r.name for r in runs}
    upstream = {r.name: {names[i.id] for inputs in r.task_inputs.values() for i in inputs if i.id in names}
                for r in runs}
    plan = planned(load_params(PROJECT_PARAMS, overrides))
    expected = {declared.run_name(item): {other.run_name(i) for other, i in plan if other.name in declared.after}
                for declared, item in plan}
    assert upstream == expected
    recipes = {f"ptq-{n}" for n in GOOD + [BROKEN]}
    assert upstream["selection"] == {"baseline", *recipes}  # the failed recipe too: selection runs anyway
    assert upstream["export"] == {"selection", "final_eval"}


@pytest.mark.slow
def test_qad_and_export_ran(run):
    summary, layout, _, _ = run
    qad = read_json(layout.qad_metrics)
    for key in ("median_recovery", "tasks", "steps", "final_loss", "ptq_median_recovery"):
        assert key in qad
    assert qad["steps"] == 4 and math.isfinite(qad["final_loss"])
    # Four tiny steps already pull the student toward the teacher on held-out text.
    ptq = read_json(layout.ptq_metrics(summary["selection"]["selected"]))
    assert qad["kl_divergence"] < ptq["kl_divergence"]
    export = read_json(layout.export_metrics)
    for key in ("path", "size_bytes", "bf16_size_bytes", "effective_bpe", "layer_formats", "checks"):
        assert key in export
    assert all(c["passed"] for c in export["checks"].values())
    assert (layout.export / "hf_quant_config.json").is_file() and (layout.export / "serving.json").is_file()
    assert summary["export"]["size_ratio"] > 1.5


@pytest.mark.slow
def test_mlflow_holds_the_run_and_compare_prints_it(run):
    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from qad_pipeline.cli import app

    summary, layout, _, _ = run
    info = summary["mlflow"]
    assert "error" not in info, info
    client = MlflowClient(info["uri"])
    parent = client.get_run(info["run_id"])
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_name = {c.info.run_name: c for c in children}
    assert {"calibration", "baseline", "selection", "qad", "final_eval", "export"} <= set(by_name)
    assert by_name[f"ptq-{BROKEN}"].info.status == "FAILED"
    assert by_name[f"ptq-{GOOD[0]}"].data.metrics["median_recovery"] == pytest.approx(
        read_json(layout.ptq_metrics(GOOD[0]))["median_recovery"])
    version = client.get_model_version_by_alias(info["registered_model"], "candidate")
    assert version.run_id == parent.info.run_id

    result = CliRunner().invoke(app, ["compare", "--out-root", str(layout.root), *sum((["--set", o] for o in run_overrides(run)), [])])
    assert result.exit_code == 0, result.output
    assert GOOD[0] in result.output and "qad" in result.output


@pytest.mark.slow
def test_plots_drawn_and_logged(run):
    from mlflow import MlflowClient

    summary, layout, _, _ = run
    assert {p.rsplit("/", 1)[-1] for p in summary["plots"]} == {"recovery_vs_bpe.png", "qad_loss.png"}
    for p in summary["plots"]:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    logged = MlflowClient(summary["mlflow"]["uri"]).list_artifacts(summary["mlflow"]["run_id"], "plots")
    assert {a.path for a in logged} == {"plots/recovery_vs_bpe.png", "plots/qad_loss.png"}
