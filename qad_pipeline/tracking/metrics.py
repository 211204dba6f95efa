"""Numbers from the stages' JSON files as MLflow metrics: valid keys, task scores and recoveries,
intervals, every numeric leaf of a nested mapping."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from qad_pipeline.core.redaction import flatten
from qad_pipeline.results.scores import TaskScore


def number(value: Any) -> float | None:
    """A number (a boolean as 0/1) as a float; None for anything else."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


def metric_key(key: str) -> str:
    """A valid MLflow metric name: letters, digits, _ - . / : and space."""
    key = re.sub(r"[^\w.\-/ :]", "_", key).strip("/")
    return re.sub(r"\.\.+", ".", key) or "_"


def ci_metrics(ci: Any, prefix: str) -> dict[str, float]:
    """[low, high] -> {prefix_ci_low: low, prefix_ci_high: high}; nothing when absent."""
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(number(v) is not None for v in ci):
        return {f"{prefix}_ci_low": float(ci[0]), f"{prefix}_ci_high": float(ci[1])}
    return {}


def numeric_leaves(data: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number (and boolean, as 0/1) in a nested mapping, keyed with dots; lists skipped."""
    return {metric_key(k): number(v) for k, v in flatten(data, prefix).items() if number(v) is not None}


def task_metrics(tasks: Mapping[str, TaskScore]) -> dict[str, float]:
    """score.<task> and, where the file has it, recovery.<task>."""
    out = {}
    for task, score in tasks.items():
        if number(score.value) is not None:
            out[metric_key(f"score.{task}")] = float(score.value)
        if number(score.recovery) is not None:
            out[metric_key(f"recovery.{task}")] = float(score.recovery)
        ci = ci_metrics(score.recovery_ci, "recovery")
        out.update({metric_key(f"{k}.{task}"): v for k, v in ci.items()})
    return out


def pick(result: Any, *fields: str) -> dict[str, float]:
    """Those of `fields` of a result model (or row) that are numbers, as floats; a field that a
    variant of the file does not have (a failed recipe's figures) is left out."""
    return {k: float(v) for k in fields if number(v := getattr(result, k, None)) is not None}
