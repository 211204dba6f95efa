"""MLflow tracking from the stages' files (qad_pipeline/tracking/), checked through MLflow's own
client against a SQLite store in tmp_path.

The layout is fake but shaped like the real one: the JSON files are written with the same keys the
stages write (tasks/*.py); selection's files are written by the real `run_selection`, the QAD
table by the real `comparison_table`. One broken recipe has no scores, as when its PTQ process died.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from qad_pipeline import tracking
from qad_pipeline.artifacts import read_json, write_json
from qad_pipeline.config import PROJECT_PARAMS, ConfigError, load_params
from qad_pipeline.layout import Layout
from qad_pipeline.results.base import read_result, write_result
from qad_pipeline.results.export import ExportMetrics
from qad_pipeline.results.scores import BaselineMetrics, TaskScore
from qad_pipeline.results.selection import RecipeMetrics, RecipeRow, SelectionResult
from qad_pipeline.tracking.children import ptq_child
from qad_pipeline.tracking.stale import process_tags
from tasks.final_eval import comparison_table
from tasks.selection import run_selection
from tests import samples

GOOD = ["nvfp4_max-mamba_fp8-kv_fp8", "nvfp4_4o6-mamba_w4a16-kv_nvfp4"]
BROKEN = "broken-recipe"
HF_TOKEN = "hf_TESTtokenValue0123456789"
AWS_SECRET = "awsTESTsecretValue/9876543210"
TASKS = {"heldout_cloze": ("acc", True), "heldout_continuation": ("acc", True), "perplexity": ("perplexity", False)}
BASE = {"heldout_cloze": 0.50, "heldout_continuation": 0.60, "perplexity": 40.0}
# per recipe: (scores, effective_bpe, size_bytes, kv_cache, kl)
RECIPES = {
    GOOD[0]: ({"heldout_cloze": 0.49, "heldout_continuation": 0.58, "perplexity": 41.0}, 4.75, 700_000, "fp8", 0.011),
    GOOD[1]: ({"heldout_cloze": 0.48, "heldout_continuation": 0.57, "perplexity": 42.0}, 4.55, 650_000, "nvfp4", 0.020),
}


# -- builders: the files the stages write -----------------------------------------------------------


def fp(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def task_scores(values: dict[str, float]) -> dict[str, TaskScore]:
    return {t: samples.score(v, TASKS[t][0], TASKS[t][1], **({"all": {TASKS[t][0]: v}} if t != "perplexity" else {}))
            for t, v in values.items()}


def touch(path: Path, t: float) -> None:
    os.utime(path, (t, t))


# Each stage process's span as the flow records it (flows/stages.py): (start, end) after t0.
SPANS = {"calibration": (5, 10.5), "baseline": (15, 61), "selection": (99.5, 100.2), "qad": (150, 200.5),
         "final_eval": (210, 250.5), "export": (260, 300.5)}


def write_usage(layout: Layout, t0: float) -> None:
    for stage, (start, end) in SPANS.items():
        write_json(layout.logs / f"{stage}.usage.json", {"stage": stage, "seconds": end - start, "peak_rss_mb": 500.0,
                                                          "exit_code": 0, "started_at": t0 + start,
                                                          "finished_at": t0 + end})


def settings_of(name: str, bpe: float) -> dict:
    """A recipe's settings as selection records them, read off the recipe's name."""
    scale, mamba, kv = name.split("-")
    return {"algorithm": "max" if scale.endswith("max") else "mse", "weight_scale": scale.split("_", 1)[1],
            "mamba_format": mamba.split("_", 1)[1], "kv_cache": kv.split("_", 1)[1], "effective_bpe": bpe}


def lengthen_reason(layout: Layout) -> None:
    """A selection reason longer than a tag holds (the run's description shortens it)."""
    sel = read_result(layout.selection_metrics, SelectionResult)
    sel.reason += " " + "The runner-up lost on bits per element at a recovery within the interval. " * 8
    write_result(layout.selection_metrics, sel)


def make_params(root: Path, model_dir: Path):
    """params.yaml with the test's model, recipes (two real ones and a broken one) and two secrets:
    the HF token as the model revision, the AWS secret as the calibration dataset config. The
    loader refuses such values (config.check_no_secrets); they are put in after it, because the
    MLflow logging must mask them all the same."""
    params = load_params(PROJECT_PARAMS, {
        "base_model.path": str(model_dir),
        "calibration.source": str(root / "text"),
        "ptq.recipes": [*GOOD, BROKEN],
        "qad.steps": 5,
        "selection.band": [0.5, 1.0],
    })
    return params.model_copy(update={
        "base_model": params.base_model.model_copy(update={"revision": HF_TOKEN}),
        "calibration": params.calibration.model_copy(update={"dataset_config": AWS_SECRET}),
    })


def build_layout(root: Path, params, t0: float, qad_gain: float = 0.0) -> Layout:
    """Every stage's files, as a complete `selection.policy: qad` run that started at t0."""
    layout = Layout(root)
    (root / "text").mkdir(parents=True, exist_ok=True)
    (root / "text" / "doc.txt").write_text("Some text.")
    layout.logs.mkdir(parents=True, exist_ok=True)

    manifest = samples.manifest(
        source=params.calibration.source, documents=10,
        calibration_documents=[0, 2, 3, 5, 7], eval_documents=[1, 4, 6, 8, 9],
        calibration={"samples": 4, "seq_len": 64, "fingerprint": fp(f"calib{t0}")},
        eval={"ppl_samples": 4, "seq_len": 64, "heldout_cloze": 16, "heldout_continuation": 8,
              "fingerprint": fp(f"eval{t0}")},
        tokenizer=params.base_model.path, seed=0,
    )
    write_result(layout.data / "manifest.json", manifest)
    touch(layout.data / "manifest.json", t0 + 10)
    (layout.logs / "calibration.log").write_text("calibration: done\n")

    baseline = samples.baseline(task_scores(BASE), effective_bpe=16.0, size_bytes=2_000_000, model={
        "path": params.base_model.path, "revision": params.base_model.revision, "sha256": fp("model")})
    write_result(layout.baseline_metrics, baseline)
    touch(layout.baseline_metrics, t0 + 60)
    # A stage log that printed the environment: the secrets must not survive into MLflow.
    (layout.logs / "baseline.log").write_text(f"env: HF_TOKEN={HF_TOKEN} AWS_SECRET_ACCESS_KEY={AWS_SECRET}\n")

    for i, (name, (scores, bpe, size, kv, kl)) in enumerate(RECIPES.items()):
        started = t0 + 20 + i
        write_result(layout.ptq(name) / "scores.json", samples.ptq_scores(
            name, task_scores(scores), kl_divergence=kl, effective_bpe=bpe, size_bytes=size, kv_cache=kv,
            layer_formats={"model.layers.0.mlp.up_proj": "nvfp4", "lm_head": "nvfp4"},
            started_at=started, finished_at=started + 30.0,
            settings={k: v for k, v in settings_of(name, bpe).items() if k != "effective_bpe"},
        ))
    (layout.logs / f"ptq-{BROKEN}.log").write_text("Traceback ...\nValueError: no_such_algorithm\n")

    run_selection(params, layout)  # the real stage: metrics/ptq/*.json and metrics/selection.json
    lengthen_reason(layout)
    write_usage(layout, t0)
    for name in params.ptq.recipes:
        touch(layout.ptq_metrics(name), t0 + 100)
    touch(layout.selection_metrics, t0 + 100)
    recipe = read_result(layout.selection_metrics, SelectionResult).selected

    training = samples.qad_training(params.qad.steps)
    write_result(layout.qad / "loss.json", training)
    touch(layout.qad / "loss.json", t0 + 200)

    ptq = read_result(layout.ptq_metrics(recipe), RecipeMetrics)
    qad_values = {t: (v + qad_gain if TASKS[t][1] else v - qad_gain) for t, v in RECIPES[recipe][0].items()}
    per_task = {t: (qad_values[t] / BASE[t] if TASKS[t][1] else BASE[t] / qad_values[t]) for t in BASE}
    tasks = {t: s.model_copy(update={"recovery": per_task[t]}) for t, s in task_scores(qad_values).items()}
    qad_median = sorted(per_task.values())[1]
    qad = samples.qad_metrics(recipe, tasks, qad_median, ptq_median_recovery=ptq.median_recovery,
                              ptq_median_recovery_ci=ptq.median_recovery_ci,
                              qad_beats_ptq=qad_median > ptq.median_recovery, steps=params.qad.steps,
                              final_loss=training.final_loss, first_loss=training.first_loss,
                              steps_per_second=training.steps_per_second)
    qad.table = comparison_table(read_result(layout.baseline_metrics, BaselineMetrics), ptq, qad, recipe)
    write_result(layout.qad_metrics, qad)
    touch(layout.qad_metrics, t0 + 250)

    if layout.export.exists():
        shutil.rmtree(layout.export)
    layout.export.mkdir(parents=True)
    write_json(layout.export / "config.json", {"architectures": ["LlamaForCausalLM"], "t0": t0})
    write_json(layout.export / "hf_quant_config.json", {"quantization": {"quant_algo": "NVFP4"}})
    (layout.export / "model.safetensors").write_bytes(b"\0" * 64)
    write_result(layout.export_metrics, samples.export_metrics(layout.export))
    touch(layout.export_metrics, t0 + 300)
    return layout


# -- one store, two pipeline runs logged and registered ---------------------------------------------


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Two pipeline runs of the same out root, each logged and its export registered."""
    root = tmp_path_factory.mktemp("tracking")
    model_dir = root / "base-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv("HF_TOKEN", HF_TOKEN)
        mp.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
        params = make_params(root, model_dir)
        uri = tracking.tracking_uri(root)
        runs = []
        for i, t0 in enumerate((time.time() - 7200, time.time() - 3600)):
            layout = build_layout(root, params, t0, qad_gain=0.01 * (i + 1))
            snapshot = {"qad": read_json(layout.qad_metrics), "export": read_json(layout.export_metrics),
                        "manifest": read_json(layout.data / "manifest.json"), "t0": t0,
                        "ptq": {r: read_json(layout.ptq_metrics(r)) for r in params.ptq.recipes},
                        "selection": read_json(layout.selection_metrics)}
            run_id = tracking.log_pipeline(layout, params, flow_run_id=f"flow-{i}", git_commit=f"{i}" * 40,
                                           report=f"report {i}: token {HF_TOKEN}")
            version = tracking.register_export(layout, params, run_id)
            runs.append({"run_id": run_id, "version": version, **snapshot})
    return {"root": root, "uri": uri, "params": params, "runs": runs, "client": MlflowClient(uri, uri)}


def children(client, parent_id):
    parent = client.get_run(parent_id)
    found = client.search_runs([parent.info.experiment_id],
                               filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    return {r.info.run_name: r for r in found}


# -- tests --------------------------------------------------------------------------------------------


def test_tracking_uri_default_is_sqlite_in_root_and_env_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert tracking.tracking_uri(tmp_path) == "http://mlflow.example:5000"


def test_check_reachable_fails_fast_naming_the_uri(tmp_path):
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"http://127\.0\.0\.1:9"):
        tracking.check_reachable("http://127.0.0.1:9")
    assert time.monotonic() - started < 5
    with pytest.raises(ConfigError, match="cannot be reached"):
        tracking.check_reachable("http://127.0.0.1:9", timeout_s=0.5)
    tracking.check_reachable(f"sqlite:///{tmp_path}/sub/mlflow.db")  # creates the folder
    assert (tmp_path / "sub").is_dir()


def test_parent_and_one_child_per_stage_and_recipe(logged):
    client, first = logged["client"], logged["runs"][0]
    parent = client.get_run(first["run_id"])
    exp = client.get_experiment(parent.info.experiment_id)
    assert exp.name == f"qad-pipeline/{logged['params'].base_model.path}"
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["qad.kind"] == "pipeline"
    assert parent.data.tags["prefect.flow_run_id"] == "flow-0"
    assert parent.data.tags["mlflow.source.git.commit"] == "0" * 40
    assert parent.data.tags["base_model.path"] == logged["params"].base_model.path
    assert parent.data.tags["base_model.sha256"] == fp("model")
    kids = children(client, first["run_id"])
    assert set(kids) == {"calibration", "baseline", *(f"ptq-{r}" for r in [*GOOD, BROKEN]),
                         "selection", "qad", "final_eval", "export"}
    for name, run in kids.items():
        assert run.data.tags["mlflow.parentRunId"] == first["run_id"]
        assert run.info.status == ("FAILED" if name == f"ptq-{BROKEN}" else "FINISHED"), name
    broken = kids[f"ptq-{BROKEN}"]
    assert broken.data.tags["error"] == first["ptq"][BROKEN]["error"]
    log = Path(client.download_artifacts(broken.info.run_id, f"logs/ptq-{BROKEN}.log")).read_text()
    assert "no_such_algorithm" in log
    good = kids[f"ptq-{GOOD[0]}"]
    scores = first["ptq"][GOOD[0]]
    assert good.info.start_time == int(scores["started_at"] * 1000)
    assert good.info.end_time == int(scores["finished_at"] * 1000)
    assert parent.info.start_time == min(r.info.start_time for r in kids.values())
    # the configuration, flattened with dots, on the parent
    assert parent.data.params["qad.steps"] == "5"
    assert json.loads(parent.data.params["ptq.recipes"]) == [*GOOD, BROKEN]
    assert parent.data.params["selection.band"] == "[0.5, 1.0]"
    # the selection: table + reason as a JSON artifact and as tags
    sel = first["selection"]
    assert parent.data.tags["qad.selected"] == sel["selected"]
    assert parent.data.tags["qad.selection.reason"] == tracking.short_reason(sel["reason"])
    sel_file = client.download_artifacts(kids["selection"].info.run_id, "selection.json")
    logged_sel = json.loads(Path(sel_file).read_text())
    assert logged_sel["table"] == sel["table"]
    report = Path(client.download_artifacts(first["run_id"], "report.txt")).read_text()
    assert report.startswith("report 0: token ") and HF_TOKEN not in report


def test_metrics_equal_the_files(logged):
    client, first = logged["client"], logged["runs"][0]
    kids = children(client, first["run_id"])
    for recipe in GOOD:
        m, expected = kids[f"ptq-{recipe}"].data.metrics, first["ptq"][recipe]
        for key in ("median_recovery", "effective_bpe", "size_bytes", "kl_divergence"):
            assert m[key] == pytest.approx(expected[key]), (recipe, key)
        for task, score in expected["tasks"].items():
            assert m[f"score.{task}"] == pytest.approx(score["value"])
            assert m[f"recovery.{task}"] == pytest.approx(score["recovery"])
    qad = kids["final_eval"].data.metrics
    assert qad["median_recovery"] == pytest.approx(first["qad"]["median_recovery"])
    assert qad["qad_beats_ptq"] == float(first["qad"]["qad_beats_ptq"])
    export = kids["export"].data
    for key in ("size_bytes", "bf16_size_bytes", "size_ratio", "effective_bpe"):
        assert export.metrics[key] == pytest.approx(first["export"][key])
    assert export.metrics["checks.reload.kl_divergence"] == pytest.approx(
        first["export"]["checks"]["reload"]["kl_divergence"])
    assert export.metrics["passed"] == 1.0
    assert export.tags["check.formats"] == export.tags["check.size"] == export.tags["check.reload"] == "passed"
    assert export.tags["check.serving"] == "passed" and export.tags["serving_check"] == "full"
    assert export.metrics["checks.serving.kl_divergence"] == pytest.approx(5e-5)
    assert export.metrics["checks.serving.top1_agreement"] == pytest.approx(0.99)
    cal = kids["calibration"].data.metrics
    assert cal["calibration.samples"] == first["manifest"]["calibration"]["samples"]


def test_loss_curve_is_one_metric_per_step(logged):
    client, first = logged["client"], logged["runs"][0]
    qad_run = children(client, first["run_id"])["qad"]
    history = sorted(client.get_metric_history(qad_run.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, logged["params"].qad.steps + 1))
    assert [m.value for m in history] == pytest.approx([0.5 / s for s in range(1, logged["params"].qad.steps + 1)])
    assert history[0].timestamp <= history[-1].timestamp


def test_datasets_carry_the_manifest_fingerprints(logged):
    client, first = logged["client"], logged["runs"][0]
    manifest = first["manifest"]
    for run_id in (first["run_id"], children(client, first["run_id"])["calibration"].info.run_id):
        inputs = {d.dataset.name: d for d in client.get_run(run_id).inputs.dataset_inputs}
        assert set(inputs) == {"calibration", "eval"}
        for name in ("calibration", "eval"):
            full = manifest[name]["fingerprint"]
            dataset = inputs[name].dataset
            # MLflow stores at most 36 characters of a digest; the full fingerprint is an input tag
            assert dataset.digest == full[:36]
            assert {t.key: t.value for t in inputs[name].tags}["fingerprint"] == full
            assert json.loads(dataset.profile)["fingerprint"] == full
            assert manifest["source"] in dataset.source
        contexts = {name: {t.key: t.value for t in d.tags}["mlflow.data.context"] for name, d in inputs.items()}
        assert contexts == {"calibration": "calibration", "eval": "evaluation"}


def test_export_registered_with_candidate_alias_that_moves_to_the_newer_version(logged, monkeypatch):
    client, (first, second) = logged["client"], logged["runs"]
    name = tracking.registered_model_name(logged["params"].base_model.path)
    assert "/" not in name and name.endswith("-nvfp4")
    assert (first["version"], second["version"]) == ("1", "2")
    candidate = client.get_model_version_by_alias(name, "candidate")
    assert str(candidate.version) == "2"
    assert candidate.run_id == second["run_id"]  # the pipeline run: its page lists the version
    assert candidate.source.startswith(client.get_run(second["run_id"]).info.artifact_uri)
    assert client.get_model_version(name, "1").run_id == first["run_id"]
    export_run = children(client, second["run_id"])["export"]
    assert export_run.data.tags["registered_model"] == f"models:/{name}/2"
    # models:/<name>@candidate leads to the run's checkpoint artifacts
    monkeypatch.setenv("MLFLOW_TRACKING_URI", logged["uri"])  # models:/ resolves through the default registry
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{name}@candidate"))
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "hf_quant_config.json", "model.safetensors"]
    assert json.loads((local / "config.json").read_text())["t0"] == second["t0"]


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


def test_secrets_never_reach_params_tags_or_artifacts(logged):
    client, root = logged["client"], logged["root"]
    secrets = (HF_TOKEN, AWS_SECRET)
    exp_id = client.get_run(logged["runs"][0]["run_id"]).info.experiment_id
    runs = client.search_runs([exp_id], max_results=1000)
    assert len(runs) == 2 * 10  # parent + 9 children, twice
    for run in runs:
        for key, value in [*run.data.params.items(), *run.data.tags.items()]:
            assert not any(s in value for s in secrets), (run.info.run_name, key)
        for d in run.inputs.dataset_inputs:
            assert not any(s in d.dataset.source + (d.dataset.profile or "") for s in secrets)
    parent = client.get_run(logged["runs"][0]["run_id"])
    assert parent.data.params["base_model.revision"] == "***"  # value of a secret env var
    assert parent.data.params["calibration.dataset_config"] == "***"
    artifacts = [p for p in (root / "mlartifacts").rglob("*") if p.is_file()]
    assert any(p.name == "baseline.log" for p in artifacts) and any(p.name == "params.json" for p in artifacts)
    for path in [*artifacts, root / "mlflow.db"]:
        data = path.read_bytes()
        assert not any(s.encode() in data for s in secrets), path
    for mv in client.search_model_versions():
        assert not any(s in json.dumps([mv.tags, mv.description, mv.source]) for s in secrets)


@pytest.mark.parametrize("name", ["HF_TOKEN", "hf_token", "api_token", "MLFLOW_TRACKING_TOKEN", "accessToken",
                                  "AWS_SECRET_ACCESS_KEY", "aws_access_key_id", "api_key", "apiKey", "APIKEY",
                                  "db.Password", "passwd", "client_secret", "google_credentials", "GITHUB_TOKEN2"])
def test_secret_names_are_masked(name):
    assert tracking.is_secret_name(name)
    assert tracking.redact(name, "some-value") == "***"


@pytest.mark.parametrize("name", ["tokenizer", "calibration.tokenizer", "TOKENIZERS_PARALLELISM", "tokens_per_step",
                                  "keyframes", "base_model.path", "kv_cache", "monkeys"])
def test_names_that_only_contain_a_secret_word_are_not_masked(name, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "falsey-value")  # not a secret: its value is not scrubbed
    assert not tracking.is_secret_name(name)
    assert tracking.redact(name, "demo/model") == "demo/model"
    assert "falsey-value" not in tracking.secret_values()


def test_redact_rules(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    assert tracking.redact("HF_TOKEN", "anything") == "***"
    assert tracking.redact("aws_secret_access_key", "x" * 20) == "***"
    assert tracking.redact("db.Password", "hunter2") == "***"
    assert tracking.redact("api_key", "k") == "***"
    assert tracking.redact("tokens_per_step", 2048) == "2048"  # numbers are not secrets
    assert tracking.redact("base_model.revision", f"main-{HF_TOKEN}") == "main-***"
    assert tracking.redact("uri", "https://user:pa55@host/x") == "https://***@host/x"
    assert tracking.redact("qad.lr", 1e-4) == "0.0001"
    flat = tracking.flatten({"env": {"HF_TOKEN": HF_TOKEN, "n": 1}, "a": [1, 2]})
    assert {k: tracking.redact(k, v) for k, v in flat.items()} == {"env.HF_TOKEN": "***", "env.n": "1", "a": "[1, 2]"}
    nested = {"nested": [{"password": "p"}, f"x{AWS_SECRET}"]}
    assert tracking.redact_data(nested) == {"nested": [{"password": "***"}, "x***"]}


def test_mark_stale_runs_ends_runs_of_dead_processes(logged):
    uri, client = logged["uri"], logged["client"]  # the shared store: a new database costs seconds
    exp_id = tracking.ensure_experiment(client, tracking.experiment_name("some/model"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = client.create_run(exp_id, tags={"qad.kind": "pipeline", "qad.host": host, "qad.pid": str(dead.pid)})
    alive = client.create_run(exp_id, tags={"qad.kind": "pipeline", **process_tags()})
    elsewhere = client.create_run(exp_id, tags={"qad.kind": "pipeline", "qad.host": "other-host", "qad.pid": "1"})
    foreign = client.create_run(exp_id, tags={"note": "not ours"})
    assert tracking.mark_stale_runs(uri) == [stale.info.run_id]
    status = {r: client.get_run(r).info.status for r in
              (stale.info.run_id, alive.info.run_id, elsewhere.info.run_id, foreign.info.run_id)}
    assert status == {stale.info.run_id: "KILLED", alive.info.run_id: "RUNNING",
                      elsewhere.info.run_id: "RUNNING", foreign.info.run_id: "RUNNING"}
    assert "no longer runs" in client.get_run(stale.info.run_id).data.tags["qad.stale"]
    assert tracking.mark_stale_runs(uri, all_hosts=True) == [elsewhere.info.run_id]
    client.set_terminated(alive.info.run_id)
    client.set_terminated(foreign.info.run_id)


def test_failed_export_is_a_failed_run_and_is_not_registered(logged, tmp_path):
    uri, client = logged["uri"], logged["client"]
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    params = make_params(tmp_path, model_dir)
    layout = build_layout(tmp_path, params, time.time() - 100)
    export = read_result(layout.export_metrics, ExportMetrics)
    export.checks["size"]["passed"] = False
    export.passed = False
    write_result(layout.export_metrics, export)
    run_id = tracking.log_pipeline(layout, params, flow_run_id=None, git_commit=None, uri=uri)
    assert client.get_run(run_id).info.status == "FAILED"
    run = children(client, run_id)["export"]
    assert run.info.status == "FAILED" and run.data.tags["check.size"] == "FAILED"
    assert "size" in run.data.tags["error"]
    with pytest.raises(ConfigError, match="did not pass its checks"):
        tracking.register_export(layout, params, run_id, uri=uri)


# -- the same round trip against PostgreSQL (skipped where PostgreSQL or psycopg2 is missing) ---------


def _postgres_bin() -> Path | None:
    """The folder of pg_ctl and initdb: on PATH, else Debian's /usr/lib/postgresql/<version>/bin."""
    on_path = [shutil.which("pg_ctl"), shutil.which("initdb")]
    if all(on_path):
        return Path(on_path[0]).resolve().parent
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / "pg_ctl").is_file() and (folder / "initdb").is_file():
            return folder
    return None


