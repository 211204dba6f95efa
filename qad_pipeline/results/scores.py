"""What evaluation writes: the baseline's metrics/baseline.json, a recipe's or a sweep point's
scores.json (with its settings, weight error and AutoQuantize search), the sweep's search.json."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from qad_pipeline.results.base import Strict


class TaskScore(Strict):
    """One task's score (qad_pipeline/scoring/evaluation.py: primary_score); `recovery` and its interval once it is
    compared with BF16 (qad_pipeline/scoring/recovery.py: score_recovery, which runs on dumped dicts)."""

    metric: str
    filter: str | None = None  # the lm-eval filter whose value counts (GSM8K: strict-match or flexible-extract)
    value: float
    higher_is_better: bool
    all: dict[str, float] | None = None  # every numeric metric lm-eval returned, as "metric,filter" (perplexity: none)
    subtasks: dict[str, float] | None = None  # a group's: each leaf's value of the metric (qad_pipeline/scoring/eval_groups.py)
    recovery: float | None = None  # not for a task whose BF16 score is 0
    recovery_ci: tuple[float, float] | None = None


class ModelIdentity(Strict):  # qad_pipeline/core/modeling.py: checkpoint_identity
    path: str
    revision: str | None
    sha256: str | None = None  # a local folder's; a hub id has none


class BaselineMetrics(Strict):  # metrics/baseline.json (tasks/baseline.py: run_baseline)
    model: ModelIdentity
    tasks: dict[str, TaskScore]
    reference: dict[str, Any]  # the BF16 reference's k, tail_samples and fingerprint (nothing reads them)
    effective_bpe: float
    size_bytes: int
    status: Literal["ok"]


class WorstLayer(Strict):
    layer: str
    error: float


class WeightError(Strict):  # tasks/ptq.py: weight_errors
    median: float | None  # None when nothing was quantized
    mean: float | None
    layers: dict[str, float]
    worst: list[WorstLayer]


class RecipeSettings(Strict):
    algorithm: str
    weight_scale: str
    mamba_format: str
    kv_cache: str


class LayerwiseCalibration(Strict):  # a recipe calibrated layer by layer (tasks/ptq.py, qad_pipeline/nvfp4/layerwise.py)
    layers: int  # the decoder layers Model Optimizer calibrated one at a time
    resumed_from_layer: int  # the first layer this run calibrated: 0, or where a killed run's checkpoints ended
    checkpoints: bool  # per-layer checkpoints were kept (the stage's; a direct run_ptq call may keep none)


class AutoQuantizeLayer(Strict):
    format: str  # the chosen candidate, "none" for BF16
    modules: list[str]  # the modules that share the choice (Model Optimizer groups e.g. fused projections)
    scores: dict[str, float]  # each candidate's sensitivity score (higher: more sensitive)
    costs: dict[str, float]  # each candidate's cost (Model Optimizer's weight bits / 16)


class AutoQuantizeResult(Strict):  # an AutoQuantize recipe's search (tasks/ptq.py: auto_quantize_model)
    budget: float  # the effective-bits budget asked for
    searched_effective_bits: float  # Model Optimizer's count of the solution, over the searched layers
    minimum_bits: float  # the smallest budget the formats allow on this model (Model Optimizer's count)
    method: str
    formats: list[str]
    kv_cache: str | None
    layers: dict[str, AutoQuantizeLayer]
    reused_search: bool  # calibration and scores taken from the sweep's search state
    search_s: float


class PTQScores(Strict):  # artifacts/ptq/<r>/scores.json of a recipe that ran (tasks/ptq.py: run_ptq)
    recipe: str
    status: Literal["ok"]
    tasks: dict[str, TaskScore]
    kl_divergence: float
    kl_estimator: str
    effective_bpe: float
    size_bytes: int
    bf16_size_bytes: int
    kv_cache: str
    elements_by_format: dict[str, int]
    layer_formats: dict[str, str]
    weight_error: WeightError
    settings: RecipeSettings
    layerwise: LayerwiseCalibration | None = None  # absent: calibrated whole-model (ptq.layerwise)
    timing_s: dict[str, float]  # quantize, eval, total
    started_at: float
    finished_at: float
    peak_rss_mb: float
    peak_device_mb: float | None
    auto_quantize: AutoQuantizeResult | None = None  # an AutoQuantize recipe's layer map and bit counts


class SweepSearch(Strict):  # artifacts/sweep_search/search.json (tasks/sweep_search.py)
    recipe: str
    method: str
    formats: list[str]
    budget: float  # the recipe's own budget, which the search solved for first
    searched_effective_bits: float
    minimum_bits: float
    layers: dict[str, AutoQuantizeLayer]
    seconds: float


class PTQAlias(Strict):  # scores.json of a recipe the same as an earlier one on this model: not run
    recipe: str
    status: Literal["alias"]
    alias_of: str
    started_at: float
    finished_at: float


PTQResult = Annotated[Union[PTQScores, PTQAlias], Field(discriminator="status")]
