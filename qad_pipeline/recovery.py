"""Accuracy recovery arithmetic: quantized score versus BF16 score, per task and median.

Recovery of one task is quantized / BF16 for a score where higher is better (accuracy) and
BF16 / quantized where lower is better (perplexity), so 1.0 means "as good as BF16" either way.
The median over tasks is the figure the documents select recipes by.
"""

from __future__ import annotations

import statistics


def task_recovery(quantized: float, baseline: float, higher_is_better: bool) -> float:
    if baseline <= 0 or quantized <= 0:
        raise ValueError(
            f"recovery needs positive scores, got quantized={quantized} baseline={baseline}"
        )
    return quantized / baseline if higher_is_better else baseline / quantized


def recoveries(quantized: dict[str, dict], baseline: dict[str, dict]) -> dict[str, float]:
    """Per-task recovery for every task both score tables share.

    Each table maps task name -> {"value": float, "higher_is_better": bool, ...}.
    """
    missing = sorted(set(baseline) - set(quantized))
    if missing:
        raise ValueError(f"quantized scores lack tasks {missing} that the baseline has")
    return {
        task: task_recovery(quantized[task]["value"], base["value"], base["higher_is_better"])
        for task, base in baseline.items()
    }


def median_recovery(per_task: dict[str, float]) -> float:
    if not per_task:
        raise ValueError("median recovery of no tasks")
    return statistics.median(per_task.values())
