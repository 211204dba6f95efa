"""Recipe selection: `qad-pipeline stage selection` (run by the flow and by `dvc repro`).

The policy of the documents, as a pure function (`select_recipe`):

* `qad` (QAD follows): take the most compressed recipe (lowest effective bits per element)
  whose median recovery lies in the target band, default 95-99 %. A small measurable drop shows
  the compression was pushed far enough; QAD then closes the gap. If no recipe is in the band but
  some are above it, take the most compressed of those (compression could go further; QAD has
  little to win). If every recipe is below the band, none qualifies.
* `ptq_final` (PTQ is the last step): the most compressed recipe with median recovery >= 99 %.

Ties on bits per element go to the smaller KV cache, then to higher recovery, then to the name.
When nothing qualifies `selected` is null and the reason says why; later stages stop there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from qad_pipeline.artifacts import read_json, write_json
from qad_pipeline.config import Params, SelectionParams
from qad_pipeline.layout import Layout
from qad_pipeline.recovery import median_recovery, recoveries

KV_BITS = {"nvfp4": 4.5, "fp8": 8, "bf16": 16, "fp16": 16, "none": 16}


@dataclass(frozen=True)
class RecipeRow:
    name: str
    status: str  # "ok" or "failed"
    median_recovery: float | None = None
    effective_bpe: float | None = None
    kv_cache: str = "none"
    error: str | None = None


@dataclass(frozen=True)
class Selection:
    selected: str | None
    policy: str
    band: tuple[float, float]
    reason: str
    table: list[dict]


def _compression_order(row: RecipeRow) -> tuple:
    return (row.effective_bpe, KV_BITS.get(row.kv_cache, 16), -row.median_recovery, row.name)


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def select_recipe(rows: list[RecipeRow], params: SelectionParams) -> Selection:
    """Choose a recipe from the PTQ results by the configured policy, and say why."""
    low, high = params.band
    ok = [r for r in rows if r.status == "ok"]
    failed = [r.name for r in rows if r.status != "ok"]
    note = f" Failed recipes left out: {', '.join(failed)}." if failed else ""
    table = [asdict(r) for r in sorted(rows, key=lambda r: (r.status != "ok", r.name))]

    def pick(candidates: list[RecipeRow], why: str) -> Selection:
        best = min(candidates, key=_compression_order)
        reason = (
            f"{best.name}: {why}; it is the most compressed of them at {best.effective_bpe:.3f} "
            f"bits per element (KV cache {best.kv_cache}), median recovery {_pct(best.median_recovery)}."
        )
        return Selection(best.name, params.policy, params.band, reason + note, table)

    def none(why: str) -> Selection:
        return Selection(None, params.policy, params.band, why + note, table)

    if not ok:
        return none("No recipe qualifies: every recipe failed.")
    if params.policy == "ptq_final":
        floor = params.ptq_final_min
        above = [r for r in ok if r.median_recovery >= floor]
        if above:
            return pick(above, f"{len(above)} recipe(s) reach the PTQ-final target of {_pct(floor)}")
        best = max(ok, key=lambda r: r.median_recovery)
        return none(
            f"No recipe qualifies: none reaches the PTQ-final target of {_pct(floor)} "
            f"(best: {best.name} at {_pct(best.median_recovery)}). Run QAD (policy qad) or use a "
            "less aggressive recipe."
        )
    in_band = [r for r in ok if low <= r.median_recovery <= high]
    if in_band:
        return pick(in_band, f"{len(in_band)} recipe(s) lie in the QAD target band {_pct(low)}-{_pct(high)}")
    above = [r for r in ok if r.median_recovery > high]
    if above:
        return pick(
            above,
            f"no recipe lies in the band {_pct(low)}-{_pct(high)} and {len(above)} lie above it "
            "(compression could be pushed further)",
        )
    best = max(ok, key=lambda r: r.median_recovery)
    return none(
        f"No recipe qualifies: every recipe is below the QAD band's floor of {_pct(low)} "
        f"(best: {best.name} at {_pct(best.median_recovery)}); QAD is not started. Lower "
        "selection.band or add a less aggressive recipe."
    )


def recipe_metrics(name: str, scores_path: Path, baseline: dict) -> dict:
    """metrics/ptq/<name>.json: the PTQ stage's scores plus recovery versus the BF16 baseline."""
    if not scores_path.is_file():
        return {"recipe": name, "status": "failed", "error": f"no scores: {scores_path} (the PTQ run failed)"}
    scores = read_json(scores_path)
    if scores.get("status") != "ok":
        return {"recipe": name, "status": "failed", "error": scores.get("error")}
    per_task = recoveries(scores["tasks"], baseline["tasks"])
    for task, value in per_task.items():
        scores["tasks"][task]["recovery"] = value
    return {**scores, "median_recovery": median_recovery(per_task)}


def row(metrics: dict) -> RecipeRow:
    if metrics["status"] != "ok":
        return RecipeRow(metrics["recipe"], "failed", error=metrics.get("error"))
    return RecipeRow(
        metrics["recipe"], "ok", metrics["median_recovery"], metrics["effective_bpe"], metrics["kv_cache"]
    )


def run_selection(params: Params, layout: Layout) -> Selection:
    """Stage core: recovery per recipe (metrics/ptq/*.json), then the choice (metrics/selection.json)."""
    baseline = read_json(layout.baseline_metrics)
    rows = []
    for name in params.ptq.recipes:
        metrics = recipe_metrics(name, layout.ptq(name) / "scores.json", baseline)
        write_json(layout.ptq_metrics(name), metrics)
        rows.append(row(metrics))
    selection = select_recipe(rows, params.selection)
    write_json(layout.recovery_table, [
        {"recipe": r.name, "effective_bpe": r.effective_bpe, "median_recovery": r.median_recovery}
        for r in rows if r.status == "ok"
    ])
    write_json(layout.selection_metrics, asdict(selection))
    return selection
