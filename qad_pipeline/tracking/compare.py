"""Reading pipeline runs back from MLflow: a run's page, the latest pipeline run of a base model,
and the recipe comparison table (`qad-pipeline compare`)."""

from __future__ import annotations

import json
import urllib.parse
from typing import TYPE_CHECKING, Any

from qad_pipeline.core.config import ConfigError
from qad_pipeline.reporting.report import aligned
from qad_pipeline.core.redaction import redact_text
from qad_pipeline.core.stages import BASELINE, EXPORT, FINAL_EVAL, QAD, RECIPES
from qad_pipeline.tracking.store import (ERROR, EXPERIMENT_PREFIX, KIND, LOGGED_AT, PARENT, RECIPE, STAGE, client_for,
                                         experiment_name)

if TYPE_CHECKING:  # mlflow is imported where it is used: importing it takes seconds
    from mlflow import MlflowClient


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI: on the tracking server itself for an http(s) URI, else on
    `mlflow ui --backend-store-uri <uri>` at its default address, http://127.0.0.1:5000."""
    base = uri.rstrip("/") if urllib.parse.urlparse(uri).scheme in ("http", "https") else "http://127.0.0.1:5000"
    return f"{redact_text(base)}/#/experiments/{experiment_id}/runs/{run_id}"


def child_runs(client: MlflowClient, parent: Any) -> list[Any]:
    """The child runs (stages and recipes) of a pipeline run."""
    return client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{PARENT}` = '{parent.info.run_id}'", max_results=5000
    )


def find_experiment(client: MlflowClient, experiment: str) -> Any:
    """An experiment by its name, or by the base model path it was named after."""
    for name in (experiment, experiment_name(experiment)):
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp
    known = [e.name for e in client.search_experiments(filter_string=f"name LIKE '{EXPERIMENT_PREFIX}%'")]
    raise ConfigError(f"no MLflow experiment {experiment!r} or {experiment_name(experiment)!r}; known: {known}")


def latest_pipeline_run(client: MlflowClient, experiment_id: str) -> Any:
    """The parent run that started last (ties: the one logged last)."""
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`{KIND}` = 'pipeline'",
        order_by=["attributes.start_time DESC", f"tags.`{LOGGED_AT}` DESC"], max_results=1,
    )
    if not runs:
        raise ConfigError(f"experiment {experiment_id} holds no qad-pipeline run")
    return runs[0]


def _status(run: Any) -> str:
    return {"FINISHED": "ok", "FAILED": "failed"}.get(run.info.status, run.info.status.lower())


def compare_table(uri: str, experiment: str, run_id: str | None = None) -> list[dict]:
    """Rows read back from MLflow for one pipeline run (the latest, or `run_id`, parent or child).

    One row each for bf16, every recipe (in the configured order; the chosen one has
    `selected: True`) and qad: per-task recovery (`recovery.<task>`), `median_recovery` and its
    interval (`median_recovery_ci_low/high`), `kl_divergence`, `effective_bpe`, `size_bytes`,
    `status` ("ok", "failed", "alias of <recipe>", ...), `error`, `run_id`.
    """
    client = client_for(uri)
    if run_id is None:
        parent = latest_pipeline_run(client, find_experiment(client, experiment).experiment_id)
    else:
        parent = client.get_run(run_id)
        if PARENT in parent.data.tags:
            parent = client.get_run(parent.data.tags[PARENT])
    children = child_runs(client, parent)
    by_stage: dict[str, list] = {}
    for child in children:
        by_stage.setdefault(child.data.tags.get(STAGE, ""), []).append(child)
    selected = parent.data.tags.get("qad.selected")
    try:
        order = json.loads(parent.data.params.get("ptq.recipes", "[]"))
    except json.JSONDecodeError:
        order = []
    tasks: list[str] = []
    for child in children:
        tasks += [k[len("score."):] for k in child.data.metrics if k.startswith("score.")
                  and k[len("score."):] not in tasks]

    def row(name: str, run: Any, **extra) -> dict:
        m = run.data.metrics
        alias_of = run.data.tags.get("alias_of")
        out = {"name": name, "status": f"alias of {alias_of}" if alias_of else _status(run), "selected": False,
               **{f"recovery.{t}": m.get(f"recovery.{t}") for t in tasks},
               "median_recovery": m.get("median_recovery"),
               "median_recovery_ci_low": m.get("median_recovery_ci_low"),
               "median_recovery_ci_high": m.get("median_recovery_ci_high"),
               "kl_divergence": m.get("kl_divergence"), "effective_bpe": m.get("effective_bpe"),
               "size_bytes": m.get("size_bytes"), "run_id": run.info.run_id}
        if ERROR in run.data.tags:
            out["error"] = run.data.tags[ERROR]
        return {**out, **extra}

    rows = []
    for base in by_stage.get(BASELINE.name, []):
        rows.append(row("bf16", base, **{f"recovery.{t}": 1.0 for t in tasks if f"score.{t}" in base.data.metrics},
                        median_recovery=1.0))
    recipes = sorted(by_stage.get(RECIPES.name, []), key=lambda r: (
        order.index(r.data.tags.get(RECIPE)) if r.data.tags.get(RECIPE) in order else len(order),
        r.data.tags.get(RECIPE, "")))
    for run in recipes:
        recipe = run.data.tags.get(RECIPE, run.info.run_name)
        rows.append(row(recipe, run, selected=recipe == selected))
    for run in by_stage.get(FINAL_EVAL.name, []):
        export = (by_stage.get(EXPORT.name) or [None])[0]
        chosen = next((r for r in recipes if r.data.tags.get(RECIPE) == selected), None)
        size_from = export if export is not None else chosen
        extra = {} if size_from is None else {"effective_bpe": size_from.data.metrics.get("effective_bpe"),
                                              "size_bytes": size_from.data.metrics.get("size_bytes")}
        rows.append(row(QAD.name, run, **extra))
    return rows


def compare_text(rows: list[dict]) -> str:
    """The compare table as aligned terminal text; `*` marks the selected recipe."""
    if not rows:
        return "(no runs)"
    recovery_cols = [k for k in rows[0] if k.startswith("recovery.")]
    for r in rows[1:]:
        recovery_cols += [k for k in r if k.startswith("recovery.") and k not in recovery_cols]
    header = ["name", "status", *[c[len("recovery."):] for c in recovery_cols], "median", "interval", "KL",
              "bits/elem", "size MB"]

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    cells = [[("* " if r.get("selected") else "  ") + str(r["name"]), str(r.get("status", "")),
              *[num(r.get(c), ".4f") for c in recovery_cols], num(r.get("median_recovery"), ".4f"),
              "-" if r.get("median_recovery_ci_low") is None else
              f"{r['median_recovery_ci_low']:.4f}-{r['median_recovery_ci_high']:.4f}",
              num(r.get("kl_divergence"), ".4f"), num(r.get("effective_bpe"), ".3f"),
              num(None if r.get("size_bytes") is None else r["size_bytes"] / 1e6, ".3f")] for r in rows]
    header[0] = "  " + header[0]
    out = aligned(header, cells)
    out += [f"{r['name']} FAILED: {r['error'][:300]}" for r in rows if r.get("error")]
    if any(r.get("selected") for r in rows):
        out.append("* selected recipe (recovery: quantized vs BF16 score; median over tasks)")
    return "\n".join(out)
