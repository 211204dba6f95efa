"""Recipe selection: `qad-pipeline stage selection` (run by the flow and by `dvc repro`).

The policy of the documents, as a pure function (`select_recipe`):

* `qad` (QAD follows): among the recipes whose median recovery is at or above the band's lower
  end (default 95 %), take the most compressed (lowest effective bits per element, then the
  smaller KV cache). A small measurable drop shows the compression was pushed far enough; QAD
  then closes the gap. A pick above the band's upper end (99 %) is reported: compression could
  go further. If every recipe is below the floor, none qualifies.
* `ptq_final` (PTQ is the last step): the same with the floor at `ptq_final_min` (99 %).

Compression decides among eligible recipes, so a recipe with at least the bits and KV cache of
another and less recovery is never chosen; among equally compressed ones the higher recovery
wins. Each recovery carries a confidence interval (a seeded paired bootstrap over eval items,
`qad_pipeline.scoring.recovery`): a recovery difference inside the intervals is a tie, and the reason
says so when it names the runner-up and why it lost. Recipes that resolve to the same quantizers
on this model (`"alias"` rows) are shown with the recipe they repeat and are never candidates.
With `selection.sweep` set, the BPE sweep's knee (or all its points), named `<recipe>@<budget>`,
compete with the recipes under the same policy.
When nothing qualifies `selected` is null and the reason says why; later stages stop there.
With `race.enabled` (racing the recipes, tasks/race.py), each raced candidate is read from
`artifacts/race/<candidate>/` (its scores merged over the rounds it ran), the candidates the race
stopped are shown but never chosen, and the reason and `racing` say where each stopped, why, and
what racing spent against a full evaluation.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import ConfigError, Params, SelectionParams
from qad_pipeline.core.layout import Layout
from qad_pipeline.nvfp4.recipes import recipe_aliases
from qad_pipeline.scoring.racing import on_items, restrict
from qad_pipeline.scoring.recovery import score_recovery
from qad_pipeline.results.base import dump_result, read_result, write_result
from qad_pipeline.results.race_metrics import RaceResult
from qad_pipeline.results.scores import BaselineMetrics, PTQResult
from qad_pipeline.results.selection_metrics import (RecipeAlias, RecipeFailed, RecipeMetrics, RecipeResult, Racing, RecipeRow,
                                            RecoveryPoint, RecoveryTable, SelectionResult)
from qad_pipeline.results.sweep_metrics import BPESweep
from qad_pipeline.core.stages import with_sweep

KV_BITS = {"nvfp4": 4.5, "fp8": 8, "bf16": 16, "fp16": 16, "none": 16}


def compression(row: RecipeRow) -> tuple[float, float]:
    """(effective bits per element, KV-cache bits): lower is more compressed."""
    return (row.effective_bpe, KV_BITS.get(row.kv_cache, 16))


def dominated(row: RecipeRow, others: list[RecipeRow]) -> bool:
    """Another recipe is at least as compressed in both bits and KV cache, and recovers more."""
    return any(compression(o)[0] <= compression(row)[0] and compression(o)[1] <= compression(row)[1]
               and o.median_recovery > row.median_recovery for o in others if o.name != row.name)


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _with_ci(row: RecipeRow) -> str:
    if row.median_recovery_ci is None:
        return _pct(row.median_recovery)
    low, high = row.median_recovery_ci
    return f"{_pct(row.median_recovery)} [{100 * low:.2f}-{100 * high:.2f}]"


def _tied(a: RecipeRow, b: RecipeRow) -> bool:
    """The recoveries differ by less than the intervals say the eval can tell apart."""
    if a.median_recovery_ci is None or b.median_recovery_ci is None:
        return a.median_recovery == b.median_recovery
    return a.median_recovery_ci[0] <= b.median_recovery_ci[1] and b.median_recovery_ci[0] <= a.median_recovery_ci[1]


def _describe(row: RecipeRow) -> str:
    return (f"{row.name} ({row.effective_bpe:.3f} bits per element, KV cache {row.kv_cache}, "
            f"median recovery {_with_ci(row)})")


def _why_lost(best: RecipeRow, other: RecipeRow, floor: float) -> str:
    if other.median_recovery < floor:
        return f"below the floor of {_pct(floor)}"
    more = "more bits" if other.effective_bpe > best.effective_bpe else "a larger KV cache"
    if compression(other) == compression(best):
        return "equally compressed and lower recovery"
    if other.median_recovery <= best.median_recovery:
        return f"{more} and no more recovery"
    if _tied(best, other):
        return f"{more}; its higher recovery is within the confidence intervals (a tie, broken toward compression)"
    return f"{more}; it recovers more, but at or above the floor compression decides"


def select_recipe(rows: list[RecipeRow], params: SelectionParams, stopped: dict[str, str] | None = None) -> SelectionResult:
    """Choose a recipe from the PTQ results by the configured policy, and say why. `stopped` (racing):
    the candidates the race stopped early, with where and why; shown in the table, never chosen."""
    low, high = params.band
    floor = params.ptq_final_min if params.policy == "ptq_final" else low
    target = "the PTQ-final target" if params.policy == "ptq_final" else "the QAD band's floor"
    stopped = stopped or {}
    ok = [r for r in rows if r.status == "ok" and r.name not in stopped]
    failed = [r.name for r in rows if r.status == "failed"]
    aliases = [r for r in rows if r.status == "alias"]
    notes = ""
    if aliases:
        notes += " Same quantizers on this model, run once: " + ", ".join(
            f"{a.name} = {a.alias_of}" for a in aliases) + "."
    if failed:
        notes += f" Failed recipes left out: {', '.join(failed)}."
    if stopped:
        notes += " Racing: " + "; ".join(stopped.values()) + "; the others were scored on every item."
    table = sorted(rows, key=lambda r: ({"ok": 0, "alias": 1}.get(r.status, 2), r.name))

    def verdict(selected: str | None, reason: str, runner_up: str | None = None,
                further: bool = False) -> SelectionResult:
        return SelectionResult(selected=selected, policy=params.policy, band=params.band, reason=reason + notes,
                               table=table, runner_up=runner_up, could_compress_further=further)

    if not ok:
        why = "every recipe failed or stopped racing" if stopped else "every recipe failed"
        return verdict(None, f"No recipe qualifies: {why}.")
    eligible = [r for r in ok if r.median_recovery >= floor]
    if not eligible:
        best = max(ok, key=lambda r: r.median_recovery)
        near = (" Its interval reaches the floor: a larger eval may tell."
                if best.median_recovery_ci and best.median_recovery_ci[1] >= floor else "")
        advice = ("Run QAD (policy qad) or use a less aggressive recipe." if params.policy == "ptq_final" else
                  "QAD is not started. Lower selection.band or add a less aggressive recipe.")
        return verdict(None, f"No recipe qualifies: every recipe is below {target} of {_pct(floor)} "
                             f"(best: {best.name} at {_with_ci(best)}).{near} {advice}", best.name)

    ranked = sorted(eligible, key=lambda r: (*compression(r), -r.median_recovery, r.name))
    best = ranked[0]
    others = ranked[1:] or sorted((r for r in ok if r not in eligible), key=lambda r: -r.median_recovery)
    reason = (f"{best.name}: the most compressed of the {len(eligible)} recipe(s) at or above {target} of "
              f"{_pct(floor)}: {_describe(best)}.")
    further = params.policy == "qad" and best.median_recovery > high
    if further:
        reason += (f" It is above the band's upper end of {_pct(high)}: compression could go further "
                   "(a more aggressive recipe).")
    if best.median_recovery_ci and best.median_recovery_ci[0] < floor:
        reason += " Borderline: its interval reaches below the floor."
    runner_up = others[0] if others else None
    if runner_up is not None:
        reason += f" Runner-up: {_describe(runner_up)}, lost: {_why_lost(best, runner_up, floor)}."
    return verdict(best.name, reason, runner_up.name if runner_up else None, further)


def recipe_metrics(name: str, folder: Path, baseline: BaselineMetrics, baseline_items: dict | None) -> RecipeResult:
    """metrics/ptq/<name>.json: the PTQ stage's scores plus recovery (and its interval) versus BF16."""
    scores_path = folder / "scores.json"
    if not scores_path.is_file():
        return RecipeFailed(recipe=name, status="failed", error=f"no scores: {scores_path} (the PTQ run failed)")
    scores = read_result(scores_path, PTQResult)
    if scores.status == "alias":
        return RecipeAlias(recipe=name, status="alias", alias_of=scores.alias_of)
    items = read_json(folder / "items.json") if (folder / "items.json").is_file() else None
    base = dump_result(baseline)
    if items and baseline_items and any(items[t]["ids"] != baseline_items[t]["ids"] for t in items if t in baseline_items):
        # scored on part of the items (a candidate the race stopped): against BF16 on the same items
        baseline_items = {**baseline_items, **restrict(baseline_items, {t: v["ids"] for t, v in items.items()})}
        base = on_items(base, baseline_items)
    return RecipeMetrics.model_validate(score_recovery(dump_result(scores), items, base, baseline_items))