@pytest.fixture
def postgres_uri():
    """A throwaway PostgreSQL server on a free port; yields its SQLAlchemy URI."""
    import pwd
    import tempfile

    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed: no pg_ctl/initdb (Debian: apt-get install postgresql)")
    import importlib.util

    # SQLAlchemy >= 2.1 reads plain postgresql:// as psycopg 3; name whichever driver is installed.
    driver = next((d for d in ("psycopg2", "psycopg") if importlib.util.find_spec(d)), None)
    if driver is None:
        pytest.skip("neither psycopg2 nor psycopg is installed (pip install psycopg2-binary): "
                    "MLflow needs one for postgresql://")
    run_as: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        if shutil.which("runuser") is None:
            pytest.skip("running as root and there is no runuser to start the server as 'postgres'")
        run_as = ["runuser", "-u", "postgres", "--"]
    # Outside tmp_path: the server's user must be able to reach its folder.
    folder = Path(tempfile.mkdtemp(prefix="qad-pg-"))
    if run_as:
        os.chown(folder, user.pw_uid, user.pw_gid)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = folder / "db"
    try:
        subprocess.run([*run_as, str(bindir / "initdb"), "-D", str(db), "-U", "postgres", "--auth=trust",
                        "-E", "UTF8", "--no-sync"], check=True, capture_output=True, timeout=120)
        subprocess.run([*run_as, str(bindir / "pg_ctl"), "-D", str(db), "-l", str(folder / "server.log"), "-w",
                        "-t", "60", "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off",
                        "start"], check=True, capture_output=True, timeout=90)
        yield f"postgresql+{driver}://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*run_as, str(bindir / "pg_ctl"), "-D", str(db), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def test_postgresql_round_trip(postgres_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", postgres_uri)
    tracking.check_reachable(postgres_uri)
    closed = postgres_uri.rsplit(":", 1)[0] + ":9/postgres"  # nothing listens on port 9
    with pytest.raises(ConfigError, match="cannot be reached at 127.0.0.1:9"):
        tracking.check_reachable(closed)
    model_dir = tmp_path / "base-model"
    model_dir.mkdir()
    params = make_params(tmp_path, model_dir)
    layout = build_layout(tmp_path, params, time.time() - 600)
    assert tracking.tracking_uri(tmp_path) == postgres_uri
    run_id = tracking.log_pipeline(layout, params, flow_run_id="pg", git_commit=None)
    assert tracking.register_export(layout, params, run_id) == "1"
    rows = tracking.compare_table(postgres_uri, params.base_model.path)
    assert [r["name"] for r in rows] == ["bf16", *GOOD, BROKEN, "qad"]
    assert rows[-1]["median_recovery"] == pytest.approx(read_json(layout.qad_metrics)["median_recovery"])
    assert all(r["run_id"] in {c.info.run_id for c in children(MlflowClient(postgres_uri), run_id).values()}
               for r in rows)


