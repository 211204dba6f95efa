"""The BPE sweep's curve: metrics/bpe_sweep.json and metrics/bpe_curve.json."""

from __future__ import annotations

from typing import Literal

from pydantic import RootModel

from qad_pipeline.results.base import Strict
from qad_pipeline.results.selection_metrics import RecoveryPoint


class SweepPoint(Strict):
    """One point of the BPE curve: a sweep budget, or a fixed recipe placed on the same axes."""

    name: str  # `<recipe>@<budget>` for a sweep point, the recipe's name for a fixed one
    kind: Literal["sweep", "fixed"]
    budget: float | None  # Model Optimizer's budget (a sweep point)
    searched_effective_bits: float | None  # Model Optimizer's count over the searched layers (a sweep point)
    effective_bpe: float  # the project's count over every weight
    median_recovery: float
    median_recovery_ci: tuple[float, float]
    kl_divergence: float
    layers_by_format: dict[str, int]  # layer groups with a choice, per chosen format (a sweep point)


class Knee(Strict):
    name: str | None
    budget: float | None
    reason: str


class BPESweep(Strict):  # metrics/bpe_sweep.json (tasks/bpe_sweep.py)
    recipe: str
    points: list[SweepPoint]  # the sweep's, by budget
    fixed: list[SweepPoint]  # the fixed recipes that ran, on the same axes
    knee: Knee
    knee_epsilon: float
    noise: float  # the widest half confidence interval of a point's median recovery
    monotone_within_noise: bool
    failed: list[str]
    search_s: float | None
    seconds: dict[str, float]  # each point's quantize and eval time, and the sweep's total


class BPECurve(RootModel[list[RecoveryPoint]]):
    """metrics/bpe_curve.json, DVC's plot of the sweep: every point, sweep and fixed."""
