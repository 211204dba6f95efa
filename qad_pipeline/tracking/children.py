"""What each stage's child run holds, read from the files the stage wrote (nothing logged here).

One `ChildRun` per stage and recipe whose files exist: `calibration`, `baseline`, `ptq-<recipe>`,
`race` (racing the recipes), `selection`, `qad`, `final_eval`, `export`, and for a run that swept first `sweep-<budget>` and
`bpe_sweep`; each spans its stage process (`stage_span`), holds its result file and its log as
artifacts, and ends FAILED with the tag `error` when it failed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import dump_result, read_result
from qad_pipeline.results.data import CalibrationManifest
from qad_pipeline.results.export_metrics import ExportMetrics
from qad_pipeline.results.qad_metrics import QADMetrics, QADTraining
from qad_pipeline.results.race_metrics import RaceResult
from qad_pipeline.results.scores import BaselineMetrics, PTQResult, PTQScores
from qad_pipeline.results.selection_metrics import RecipeFailed, RecipeResult, RecipeRow, SelectionResult
from qad_pipeline.results.served import ServedEval
from qad_pipeline.results.sweep_metrics import BPESweep
from qad_pipeline.core.stage_types import load_reference
from qad_pipeline.core.stages import BPE_SWEEP, RACING, RECIPES, STAGES, SWEEP_POINTS, with_sweep
from qad_pipeline.tracking.datasets import manifest_datasets
from qad_pipeline.tracking.metrics import ci_metrics, number, numeric_leaves, pick, task_metrics
from qad_pipeline.core.redaction import redact_text
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


def calibration_run(child: ChildRun, m: CalibrationManifest, params: Params) -> None:
    child.metrics = {
        **numeric_leaves({"documents": m.documents, "seed": m.seed}),
        **numeric_leaves(dump_result(m.calibration), "calibration."),
        **numeric_leaves(dump_result(m.eval), "eval."),
        "calibration.documents": float(len(m.calibration_documents)),
        "eval.documents": float(len(m.eval_documents)),
    }
    child.tags = {
        "source": m.source,
        "calibration.fingerprint": m.calibration.fingerprint,
        "eval.fingerprint": m.eval.fingerprint,
    }
    child.datasets = manifest_datasets(m, params)


def baseline_run(child: ChildRun, m: BaselineMetrics, params: Params) -> None:
    child.metrics = {**task_metrics(m.tasks), **pick(m, "effective_bpe", "size_bytes")}
    child.tags = {f"base_model.{k}": v for k, v in dump_result(m.model).items()}


def selection_run(child: ChildRun, s: SelectionResult, params: Params) -> None:
    chosen = next((r for r in s.table if r.name == s.selected), None)
    child.metrics = {
        "recipes.ok": float(sum(r.status == "ok" for r in s.table)),
        "recipes.alias": float(sum(r.status == "alias" for r in s.table)),
        "recipes.failed": float(sum(r.status not in ("ok", "alias") for r in s.table)),
        **({} if chosen is None else pick(chosen, "median_recovery", "effective_bpe", "kl_divergence")),
        **({} if chosen is None else ci_metrics(chosen.median_recovery_ci, "median_recovery")),
        **pick(s, "could_compress_further"),
    }
    child.tags = {"selected": s.selected or "none", "runner_up": s.runner_up, "policy": s.policy,
                  "band": list(s.band), "reason": short_reason(s.reason)}
    child.texts = {REASON_FILE: s.reason, **child.texts}


def race_run(child: ChildRun, r: RaceResult, params: Params) -> None:
    """Racing the recipes: what it spent against a full evaluation, and who stopped where and why."""
    child.metrics = {**pick(r, "items_spent", "items_full", "saved", "confidence"),
                     "candidates.stopped": float(sum(c.stopped is not None for c in r.candidates))}
    child.tags = {"fractions": r.fractions, **{f"stopped.{c.name}": f"round {c.stopped.round}: {c.stopped.why}"
                                               for c in r.candidates if c.stopped}}


def qad_run(child: ChildRun, q: QADTraining, params: Params) -> None:
    if child.start_ms == child.end_ms:  # no usage file: loss.json says how long it trained
        child.start_ms = int(child.end_ms - 1000 * q.seconds)
    start, end = child.start_ms, child.end_ms
    last = max((p.step for p in q.losses), default=1) or 1
    first = q.resumed_from
    for point in q.losses:
        # The file has no wall time per step: spread the steps this run trained over its duration.
        frac = (point.step - first) / max(1, last - first) if point.step > first else 0.0
        ms = int(start + frac * (end - start))
        child.steps += [("loss", point.loss, ms, point.step), ("lr", point.lr, ms, point.step)]
    child.metrics = pick(q, "steps", "resumed_from", "final_loss", "first_loss", "steps_per_second",
                          "tokens_per_step", "seconds")


def final_eval_run(child: ChildRun, m: QADMetrics, params: Params) -> None:
    child.recipe = m.recipe
    child.metrics = {**task_metrics(m.tasks),
                     **pick(m, "median_recovery", "ptq_median_recovery", "kl_divergence", "qad_beats_ptq"),
                     **ci_metrics(m.median_recovery_ci, "median_recovery")}
    child.tags = {"qad_beats_ptq": m.qad_beats_ptq}


def export_run(child: ChildRun, e: ExportMetrics, params: Params) -> None:
    child.status = "FINISHED" if e.passed else "FAILED"
    child.metrics = numeric_leaves(e.model_dump(mode="json", exclude={"serving"}))
    child.tags = {f"check.{name}": "passed" if c.get("passed") else "FAILED" for name, c in e.checks.items()}
    child.tags.update({"path": e.path, "source": e.source, "vllm": e.serving.vllm, "serving_check": e.serving_check.level,
                       "serving_check.summary": e.serving_check.summary})
    if not e.passed:
        failed = [f"{n}: {c.get('problems') or 'failed'}" for n, c in e.checks.items() if not c.get("passed")]
        child.tags[ERROR] = "export verification failed: " + "; ".join(failed)


def served_eval_run(child: ChildRun, m: ServedEval, params: Params) -> None:
    child.tags = {"backend": m.backend, "ran": m.ran, **({"why_not": m.why_not} if m.why_not else {})}
    if not m.ran:
        return
    child.metrics = {**task_metrics(m.tasks), **pick(m, "median_recovery"),
                     **ci_metrics(m.median_recovery_ci, "median_recovery")}
    if m.in_memory is not None:
        child.metrics["in_memory_median_recovery"] = m.in_memory.median_recovery
        child.tags["intervals_overlap"] = m.agree


def result_file(layout: Layout, stage: str) -> Path:
    """The file a (non-PTQ) stage's run is read from: its manifest, metrics or loss file (`Stage.result`)."""
    return layout.root / STAGES[stage].result


