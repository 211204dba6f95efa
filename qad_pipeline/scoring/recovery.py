"""Accuracy recovery arithmetic: quantized score versus BF16 score, per task and median.

Recovery of one task is quantized / BF16 for a score where higher is better (accuracy) and
BF16 / quantized where lower is better (perplexity), so 1.0 means "as good as BF16" either way.
The median over tasks is the figure the documents select recipes by.
"""

from __future__ import annotations

import statistics


def task_recovery(quantized: float, baseline: float, higher_is_better: bool) -> float:
    if baseline <= 0 or quantized < 0 or (quantized == 0 and not higher_is_better):
        raise ValueError(
            f"recovery needs a positive baseline and a non-negative score, got quantized={quantized} "
            f"baseline={baseline}"
        )
    return quantized / baseline if higher_is_better else baseline / quantized


def recoveries(quantized: dict[str, dict], baseline: dict[str, dict]) -> dict[str, float]:
    """Per-task recovery for every baseline task that has a positive BF16 score.

    Each table maps task name -> {"value": float, "higher_is_better": bool, ...}. A task the BF16
    model scores 0 on says nothing about what quantization lost, so it has no recovery.
    """
    missing = sorted(set(baseline) - set(quantized))
    if missing:
        raise ValueError(f"quantized scores lack tasks {missing} that the baseline has")
    return {
        task: task_recovery(quantized[task]["value"], base["value"], base["higher_is_better"])
        for task, base in baseline.items()
        if base["value"] > 0
    }


def median_recovery(per_task: dict[str, float]) -> float:
    if not per_task:
        raise ValueError("median recovery of no tasks")
    return statistics.median(per_task.values())


# -- confidence intervals: a seeded paired bootstrap over items ---------------------------------
#
# Each scored model records, per task, its items' own values (`items`): lm-eval's per-sample
# metric, or each held-out window's mean log-likelihood for perplexity, with how they aggregate
# into the task's score ("mean", or "perplexity" = exp(-mean)). The baseline and a quantized
# model score the same items, so one resample of item indices is applied to both (paired): the
# interval reflects which items were drawn, not differences that the pairing cancels.

BOOTSTRAP_ITERS = 2000
BOOTSTRAP_SEED = 0
LEVEL = 0.95


def aggregate(values, aggregation: str):
    """Items' values (last axis) into the task's score: their mean, or exp(-mean) for perplexity."""
    import numpy as np

    mean = values.mean(axis=-1)
    return np.exp(-mean) if aggregation == "perplexity" else mean


def item_aggregation(values: list[float], score: float) -> str | None:
    """How per-item `values` make the task's `score` ("mean" or "perplexity"); None if neither."""
    import numpy as np

    if not values:
        return None
    v = np.asarray(values, dtype=np.float64)
    for name in ("mean", "perplexity"):
        if np.isclose(aggregate(v, name), score, rtol=1e-6, atol=1e-9):
            return name
    return None


def recovery_intervals(
    quantized_items: dict[str, dict], baseline_items: dict[str, dict], baseline: dict[str, dict],
    per_task: dict[str, float], iters: int = BOOTSTRAP_ITERS, seed: int = BOOTSTRAP_SEED, level: float = LEVEL,
) -> tuple[dict[str, list[float]], list[float]]:
    """Per-task recovery intervals and the median recovery's, `level` two-sided percentiles.

    `*_items` map task -> {"aggregation", "values"}; `per_task` is `recoveries(...)`. A task
    without paired items (another aggregation, or items missing) stays at its point recovery in
    every resample, so it narrows nothing it cannot vouch for: its own interval is its point.
    """

    task_ci, medians = _draws(quantized_items, baseline_items, baseline, per_task, iters, seed, level)
    return task_ci, _percentiles(medians, level)


def median_draws(scores: dict, items: dict | None, baseline: dict, baseline_items: dict | None):
    """The bootstrap resamples of a scored model's median recovery (BOOTSTRAP_SEED): two models
    scored on the same items get the same resampled items in each draw, so the difference of their
    draws is the paired bootstrap of the difference of their median recoveries."""
    per_task = recoveries(scores["tasks"], baseline["tasks"])
    return _draws(items or {}, baseline_items or {}, baseline["tasks"], per_task, BOOTSTRAP_ITERS, BOOTSTRAP_SEED,
                  LEVEL)[1]


def _draws(quantized_items, baseline_items, baseline, per_task, iters, seed, level):
    """(per-task intervals, the median recovery's resamples): see `recovery_intervals`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    draws, task_ci = [], {}
    for task, point in per_task.items():
        q, b = quantized_items.get(task), baseline_items.get(task)
        paired = (q and b and q.get("aggregation") and q["aggregation"] == b.get("aggregation")
                  and len(q["values"]) == len(b["values"]) > 1 and q.get("ids") == b.get("ids"))
        if not paired:
            draws.append(np.full(iters, point))
            task_ci[task] = [point, point]
            continue
        qv, bv = np.asarray(q["values"], np.float64), np.asarray(b["values"], np.float64)
        idx = rng.integers(0, len(qv), size=(iters, len(qv)))
        qs, bs = aggregate(qv[idx], q["aggregation"]), aggregate(bv[idx], b["aggregation"])
        higher = baseline[task]["higher_is_better"]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = qs / bs if higher else bs / qs
        ratio = np.nan_to_num(ratio, nan=point, posinf=point)
        draws.append(ratio)
        task_ci[task] = _percentiles(ratio, level)
    return task_ci, np.median(np.stack(draws, axis=1), axis=1)


def _percentiles(samples, level: float) -> list[float]:
    import numpy as np

    tail = 100 * (1 - level) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return [float(low), float(high)]


def score_recovery(scores: dict, items: dict | None, baseline: dict, baseline_items: dict | None) -> dict:
    """`scores` (a scored model's tasks) with each task's recovery and interval, and the median's."""
    per_task = recoveries(scores["tasks"], baseline["tasks"])
    task_ci, median_ci = recovery_intervals(items or {}, baseline_items or {}, baseline["tasks"], per_task)
    tasks = {name: dict(score) for name, score in scores["tasks"].items()}
    for task, value in per_task.items():
        tasks[task].update(recovery=value, recovery_ci=task_ci[task])
    return {**scores, "tasks": tasks, "median_recovery": median_recovery(per_task),
            "median_recovery_ci": median_ci,
            "recovery_interval": f"{int(LEVEL * 100)} % paired bootstrap over eval items, "
                                 f"{BOOTSTRAP_ITERS} resamples, seed {BOOTSTRAP_SEED}"}