def row(metrics: RecipeResult, earlier: dict[str, RecipeRow]) -> RecipeRow:
    """The table row of one recipe's metrics; an alias shows the figures of the recipe it repeats."""
    if metrics.status == "alias":
        canonical = earlier.get(metrics.alias_of)
        figures = asdict(canonical) if canonical is not None else {}
        figures.update(name=metrics.recipe, status="alias", alias_of=metrics.alias_of, error=None)
        return RecipeRow(**figures)
    if metrics.status == "failed":
        return RecipeRow(metrics.recipe, "failed", error=metrics.error)
    return RecipeRow(
        metrics.recipe, "ok", metrics.median_recovery, metrics.effective_bpe, metrics.kv_cache,
        median_recovery_ci=metrics.median_recovery_ci, kl_divergence=metrics.kl_divergence,
        weight_error_median=metrics.weight_error.median,
        settings={**dump_result(metrics.settings), "effective_bpe": metrics.effective_bpe},
    )


def sweep_candidates(params: Params, layout: Layout) -> list[str]:
    """The BPE sweep's points that compete with the recipes (`selection.sweep`): none, its knee,
    or all of them, named `<recipe>@<budget>` (their folders: `Layout.candidate`); none when this
    run does not sweep (`stages.with_sweep`), whatever an earlier sweep left on disk."""
    if not with_sweep(params):
        return []
    sweep = read_result(layout.bpe_sweep_metrics, BPESweep, missing_ok=True)
    if sweep is None:
        raise ConfigError(f"selection.sweep is {params.selection.sweep!r} but the BPE sweep has not run "
                          f"(no {layout.bpe_sweep_metrics}): run `qad-pipeline sweep`, or set selection.sweep=none")
    if params.selection.sweep == "knee":
        return [sweep.knee.name] if sweep.knee.name else []
    return [p.name for p in sweep.points]


