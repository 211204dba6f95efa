"""What each stage's child run holds, read from the files the stage wrote (nothing logged here).

One `ChildRun` per stage and recipe whose files exist: `calibration`, `baseline`, `ptq-<recipe>`,
`selection`, `qad`, `final_eval`, `export`; each spans its stage process (`stage_span`), holds
its result file and its log as artifacts, and ends FAILED with the tag `error` when it failed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qad_pipeline.artifacts import read_json
from qad_pipeline.config import Params
from qad_pipeline.layout import Layout
from qad_pipeline.tracking.datasets import manifest_datasets
from qad_pipeline.tracking.metrics import (
    ci_metrics,
    number,
    numeric_leaves,
    pick,
    task_metrics,
)
from qad_pipeline.tracking.redaction import redact_text
from qad_pipeline.tracking.store import ERROR

if TYPE_CHECKING:
    from mlflow.data.dataset import Dataset

USAGE_SLACK_S = 5.0  # a stage's output may be written up to this long after its usage file says it ended
MAX_LOG_BYTES = 256 * 1024  # a stage log is logged from its last 256 KiB
REASON_FILE = "selection_reason.txt"
SHORT_REASON = 250  # characters of the reason in a tag; the full text is the artifact REASON_FILE


@dataclass
class ChildRun:
    """What one child run will hold, read from a stage's files (nothing logged yet)."""

    name: str
    stage: str
    start_ms: int
    end_ms: int
    status: str = "FINISHED"
    recipe: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # what to compare runs on (recipe settings)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, Any] = field(default_factory=dict)
    dicts: dict[str, Any] = field(default_factory=dict)  # artifact file -> JSON data
    texts: dict[str, str] = field(default_factory=dict)  # artifact file -> text
    steps: list[tuple[str, float, int, int]] = field(default_factory=list)  # key, value, ms, step
    datasets: list[tuple[Dataset, str]] = field(default_factory=list)  # dataset, context


# -- the stage process: its span and its log -----------------------------------------------------


def _mtime_ms(path: Path) -> int:
    return int(path.stat().st_mtime * 1000)


def stage_span(layout: Layout, name: str, output: Path) -> tuple[int, int]:
    """(start, end) in epoch ms of the stage process that wrote `output`.

    From `artifacts/logs/<name>.usage.json` (written by the flow around the stage process:
    `started_at`/`finished_at`, or only `seconds` in files from before those were recorded, then
    ending at the usage file's time) when `output` was written while that process ran; otherwise
    (e.g. `dvc repro` ran the stage without a usage file, or later than it) a zero-length span at
    the output's modification time.
    """
    written = output.stat().st_mtime
    path = layout.logs / f"{name}.usage.json"
    if path.is_file():
        try:
            usage = read_json(path)
        except (OSError, ValueError):
            usage = {}
        end = number(usage.get("finished_at"))
        end = path.stat().st_mtime if end is None else end
        start = number(usage.get("started_at"))
        seconds = number(usage.get("seconds"))
        start = end - seconds if start is None and seconds is not None else start
        if start is not None and start - USAGE_SLACK_S <= written <= end + USAGE_SLACK_S:
            return int(1000 * start), int(1000 * max(end, written))
    return int(1000 * written), int(1000 * written)


