"""The BPE sweep's curve and knee: `qad-pipeline stage bpe_sweep`.

Reads every sweep point (`artifacts/sweep/<budget>/`) and every fixed recipe that ran
(`artifacts/ptq/<recipe>/`), scores each against the BF16 baseline exactly as selection does
(median recovery with its bootstrap interval, `tasks/selection.py: recipe_metrics`), and chooses
the knee with a pure rule (`choose_knee`): the smallest budget beyond which median recovery gains
less than `sweep.knee_epsilon` per added bit (Model Optimizer's effective bits, the budget's axis),
judged on the lower end of each gain's paired-bootstrap interval (every point is scored on the same
eval items, so the same resampled items in each draw), not on point estimates that move with the
eval's noise. Writes
`metrics/bpe_sweep.json` (points, knee and its reason, the eval's noise), `metrics/bpe_curve.json`
(DVC's plot) and `artifacts/bpe_sweep/pareto.png` (median recovery against bits per element,
every point labelled).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from qad_pipeline.core.artifacts import read_json, staged_dir
from qad_pipeline.core.config import Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.scoring.recovery import LEVEL, median_draws
from qad_pipeline.results.base import dump_result, read_result, write_result
from qad_pipeline.results.scores import BaselineMetrics, PTQResult, SweepSearch
from qad_pipeline.results.selection_metrics import RecipeMetrics, RecoveryPoint
from qad_pipeline.results.sweep_metrics import BPECurve, BPESweep, Knee, SweepPoint
from tasks.selection import recipe_metrics


def _pts(x: float) -> str:
    return f"{100 * x:.2f}"


def bits(p: SweepPoint) -> float:
    """A point's position on the budget axis: Model Optimizer's effective bits over the searched
    layers (what the budget controls; the documents' 4.85-7.19 BPE sweep is on this axis)."""
    return p.searched_effective_bits if p.searched_effective_bits is not None else p.effective_bpe


def _gain(point: SweepPoint, other: SweepPoint, draws: dict[str, np.ndarray]) -> tuple[float, float | None]:
    """(the gain in median recovery per added bit from `point` to `other`, the lower end of its
    paired-bootstrap interval: None without both points' resamples)."""
    step = bits(other) - bits(point)
    gain = (other.median_recovery - point.median_recovery) / step
    if point.name not in draws or other.name not in draws:
        return gain, None
    low = float(np.percentile((draws[other.name] - draws[point.name]) / step, 100 * (1 - LEVEL) / 2))
    return gain, low


def choose_knee(points: list[SweepPoint], epsilon: float, draws: dict[str, np.ndarray] | None = None) -> Knee:
    """The knee of the curve: the least-bits point from which no point with more bits gains at
    least `epsilon` median recovery per added bit (`bits`) beyond the noise: with each point's
    bootstrap resamples (`draws`, paired: `recovery.median_draws`), a gain counts by the lower end
    of its interval; without them, by its point estimate. A flat curve's knee is its first point;
    one that keeps gaining, its last. Comparing against every later point (not only the next)
    keeps one noisy dip from ending the search early."""
    if not points:
        return Knee(name=None, budget=None, reason="no sweep point ran, so there is no curve")
    draws = draws or {}
    ranked = sorted(points, key=lambda p: (bits(p), -p.median_recovery))
    for i, point in enumerate(ranked):
        gains = [(*_gain(point, q, draws), q) for q in ranked[i + 1:] if bits(q) > bits(point)]
        counted = [(low if low is not None else gain, gain, low, q) for gain, low, q in gains]
        steepest = max(counted, default=None, key=lambda g: g[0])
        if steepest is not None and steepest[0] >= epsilon:
            continue
        here = (f"{point.name} ({bits(point):.3f} bits over the searched layers, {point.effective_bpe:.3f} per "
                f"element of the whole model, median recovery {_pts(point.median_recovery)} %)")
        if steepest is None:
            beyond = "no point has more bits" if i == 0 else "it is the point with the most bits"
        elif steepest[2] is None:
            beyond = (f"beyond it the steepest gain is {_pts(steepest[1])} points of median recovery per added bit "
                      f"(to {steepest[3].name}), below ε = {_pts(epsilon)}")
        else:
            beyond = (f"beyond it no gain is at least ε = {_pts(epsilon)} points of median recovery per added bit "
                      f"beyond the noise: the steepest, to {steepest[3].name}, is {_pts(steepest[1])} with the "
                      f"lower end of its {int(LEVEL * 100)} % paired interval at {_pts(steepest[0])}")
        before = "" if i == 0 else (f"; from every point with fewer bits, going further still gains at least "
                                    f"{_pts(epsilon)} points per added bit")
        flat = ""
        if i == 0 and steepest is not None:
            within = all(low is not None and low <= 0 for _, _, low, _ in counted)
            flat = (" (the curve is flat within the noise from its first point: no point with more bits is better "
                    "beyond its interval)" if within else " (the curve is flat from its first point)")
        return Knee(name=point.name, budget=point.budget, reason=f"{here}: {beyond}{before}{flat}.")
    raise AssertionError("unreachable: the last point always qualifies")


def noise(points: list[SweepPoint]) -> float:
    """The eval's noise on a point's median recovery: the widest half confidence interval."""
    return max(((p.median_recovery_ci[1] - p.median_recovery_ci[0]) / 2 for p in points), default=0.0)


def monotone_within(points: list[SweepPoint], tolerance: float) -> bool:
    """Median recovery never falls by more than `tolerance` as bits per element grow."""
    ranked = sorted(points, key=lambda p: p.effective_bpe)
    return all(b.median_recovery >= a.median_recovery - tolerance for a, b in zip(ranked, ranked[1:]))


def sweep_point(metrics: RecipeMetrics, kind: str) -> SweepPoint:
    searched = metrics.auto_quantize if kind == "sweep" else None
    return SweepPoint(
        name=metrics.recipe, kind=kind, budget=searched.budget if searched else None,
        searched_effective_bits=searched.searched_effective_bits if searched else None,
        effective_bpe=metrics.effective_bpe, median_recovery=metrics.median_recovery,
        median_recovery_ci=metrics.median_recovery_ci, kl_divergence=metrics.kl_divergence,
        layers_by_format=dict(Counter(layer.format for layer in searched.layers.values()
                                      if len(layer.costs) > 1)) if searched else {})


def _resamples(folder, baseline: BaselineMetrics, baseline_items: dict | None) -> np.ndarray:
    """A scored point's median-recovery bootstrap resamples (paired with every other point's)."""
    scores = dump_result(read_result(folder / "scores.json", PTQResult))
    items = read_json(folder / "items.json") if (folder / "items.json").is_file() else None
    return median_draws(scores, items, dump_result(baseline), baseline_items)


def run_bpe_sweep(params: Params, layout: Layout) -> BPESweep:
    """Stage core: the curve (sweep points and fixed recipes), the knee, the plot."""
    from qad_pipeline.reporting.plots import bpe_sweep_plot

    baseline = read_result(layout.baseline_metrics, BaselineMetrics)
    items = layout.items("baseline")
    baseline_items = read_json(items) if items.is_file() else None
    points, failed, seconds, draws = [], [], {}, {}
    for budget in params.sweep.points:
        name = params.sweep.point(budget)
        metrics = recipe_metrics(name, layout.sweep(budget), baseline, baseline_items)
        if metrics.status != "ok":
            failed.append(name)
            continue
        points.append(sweep_point(metrics, "sweep"))
        draws[name] = _resamples(layout.sweep(budget), baseline, baseline_items)
        seconds[name] = metrics.timing_s["total"]
    fixed = []
    for recipe in params.ptq.recipes:
        if (layout.ptq(recipe) / "scores.json").is_file():
            metrics = recipe_metrics(recipe, layout.ptq(recipe), baseline, baseline_items)
            if metrics.status == "ok":
                fixed.append(sweep_point(metrics, "fixed"))
    search = read_result(layout.sweep_search / "search.json", SweepSearch, missing_ok=True)
    seconds["sweep (search + points)"] = (search.seconds if search else 0.0) + sum(seconds.values())
    wobble = noise(points)
    sweep = BPESweep(recipe=params.sweep.recipe, points=sorted(points, key=lambda p: p.budget), fixed=fixed,
                     knee=choose_knee(points, params.sweep.knee_epsilon, draws), knee_epsilon=params.sweep.knee_epsilon,
                     noise=wobble, monotone_within_noise=monotone_within(points, wobble), failed=failed,
                     search_s=search.seconds if search else None, seconds=seconds)
    write_result(layout.bpe_sweep_metrics, sweep)
    write_result(layout.bpe_curve, BPECurve([
        RecoveryPoint(recipe=p.name, effective_bpe=p.effective_bpe, median_recovery=p.median_recovery,
                      ci_low=p.median_recovery_ci[0], ci_high=p.median_recovery_ci[1]) for p in [*points, *fixed]]))
    with staged_dir(layout.bpe_sweep) as tmp:
        bpe_sweep_plot(sweep, tmp / layout.bpe_plot.name)
    return sweep


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """The sweep's curve and knee: `qad-pipeline stage bpe_sweep`."""
    sweep = run_bpe_sweep(params, layout)
    return f"bpe_sweep: knee {sweep.knee.name}: {sweep.knee.reason}"