def run_selection(params: Params, layout: Layout) -> SelectionResult:
    """Stage core: recovery per recipe (metrics/ptq/*.json), then the choice (metrics/selection.json)."""
    baseline = read_result(layout.baseline_metrics, BaselineMetrics)
    items = layout.items("baseline")
    baseline_items = read_json(items) if items.is_file() else None
    aliases: dict[str, str] | None = None  # re-checked for a recorded alias: its recipe file may have changed since
    race = read_result(layout.race_metrics, RaceResult) if params.race.enabled else None
    raced = {c.name for c in race.candidates} if race else set()
    rows: dict[str, RecipeRow] = {}
    for name in [*params.ptq.recipes, *sweep_candidates(params, layout)]:
        folder = layout.race(name) if name in raced else layout.candidate(name)  # raced: merged over its rounds
        metrics = recipe_metrics(name, folder, baseline, baseline_items)
        if metrics.status == "alias" and aliases is None:  # Model Optimizer (~10 s to import) only where needed
            aliases = recipe_aliases(params)
        if metrics.status == "alias" and aliases.get(name) != metrics.alias_of:
            metrics = RecipeFailed(recipe=name, status="failed",
                                   error=f"recorded as the same as {metrics.alias_of}, which it no longer is; "
                                         f"re-run its PTQ (dvc repro -f ptq@{name})")
        write_result(layout.ptq_metrics(name), metrics)
        rows[name] = row(metrics, rows)
    stopped = {c.name: c.stopped.text for c in race.candidates if c.stopped} if race else {}
    selection = select_recipe(list(rows.values()), params.selection, stopped)
    if race is not None:
        spent = (f" Racing scored {race.items_spent} of {race.items_full} eval items "
                 f"({100 * race.saved:.0f} % saved; rounds at {race.fractions} of each task's items).")
        selection = selection.model_copy(update=dict(reason=selection.reason + spent, racing=Racing(
            items_spent=race.items_spent, items_full=race.items_full, saved=race.saved, fractions=race.fractions,
            confidence=race.confidence, stopped=stopped)))
    write_result(layout.recovery_table, RecoveryTable([
        RecoveryPoint(recipe=r.name, effective_bpe=r.effective_bpe, median_recovery=r.median_recovery,
                      ci_low=r.median_recovery_ci[0] if r.median_recovery_ci else None,
                      ci_high=r.median_recovery_ci[1] if r.median_recovery_ci else None)
        for r in rows.values() if r.status == "ok"
    ]))
    write_result(layout.selection_metrics, selection)
    return selection


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """The selection stage: `qad-pipeline stage selection`."""
    return run_selection(params, layout).reason