def _stage_log(layout: Layout, name: str) -> dict[str, str]:
    """The stage's own log (artifacts/logs/<name>.log), its last MAX_LOG_BYTES, secrets scrubbed."""
    path = layout.logs / f"{name}.log"
    if not path.is_file():
        return {}
    with path.open("rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - MAX_LOG_BYTES))
        text = fh.read().decode("utf-8", errors="replace")
    return {f"logs/{name}.log": redact_text(text)}


def short_reason(reason: str) -> str:
    """The reason's first sentence, at most SHORT_REASON characters, pointing at the full text."""
    text = " ".join(reason.split())
    first = text.split(". ", 1)[0].rstrip(".") + "."
    if len(first) > SHORT_REASON:
        first = first[:SHORT_REASON].rsplit(" ", 1)[0] + " …"
    return first if first == text else f"{first} (full text: {REASON_FILE})"


# -- the readers: one per stage, filling the run from the stage's result file --------------------


def _calibration(child: ChildRun, m: dict, params: Params) -> None:
    child.metrics = {
        **numeric_leaves({k: v for k, v in m.items() if k in ("documents", "seed")}),
        **numeric_leaves(m.get("calibration") or {}, "calibration."),
        **numeric_leaves(m.get("eval") or {}, "eval."),
        "calibration.documents": float(len(m.get("calibration_documents") or [])),
        "eval.documents": float(len(m.get("eval_documents") or [])),
    }
    child.tags = {
        "source": m.get("source"),
        "calibration.fingerprint": (m.get("calibration") or {}).get("fingerprint"),
        "eval.fingerprint": (m.get("eval") or {}).get("fingerprint"),
    }
    child.datasets = manifest_datasets(m, params)


def _baseline(child: ChildRun, m: dict, params: Params) -> None:
    child.status = "FINISHED" if m.get("status", "ok") == "ok" else "FAILED"
    child.metrics = {**task_metrics(m.get("tasks") or {}), **pick(m, "effective_bpe", "size_bytes")}
    child.tags = {f"base_model.{k}": v for k, v in (m.get("model") or {}).items()}


def _selection(child: ChildRun, s: dict, params: Params) -> None:
    table = s.get("table") or []
    chosen = next((r for r in table if r.get("name") == s.get("selected")), None)
    child.metrics = {
        "recipes.ok": float(sum(r.get("status") == "ok" for r in table)),
        "recipes.alias": float(sum(r.get("status") == "alias" for r in table)),
        "recipes.failed": float(sum(r.get("status") not in ("ok", "alias") for r in table)),
        **({} if chosen is None else pick(chosen, "median_recovery", "effective_bpe", "kl_divergence")),
        **({} if chosen is None else ci_metrics(chosen.get("median_recovery_ci"), "median_recovery")),
        **pick(s, "could_compress_further"),
    }
    reason = str(s.get("reason") or "")
    child.tags = {"selected": s.get("selected") or "none", "runner_up": s.get("runner_up"), "policy": s.get("policy"),
                  "band": s.get("band"), "reason": short_reason(reason)}
    child.texts = {REASON_FILE: reason, **child.texts}


def _qad(child: ChildRun, q: dict, params: Params) -> None:
    if child.start_ms == child.end_ms:  # no usage file: loss.json says how long it trained
        child.start_ms = int(child.end_ms - 1000 * (number(q.get("seconds")) or 0.0))
    start, end = child.start_ms, child.end_ms
    losses = [p for p in q.get("losses") or [] if number(p.get("step")) is not None]
    last = max((int(p["step"]) for p in losses), default=1) or 1
    first = int(q.get("resumed_from") or 0)
    for point in losses:
        step = int(point["step"])
        # The file has no wall time per step: spread the steps this run trained over its duration.
        frac = (step - first) / max(1, last - first) if step > first else 0.0
        ms = int(start + frac * (end - start))
        for key in ("loss", "lr"):
            if number(point.get(key)) is not None:
                child.steps.append((key, float(point[key]), ms, step))
    child.metrics = pick(q, "steps", "resumed_from", "final_loss", "first_loss", "steps_per_second",
                          "tokens_per_step", "seconds")


def _final_eval(child: ChildRun, m: dict, params: Params) -> None:
    child.recipe = m.get("recipe")
    child.metrics = {**task_metrics(m.get("tasks") or {}),
                     **pick(m, "median_recovery", "ptq_median_recovery", "kl_divergence", "qad_beats_ptq"),
                     **ci_metrics(m.get("median_recovery_ci"), "median_recovery")}
    child.tags = {"qad_beats_ptq": m.get("qad_beats_ptq")}


def _export(child: ChildRun, e: dict, params: Params) -> None:
    passed = bool(e.get("passed"))
    child.status = "FINISHED" if passed else "FAILED"
    child.metrics = numeric_leaves({k: v for k, v in e.items() if k != "serving"})
    checks = e.get("checks") or {}
    child.tags = {f"check.{name}": "passed" if c.get("passed") else "FAILED" for name, c in checks.items()}
    child.tags.update({"path": e.get("path"), "vllm": (e.get("serving") or {}).get("vllm"),
                       "serving_check": (e.get("serving_check") or {}).get("level"),
                       "serving_check.summary": (e.get("serving_check") or {}).get("summary")})
    if not passed:
        failed = [f"{n}: {c.get('problems') or 'failed'}" for n, c in checks.items() if not c.get("passed")]
        child.tags[ERROR] = "export verification failed: " + "; ".join(failed)


# stage -> (the result file its run is read from and holds as an artifact, the reader that fills the run)
STAGE_READERS: dict[str, tuple[Callable[[Layout], Path], Callable[[ChildRun, dict, Params], None]]] = {
    "calibration": (lambda layout: layout.data / "manifest.json", _calibration),
    "baseline": (lambda layout: layout.baseline_metrics, _baseline),
    "selection": (lambda layout: layout.selection_metrics, _selection),
    "qad": (lambda layout: layout.qad / "loss.json", _qad),
    "final_eval": (lambda layout: layout.qad_metrics, _final_eval),
    "export": (lambda layout: layout.export_metrics, _export),
}


def result_file(layout: Layout, stage: str) -> Path:
    """The file a (non-PTQ) stage's run is read from: its manifest, metrics or loss file."""
    return STAGE_READERS[stage][0](layout)


def stage_child(layout: Layout, params: Params, stage: str) -> ChildRun | None:
    """The run of a (non-PTQ) stage: its result file and log, filled in by the stage's reader."""
    path, reader = result_file(layout, stage), STAGE_READERS[stage][1]
    if not path.is_file():
        return None
    data = read_json(path)
    child = ChildRun(stage, stage, *stage_span(layout, stage, path), dicts={path.name: data},
                     texts=_stage_log(layout, stage))
    reader(child, data, params)
    return child


def ptq_child(layout: Layout, params: Params, recipe: str, row: Mapping[str, Any]) -> ChildRun | None:
    """metrics/ptq/<recipe>.json (scores + recovery) or, before selection, the PTQ scores.json.

    `row` is the recipe's row of the selection table: its `settings` (weight scale method, Mamba
    format, KV format, bits) become the run's params, so MLflow's compare view has a recipe axis
    (without them: the recipe's name, KV format and bits as PTQ measured them).
    A recipe that is an alias of another (the same quantizer configuration on this model, not
    run) gets that one's metrics and the tag `alias_of`.
    """
    alias_of = row.get("alias_of") if row.get("status") == "alias" else None
    metrics_path, scores_path = layout.ptq_metrics(recipe), layout.ptq(recipe) / "scores.json"
    path = metrics_path if metrics_path.is_file() else scores_path if scores_path.is_file() else None
    m = read_json(path) if path is not None else {}
    if alias_of and m.get("status") != "ok" and layout.ptq_metrics(alias_of).is_file():
        m = {**read_json(layout.ptq_metrics(alias_of)), "status": "alias"}
        path = path or layout.ptq_metrics(alias_of)
    if path is None:
        return None
    end = int(1000 * m["finished_at"]) if number(m.get("finished_at")) is not None else _mtime_ms(path)
    start = int(1000 * m["started_at"]) if number(m.get("started_at")) is not None else end
    if alias_of:  # it did not run: a zero-length run at the time the selection found it out
        start = end = _mtime_ms(layout.selection_metrics) if layout.selection_metrics.is_file() else end
    name = f"ptq-{recipe}"
    ok = m.get("status") in ("ok", "alias")
    child = ChildRun(name, "ptq", start, end, "FINISHED" if ok else "FAILED", recipe=recipe)
    weight = m.get("weight_error") if isinstance(m.get("weight_error"), Mapping) else {}
    child.metrics = {
        **task_metrics(m.get("tasks") or {}),
        **pick(m, "median_recovery", "effective_bpe", "size_bytes", "bf16_size_bytes", "kl_divergence",
                "peak_rss_mb"),
        **ci_metrics(m.get("median_recovery_ci") or row.get("median_recovery_ci"), "median_recovery"),
        **numeric_leaves({"weight_error.median": weight.get("median")}),
        **numeric_leaves(m.get("timing_s") or {}, "timing_s."),
        **numeric_leaves(m.get("elements_by_format") or {}, "elements_by_format."),
    }
    measured = {"kv_cache": m.get("kv_cache"),  # what PTQ measured, where selection recorded no settings
                "effective_bpe": None if number(m.get("effective_bpe")) is None else round(m["effective_bpe"], 3)}
    settings = {"recipe": recipe, **measured, **(row.get("settings") or {})}
    child.params = {k: v for k, v in settings.items() if v is not None}
    child.tags = {"status": row.get("status") or m.get("status"), "kv_cache": m.get("kv_cache"),
                  "alias_of": alias_of}
    if weight.get("worst"):
        child.tags["weight_error.worst"] = ", ".join(
            f"{w.get('layer')}: {w.get('error'):.4g}" for w in weight["worst"] if number(w.get("error")) is not None)
    if not ok:
        child.tags[ERROR] = m.get("error") or row.get("error") or "failed (no error recorded)"
    child.dicts = {f"{recipe}.json": m}
    recipe_file = params.recipe_path(recipe)
    if recipe_file.is_file():
        child.texts[f"recipe/{recipe_file.name}"] = redact_text(recipe_file.read_text(errors="replace"))
    child.texts.update(_stage_log(layout, name))
    return child


def read_children(layout: Layout, params: Params) -> list[ChildRun]:
    """One ChildRun per stage (and recipe) whose files exist, in pipeline order."""
    table = read_json(layout.selection_metrics).get("table") or [] if layout.selection_metrics.is_file() else []
    rows = {r.get("name"): r for r in table}
    children = [stage_child(layout, params, "calibration"), stage_child(layout, params, "baseline")]
    children += [ptq_child(layout, params, r, rows.get(r) or {}) for r in params.ptq.recipes]
    children += [stage_child(layout, params, s) for s in ("selection", "qad", "final_eval", "export")]
    return [c for c in children if c is not None]