def stage_child(layout: Layout, params: Params, stage: str) -> ChildRun | None:
    """The run of a (non-PTQ) stage: its result file and log, filled in by the stage's reader.

    None while the file is not there (the stage has not run, or failed: a half-finished run is
    logged with the stages it has); a file that is there must match its model."""
    declared = STAGES[stage]
    path = result_file(layout, stage)
    result = read_result(path, load_reference(declared.schema), missing_ok=True)
    if result is None:
        return None
    child = ChildRun(stage, stage, *stage_span(layout, stage, path), dicts={path.name: dump_result(result)},
                     texts=_stage_log(layout, stage))
    load_reference(declared.mlflow)(child, result, params)
    return child


def _ptq_result(layout: Layout, recipe: str) -> tuple[Path | None, Any]:
    """metrics/ptq/<recipe>.json (scores + recovery) or, before selection, the PTQ scores.json;
    (None, None) when neither is there (the recipe's PTQ has not run, or died)."""
    for path, kind in ((layout.ptq_metrics(recipe), RecipeResult), (layout.ptq(recipe) / "scores.json", PTQResult)):
        if path.is_file():
            return path, read_result(path, kind)
    return None, None


def _figures(m: PTQScores) -> dict[str, float]:
    """A recipe's measured figures as metrics (and selection's recovery, in a RecipeMetrics)."""
    return {
        **task_metrics(m.tasks),
        **pick(m, "median_recovery", "effective_bpe", "size_bytes", "bf16_size_bytes", "kl_divergence",
                "peak_rss_mb"),
        **numeric_leaves({"weight_error.median": m.weight_error.median}),
        **numeric_leaves(m.timing_s, "timing_s."),
        **numeric_leaves(m.elements_by_format, "elements_by_format."),
    }


