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
