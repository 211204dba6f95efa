"""Fake run folders and one shared MLflow store for the tracking tests (tests/test_tracking_*.py).

The layout is fake but shaped like the real one: the JSON files are written with the same keys the
stages write (tasks/*.py); selection's files are written by the real `run_selection`, the QAD
table by the real `comparison_table`. One broken recipe has no scores, as when its PTQ process died.

`logged_store` logs two pipeline runs of one out root into a SQLite store once per test process
(tmp_path_factory is per session): each test file's `logged` fixture returns it, so splitting the
tests by job does not log them again per file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from qad_pipeline import tracking
from qad_pipeline.core.artifacts import read_json, write_json
from qad_pipeline.core.config import PROJECT_PARAMS, load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import read_result, write_result
from qad_pipeline.results.scores import AutoQuantizeLayer, AutoQuantizeResult, BaselineMetrics, TaskScore
from qad_pipeline.results.selection_metrics import RecipeMetrics, SelectionResult
from qad_pipeline.results.sweep_metrics import BPESweep, Knee, SweepPoint
from tasks.final_eval import comparison_table
from tasks.selection import run_selection
from tests import samples

GOOD = ["nvfp4_max-mamba_fp8-kv_fp8", "nvfp4_4o6-mamba_w4a16-kv_nvfp4"]
BROKEN = "broken-recipe"
HF_TOKEN = "hf_TESTtokenValue0123456789"
AWS_SECRET = "awsTESTsecretValue/9876543210"
MLFLOW_PASSWORD = "mlflowTESTpassword0123"  # MLFLOW_TRACKING_PASSWORD (Secret qad-mlflow-auth)
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


# Each stage process's span as the flow records it (flows/stage_process.py): (start, end) after t0.
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


def logged_run_files(root: Path):
    """A finished run's files under `root` (its base model a folder with a Llama config): (params, layout)."""
    model_dir = root / "base-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    params = make_params(root, model_dir)
    return params, build_layout(root, params, time.time() - 600)


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
    (layout.logs / "baseline.log").write_text(f"env: HF_TOKEN={HF_TOKEN} AWS_SECRET_ACCESS_KEY={AWS_SECRET} "
                                              f"MLFLOW_TRACKING_PASSWORD={MLFLOW_PASSWORD}\n")

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


def write_sweep(layout: Layout, params, t0: float, budgets: tuple[float, ...] = (5.0, 8.0)) -> BPESweep:
    """A BPE sweep's files, as its stages write them after starting at t0: each budget's
    `artifacts/sweep/<budget>/scores.json` (a PTQ recipe's, with its AutoQuantize layer map) and
    `metrics/bpe_sweep.json` (the points, the knee at the first budget); also the Pareto plot."""
    points = []
    for i, budget in enumerate(budgets):
        name = f"{params.sweep.recipe}@{budget}"
        searched = AutoQuantizeResult(
            budget=budget, searched_effective_bits=budget - 0.1, minimum_bits=4.5, method="gradient",
            formats=["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"], kv_cache="fp8", reused_search=True, search_s=1.0,
            layers={"model.layers.0.mlp.up_proj": AutoQuantizeLayer(
                format="NVFP4_DEFAULT_CFG", modules=["model.layers.0.mlp.up_proj"],
                scores={"NVFP4_DEFAULT_CFG": 0.1, "FP8_DEFAULT_CFG": 0.01}, costs={"NVFP4_DEFAULT_CFG": 0.25,
                                                                                 "FP8_DEFAULT_CFG": 0.5})})
        scores = {t: v * (0.97 + 0.01 * i) if TASKS[t][1] else v / (0.97 + 0.01 * i) for t, v in BASE.items()}
        started = t0 + 10 * i
        write_result(layout.sweep(str(budget)) / "scores.json", samples.ptq_scores(
            name, task_scores(scores), effective_bpe=budget + 0.2, auto_quantize=searched,
            started_at=started, finished_at=started + 9.0))
        points.append(SweepPoint(name=name, kind="sweep", budget=budget, searched_effective_bits=budget - 0.1,
                                 effective_bpe=budget + 0.2, median_recovery=0.97 + 0.01 * i,
                                 median_recovery_ci=(0.96 + 0.01 * i, 0.98 + 0.01 * i), kl_divergence=0.02 - 0.005 * i,
                                 layers_by_format={"NVFP4_DEFAULT_CFG": 1}))
    sweep = BPESweep(recipe=params.sweep.recipe, points=points, fixed=[],
                     knee=Knee(name=points[0].name, budget=budgets[0], reason=f"{points[0].name}: more bits buy less."),
                     knee_epsilon=params.sweep.knee_epsilon, noise=0.01, monotone_within_noise=True, failed=[],
                     search_s=1.0, seconds={"total": 10.0 * len(budgets)})
    write_result(layout.bpe_sweep_metrics, sweep)
    touch(layout.bpe_sweep_metrics, t0 + 10 * len(budgets))
    layout.bpe_plot.parent.mkdir(parents=True, exist_ok=True)
    layout.bpe_plot.write_bytes(b"\x89PNG\r\n\x1a\n")
    return sweep


# -- one store, two pipeline runs logged and registered ---------------------------------------------


_LOGGED: list = []  # [(the session's tmp_path_factory, the store)]


def logged_store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two pipeline runs of the same out root, each logged and its export registered; logged once
    per test session, whichever test file asks first."""
    if _LOGGED and _LOGGED[0][0] is tmp_path_factory:
        return _LOGGED[0][1]
    root = tmp_path_factory.mktemp("tracking")
    model_dir = root / "base-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv("HF_TOKEN", HF_TOKEN)
        mp.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
        mp.setenv("MLFLOW_TRACKING_PASSWORD", MLFLOW_PASSWORD)  # sqlite ignores it; it must reach no output
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
    store = {"root": root, "uri": uri, "params": params, "runs": runs, "client": MlflowClient(uri, uri)}
    _LOGGED[:] = [(tmp_path_factory, store)]
    return store


def children(client, parent_id):
    """The child runs of a parent run, by run name."""
    parent = client.get_run(parent_id)
    found = client.search_runs([parent.info.experiment_id],
                               filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    return {r.info.run_name: r for r in found}


def markdown_tables(markdown: str) -> list[list[list[str]]]:
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