# -- made for comparison (issue 15) -------------------------------------------------------------------


def test_stage_runs_span_their_process_times(logged):
    client, first = logged["client"], logged["runs"][0]
    kids = children(client, first["run_id"])
    for stage, (start, end) in SPANS.items():
        run = kids[stage]
        assert run.info.start_time == int(1000 * (first["t0"] + start)), stage
        assert run.info.end_time == int(1000 * (first["t0"] + end)), stage
        assert run.info.end_time - run.info.start_time > 0, stage


def test_stage_span_falls_back_to_the_output_time_when_the_usage_file_is_of_another_run(tmp_path):
    layout = Layout(tmp_path)
    out = tmp_path / "metrics" / "selection.json"
    write_result(out, samples.selection(None, []))
    touch(out, 2_000.0)
    write_json(layout.logs / "selection.usage.json", {"started_at": 1_000.0, "finished_at": 1_001.0})
    assert tracking.stage_span(layout, "selection", out) == (2_000_000, 2_000_000)
    write_json(layout.logs / "selection.usage.json", {"seconds": 30.0})  # an older usage file: no times
    touch(layout.logs / "selection.usage.json", 2_001.0)
    assert tracking.stage_span(layout, "selection", out) == (1_971_000, 2_001_000)


def test_recipe_settings_are_params_of_each_recipe_run(logged):
    client, first = logged["client"], logged["runs"][0]
    kids = children(client, first["run_id"])
    rows = {r["name"]: r for r in first["selection"]["table"]}
    for recipe in GOOD:
        params = kids[f"ptq-{recipe}"].data.params
        assert params["recipe"] == recipe
        assert params == {"recipe": recipe, **{k: str(v) for k, v in rows[recipe]["settings"].items()}}
        for key in ("weight_scale", "mamba_format", "kv_cache", "effective_bpe"):
            assert key in params
        metrics = kids[f"ptq-{recipe}"].data.metrics
        low, high = first["ptq"][recipe]["median_recovery_ci"]
        assert (metrics["median_recovery_ci_low"], metrics["median_recovery_ci_high"]) == pytest.approx((low, high))
        assert metrics["weight_error.median"] == pytest.approx(first["ptq"][recipe]["weight_error"]["median"])