def ptq_child(layout: Layout, params: Params, recipe: str, row: RecipeRow | None) -> ChildRun | None:
    """The run of one recipe, from `_ptq_result`.

    `row` is the recipe's row of the selection table: its `settings` (weight scale method, Mamba
    format, KV format, bits) become the run's params, so MLflow's compare view has a recipe axis
    (without them: the recipe's name, KV format and bits as PTQ measured them).
    A recipe that is an alias of another (the same quantizer configuration on this model, not
    run) gets that one's metrics and the tag `alias_of`.
    """
    alias_of = row.alias_of if row is not None and row.status == "alias" else None
    path, m = _ptq_result(layout, recipe)
    artifact = None if m is None else dump_result(m)
    substituted = bool(alias_of and (m is None or m.status != "ok") and layout.ptq_metrics(alias_of).is_file())
    if substituted:
        m = read_result(layout.ptq_metrics(alias_of), RecipeResult)
        artifact = {**dump_result(m), "status": "alias"}
        path = path or layout.ptq_metrics(alias_of)
    if path is None:
        return None
    span = pick(m, "started_at", "finished_at")  # a recipe that ran, or an alias PTQ found out
    end = int(1000 * span["finished_at"]) if "finished_at" in span else _mtime_ms(path)
    start = int(1000 * span["started_at"]) if "started_at" in span else end
    if alias_of:  # it did not run: a zero-length run at the time the selection found it out
        start = end = _mtime_ms(layout.selection_metrics) if layout.selection_metrics.is_file() else end
    name = RECIPES.run_name(recipe)
    ok = substituted or m.status in ("ok", "alias")
    child = ChildRun(name, RECIPES.name, start, end, "FINISHED" if ok else "FAILED", recipe=recipe)
    ran = m if isinstance(m, PTQScores) else None  # a recipe that ran (RecipeMetrics: with its recovery)
    ci = getattr(m, "median_recovery_ci", None) or (row.median_recovery_ci if row is not None else None)
    child.metrics = {**(_figures(ran) if ran is not None else {}), **ci_metrics(ci, "median_recovery")}
    # what PTQ measured, where selection recorded no settings
    measured = {} if ran is None else {"kv_cache": ran.kv_cache, "effective_bpe": round(ran.effective_bpe, 3)}
    settings = {"recipe": recipe, **measured, **(row.settings if row is not None else {})}
    child.params = {k: v for k, v in settings.items() if v is not None}
    child.tags = {"status": (row.status if row is not None else None) or m.status,
                  "kv_cache": measured.get("kv_cache"), "alias_of": alias_of}
    if ran is not None and ran.weight_error.worst:
        child.tags["weight_error.worst"] = ", ".join(f"{w.layer}: {w.error:.4g}" for w in ran.weight_error.worst)
    if not ok:
        own = m.error if isinstance(m, RecipeFailed) else None
        child.tags[ERROR] = own or (row.error if row is not None else None) or "failed (no error recorded)"
    child.dicts = {f"{recipe}.json": artifact}
    recipe_file = params.recipe_path(recipe)
    if recipe_file.is_file():
        child.texts[f"recipe/{recipe_file.name}"] = redact_text(recipe_file.read_text(errors="replace"))
    child.texts.update(_stage_log(layout, name))
    return child


# -- the BPE sweep's runs: one per budget (`sweep-<budget>`) and the curve's (`bpe_sweep`) -----------


def sweep_children(layout: Layout, params: Params, sweep: BPESweep) -> list[ChildRun]:
    """One child run per sweep point that ran."""
    children = []
    for point in sweep.points:
        budget = str(point.budget)
        folder = layout.sweep(budget)
        scores = read_result(folder / "scores.json", PTQScores)
        start_ms, end_ms = stage_span(layout, SWEEP_POINTS.run_name(budget), folder / "scores.json")
        searched = scores.auto_quantize
        children.append(ChildRun(
            name=SWEEP_POINTS.run_name(budget), stage=SWEEP_POINTS.name, start_ms=start_ms, end_ms=end_ms, recipe=point.name,
            params={"budget": point.budget, "sweep.recipe": params.sweep.recipe, "method": searched.method,
                    "formats": ",".join(searched.formats), "kv_cache": searched.kv_cache},
            metrics={"budget": point.budget, "searched_effective_bits": point.searched_effective_bits,
                     "effective_bpe": point.effective_bpe, "median_recovery": point.median_recovery,
                     "median_recovery_ci_low": point.median_recovery_ci[0],
                     "median_recovery_ci_high": point.median_recovery_ci[1], "kl_divergence": point.kl_divergence,
                     "size_bytes": scores.size_bytes,
                     **{f"layers.{fmt}": n for fmt, n in point.layers_by_format.items()}},
            tags={"knee": str(point.name == sweep.knee.name).lower()},
            dicts={"auto_quantize.json": dump_result(searched)},
        ))
    return children


def knee_metrics(sweep: BPESweep) -> dict[str, float]:
    """The knee's figures and the eval's noise, as metrics."""
    knee = next((p for p in sweep.points if p.name == sweep.knee.name), None)
    metrics = {"noise": sweep.noise}
    if knee is not None:
        metrics.update({"knee.budget": knee.budget, "knee.searched_effective_bits": knee.searched_effective_bits,
                        "knee.effective_bpe": knee.effective_bpe, "knee.median_recovery": knee.median_recovery,
                        "knee.kl_divergence": knee.kl_divergence})
    return metrics


def bpe_sweep_child(layout: Layout, sweep: BPESweep) -> ChildRun:
    """The curve's stage run (`bpe_sweep`): the knee and its reason, `bpe_sweep.json`."""
    start_ms, end_ms = stage_span(layout, BPE_SWEEP.name, layout.bpe_sweep_metrics)
    return ChildRun(name=BPE_SWEEP.name, stage=BPE_SWEEP.name, start_ms=start_ms, end_ms=end_ms,
                    params={"knee_epsilon": sweep.knee_epsilon}, metrics=knee_metrics(sweep),
                    tags={"knee": sweep.knee.name or "none", "knee.reason": sweep.knee.reason[:5000]},
                    dicts={"bpe_sweep.json": dump_result(sweep)})


def read_children(layout: Layout, params: Params) -> list[ChildRun]:
    """One ChildRun per stage (and recipe) whose files exist, in pipeline order."""
    selection = read_result(layout.selection_metrics, SelectionResult, missing_ok=True)
    rows = {r.name: r for r in selection.table} if selection is not None else {}
    children: list[ChildRun | None] = []
    for declared in STAGES.values():  # a stage with a reader (`Stage.mlflow`), the recipes, the sweep's
        if declared.gated_by(RACING) and not declared.runs(params):  # an earlier run's race.json is not this run's
            continue
        if declared.mlflow:
            children.append(stage_child(layout, params, declared.name))
        elif declared is RECIPES:
            children += [ptq_child(layout, params, r, rows.get(r)) for r in params.ptq.recipes]
        elif declared is BPE_SWEEP and with_sweep(params):  # the run swept: a run per budget, the curve's
            sweep = read_result(layout.bpe_sweep_metrics, BPESweep, missing_ok=True)
            children += [*sweep_children(layout, params, sweep), bpe_sweep_child(layout, sweep)] if sweep else []
    return [c for c in children if c is not None]