def test_parent_metrics_hold_the_selected_and_the_qad_recovery(logged):
    client, first = logged["client"], logged["runs"][0]
    m = client.get_run(first["run_id"]).data.metrics
    ptq = first["ptq"][first["selection"]["selected"]]
    assert m["selected.median_recovery"] == pytest.approx(ptq["median_recovery"])
    assert (m["selected.median_recovery_ci_low"], m["selected.median_recovery_ci_high"]) == pytest.approx(
        tuple(ptq["median_recovery_ci"]))
    assert m["selected.kl_divergence"] == pytest.approx(ptq["kl_divergence"])
    assert m["selected.effective_bpe"] == pytest.approx(ptq["effective_bpe"])
    qad = first["qad"]
    assert m["qad.median_recovery"] == pytest.approx(qad["median_recovery"])
    assert (m["qad.median_recovery_ci_low"], m["qad.median_recovery_ci_high"]) == pytest.approx(
        tuple(qad["median_recovery_ci"]))
    assert m["qad.kl_divergence"] == pytest.approx(qad["kl_divergence"])
    # the delivered model's numbers under the recipe runs' own keys: one runs-table column for all
    assert m["median_recovery"] == pytest.approx(qad["median_recovery"])
    assert m["median_recovery_ci_low"] == pytest.approx(qad["median_recovery_ci"][0])
    assert m["effective_bpe"] == pytest.approx(first["export"]["effective_bpe"])


def _tables(markdown: str) -> list[list[list[str]]]:
    """The tables of a GitHub-flavoured Markdown text as parsed, each a list of rows of cells."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    tables, row = [], None
    for tok in tokens:
        if tok.type == "table_open":
            tables.append([])
        elif tok.type == "tr_open":
            row = []
        elif tok.type == "inline" and row is not None:
            row.append(tok.content)
        elif tok.type == "tr_close":
            tables[-1].append(row)
            row = None
    return tables


def test_run_description_is_markdown_with_tables_and_the_full_reason_is_an_artifact(logged):
    client, first = logged["client"], logged["runs"][0]
    parent = client.get_run(first["run_id"])
    note = parent.data.tags["mlflow.note.content"]
    headline, recipes = _tables(note)
    assert [len(r) for r in headline] == [6] * 3  # header, selected PTQ, QAD
    assert headline[1][1] == first["selection"]["selected"]
    assert headline[2][2] == f"{100 * first['qad']['median_recovery']:.2f}"  # rounded, not 0.98765432
    assert len({len(r) for r in recipes}) == 1 and len(recipes) == 1 + 1 + 3  # header, bf16, recipes
    assert f"{BROKEN} FAILED" in note and "★ selected" in note
    reason = first["selection"]["reason"]
    assert len(reason) > 300 and len(parent.data.tags["qad.selection.reason"]) < 300
    logged_reason = Path(client.download_artifacts(first["run_id"], "selection_reason.txt")).read_text()
    assert logged_reason == reason
    report = Path(client.download_artifacts(first["run_id"], "report.md")).read_text()
    assert len(_tables(report)) >= 3


def test_registered_version_describes_the_exported_model(logged):
    client, second = logged["client"], logged["runs"][1]
    name = tracking.registered_model_name(logged["params"].base_model.path)
    version = client.get_model_version(name, second["version"])
    qad = second["qad"]
    assert f"{100 * qad['median_recovery']:.2f} %" in version.description
    assert f"{100 * qad['ptq_median_recovery']:.2f} %" in version.description
    assert "1" * 40 in version.description  # the git commit of the second run
    assert second["manifest"]["calibration"]["fingerprint"] in version.description
    assert second["manifest"]["eval"]["fingerprint"] in version.description
    assert fp("model") in version.description
    assert float(version.tags["median_recovery"]) == pytest.approx(qad["median_recovery"])
    assert version.tags["git_commit"] == "1" * 40
    assert version.tags["eval.fingerprint"] == second["manifest"]["eval"]["fingerprint"]
    rows = _tables(version.description)[0]
    assert [len(r) for r in rows] == [4, 4, 4]


def test_run_url_points_at_the_server_or_the_local_ui():
    assert tracking.run_url("http://mlflow.example:5000/", "3", "abc") == "http://mlflow.example:5000/#/experiments/3/runs/abc"
    assert tracking.run_url("sqlite:////x/mlflow.db", "3", "abc") == "http://127.0.0.1:5000/#/experiments/3/runs/abc"


def test_an_alias_recipe_run_has_the_metrics_of_the_recipe_it_equals_and_no_duration(tmp_path):
    params = make_params(tmp_path, tmp_path)
    layout = Layout(tmp_path)
    ran, alias = GOOD[0], "nvfp4_max-mamba_w4a16-kv_fp8"
    write_result(layout.ptq_metrics(ran), samples.recipe_metrics(
        ran, task_scores(RECIPES[ran][0]), 0.98, median_recovery_ci=(0.97, 0.99), effective_bpe=4.75,
        started_at=1000.0, finished_at=1030.0))
    write_result(layout.selection_metrics, samples.selection(None, []))
    row = RecipeRow(alias, "alias", alias_of=ran, settings=settings_of(alias, 4.75))
    child = ptq_child(layout, params, alias, row)
    assert child.status == "FINISHED" and child.tags["alias_of"] == ran
    assert child.metrics["median_recovery"] == 0.98 and child.metrics["median_recovery_ci_high"] == 0.99
    assert child.params["mamba_format"] == "w4a16" and child.start_ms == child.end_ms


def test_a_logging_cut_short_is_completed_and_nothing_is_logged_twice(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model_dir = tmp_path / "base-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    params = make_params(tmp_path, model_dir)
    layout = build_layout(tmp_path, params, time.time() - 600)
    uri = tracking.tracking_uri(tmp_path)
    client = MlflowClient(uri, uri)
    run_id = tracking.start_pipeline_run(layout, params, flow_run_id="flow", git_commit="0" * 40)
    tracking.record_run(layout, uri, run_id, logged=False)
    tracking.log_pipeline(layout, params, flow_run_id="flow", git_commit="0" * 40, run_id=run_id)
    before = children(client, run_id)
    # the store went away while the export's child run was being logged: not complete, parent not ended
    cut = before["export"].info.run_id
    client.delete_tag(cut, "qad.complete")
    client.update_run(cut, status="FAILED")
    client.update_run(run_id, status="RUNNING")
    record = tracking.recorded_run(layout, uri)
    assert record is not None and record.run_id == run_id and not record.logged

    assert tracking.log_pipeline(layout, params, flow_run_id=None, git_commit="0" * 40, run_id=run_id) == run_id
    after = children(client, run_id)
    assert after.keys() == before.keys()  # one child per stage and recipe, none twice
    assert {n: r.info.run_id for n, r in after.items() if n != "export"} == \
        {n: r.info.run_id for n, r in before.items() if n != "export"}  # the complete ones were kept
    assert after["export"].info.run_id != cut and client.get_run(cut).info.lifecycle_stage == "deleted"
    assert after["export"].info.status == "FINISHED" and client.get_run(run_id).info.status == "FINISHED"
    name = tracking.registered_model_name(params.base_model.path)
    versions = [tracking.register_export(layout, params, run_id) for _ in range(2)]
    assert versions == ["1", "1"] and len(client.search_model_versions(f"name='{name}'")) == 1
    pipeline_runs = client.search_runs([client.get_run(run_id).info.experiment_id],
                                       filter_string="tags.`qad.kind` = 'pipeline'")
    assert [r.info.run_id for r in pipeline_runs] == [run_id]
