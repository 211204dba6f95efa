"""The stages' JSON files as pydantic models, one per file (the comments name each file).

A stage writes its file with `write_result(path, model)`; its readers read it with
`read_result(path, Model)` and use attributes. Each file's top level, and every nested object that
code reads by key, forbids unknown keys: a file that does not match is refused with the file and
the key named. Free-form maps (lm-eval's metrics, per-layer formats, the export's check results)
stay dicts. The JSON is what the stages wrote before these models (DVC, MLflow and users read it):
a model declares its fields in the order its writer writes them, and an optional field that a
writer does not set stays out of the file (`dump_result`).
"""

from __future__ import annotations

import functools
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, RootModel, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from qad_pipeline.artifacts import read_json, write_json
from qad_pipeline.config import ConfigError

T = TypeVar("T")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskScore(_Strict):
    """One task's score (qad_pipeline/evaluation.py: primary_score); `recovery` and its interval once it is
    compared with BF16 (qad_pipeline/recovery.py: score_recovery, which runs on dumped dicts)."""

    metric: str
    value: float
    higher_is_better: bool
    all: dict[str, float] | None = None  # every numeric metric lm-eval returned (perplexity: none)
    recovery: float | None = None  # not for a task whose BF16 score is 0
    recovery_ci: tuple[float, float] | None = None


class CalibrationSet(_Strict):
    samples: int
    seq_len: int
    fingerprint: str


class HeldOutSet(_Strict):
    ppl_samples: int
    seq_len: int
    heldout_cloze: int
    heldout_continuation: int
    fingerprint: str


class CalibrationManifest(_Strict):  # artifacts/calibration/manifest.json (tasks/calibration.py)
    source: str
    documents: int
    calibration_documents: list[int]
    eval_documents: list[int]
    calibration: CalibrationSet
    eval: HeldOutSet
    tokenizer: str
    seed: int


class ModelIdentity(_Strict):  # qad_pipeline/modeling.py: checkpoint_identity
    path: str
    revision: str | None
    sha256: str | None = None  # a local folder's; a hub id has none


class BaselineMetrics(_Strict):  # metrics/baseline.json (tasks/baseline.py: run_baseline)
    model: ModelIdentity
    tasks: dict[str, TaskScore]
    reference: dict[str, Any]  # the BF16 reference's k, tail_samples and fingerprint (nothing reads them)
    effective_bpe: float
    size_bytes: int
    status: Literal["ok"]


class WorstLayer(_Strict):
    layer: str
    error: float


class WeightError(_Strict):  # tasks/ptq.py: weight_errors
    median: float | None  # None when nothing was quantized
    mean: float | None
    layers: dict[str, float]
    worst: list[WorstLayer]


class RecipeSettings(_Strict):
    algorithm: str
    weight_scale: str
    mamba_format: str
    kv_cache: str


class AutoQuantizeLayer(_Strict):
    format: str  # the chosen candidate, "none" for BF16
    modules: list[str]  # the modules that share the choice (Model Optimizer groups e.g. fused projections)
    scores: dict[str, float]  # each candidate's sensitivity score (higher: more sensitive)
    costs: dict[str, float]  # each candidate's cost (Model Optimizer's weight bits / 16)


class AutoQuantizeResult(_Strict):  # an AutoQuantize recipe's search (tasks/ptq.py: auto_quantize_model)
    budget: float  # the effective-bits budget asked for
    searched_effective_bits: float  # Model Optimizer's count of the solution, over the searched layers
    minimum_bits: float  # the smallest budget the formats allow on this model (Model Optimizer's count)
    method: str
    formats: list[str]
    kv_cache: str | None
    layers: dict[str, AutoQuantizeLayer]
    reused_search: bool  # calibration and scores taken from the sweep's search state
    search_s: float


class PTQScores(_Strict):  # artifacts/ptq/<r>/scores.json of a recipe that ran (tasks/ptq.py: run_ptq)
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
    timing_s: dict[str, float]  # quantize, eval, total
    started_at: float
    finished_at: float
    peak_rss_mb: float
    peak_device_mb: float | None
    auto_quantize: AutoQuantizeResult | None = None  # an AutoQuantize recipe's layer map and bit counts


class SweepSearch(_Strict):  # artifacts/sweep_search/search.json (tasks/sweep_search.py)
    recipe: str
    method: str
    formats: list[str]
    budget: float  # the recipe's own budget, which the search solved for first
    searched_effective_bits: float
    minimum_bits: float
    layers: dict[str, AutoQuantizeLayer]
    seconds: float


class PTQAlias(_Strict):  # scores.json of a recipe the same as an earlier one on this model: not run
    recipe: str
    status: Literal["alias"]
    alias_of: str
    started_at: float
    finished_at: float


PTQResult = Annotated[Union[PTQScores, PTQAlias], Field(discriminator="status")]


class RecipeMetrics(PTQScores):  # metrics/ptq/<r>.json (tasks/selection.py): the scores and their recovery
    median_recovery: float
    median_recovery_ci: tuple[float, float]
    recovery_interval: str


class RecipeFailed(_Strict):
    recipe: str
    status: Literal["failed"]
    error: str


class RecipeAlias(_Strict):
    recipe: str
    status: Literal["alias"]
    alias_of: str


RecipeResult = Annotated[Union[RecipeMetrics, RecipeFailed, RecipeAlias], Field(discriminator="status")]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class RecipeRow:
    """One recipe as selection weighs it (tasks/selection.py) and as metrics/selection.json holds it."""

    name: str
    status: Literal["ok", "failed", "alias"]
    median_recovery: float | None = None
    effective_bpe: float | None = None
    kv_cache: str = "none"
    error: str | None = None
    median_recovery_ci: tuple[float, float] | None = None
    alias_of: str | None = None
    kl_divergence: float | None = None
    weight_error_median: float | None = None
    # the recipe's RecipeSettings and its effective_bpe: the recipe axis of MLflow's compare view
    settings: dict[str, Any] = field(default_factory=dict)


class SelectionResult(_Strict):  # metrics/selection.json (tasks/selection.py): the verdict and its table
    selected: str | None
    policy: str
    band: tuple[float, float]
    reason: str
    table: list[RecipeRow]
    runner_up: str | None
    could_compress_further: bool


class RecoveryPoint(_Strict):
    recipe: str
    effective_bpe: float
    median_recovery: float
    ci_low: float | None
    ci_high: float | None


class RecoveryTable(RootModel[list[RecoveryPoint]]):
    """metrics/recovery.json, DVC's recovery plot: one point per recipe that ran."""


class SweepPoint(_Strict):
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


class Knee(_Strict):
    name: str | None
    budget: float | None
    reason: str


class BPESweep(_Strict):  # metrics/bpe_sweep.json (tasks/bpe_sweep.py)
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


class LossPoint(_Strict):
    step: int
    loss: float
    lr: float


class QADTraining(_Strict):  # artifacts/qad/loss.json (tasks/qad.py: run_qad)
    losses: list[LossPoint]
    steps: int
    resumed_from: int
    final_loss: float
    first_loss: float
    steps_per_second: float | None
    tokens_per_step: int
    tokens_per_second: float | None
    seconds: float
    world_size: int
    sharding: str | None
    compute_dtype: str
    gradient_checkpointing: bool
    peak_gpu_memory_gb: float | None


class LossCurve(RootModel[list[LossPoint]]):
    """metrics/qad_loss.json, DVC's loss plot: the QAD loss per step."""


class QADMetrics(_Strict):  # metrics/qad.json (tasks/final_eval.py)
    recipe: str
    tasks: dict[str, TaskScore]
    kl_divergence: float
    kl_estimator: str
    median_recovery: float
    median_recovery_ci: tuple[float, float]
    recovery_interval: str
    ptq_median_recovery: float
    ptq_median_recovery_ci: tuple[float, float]
    qad_beats_ptq: bool
    steps: int
    final_loss: float
    first_loss: float
    steps_per_second: float | None
    # comparison_table: rows bf16, ptq:<recipe>, qad with `name`, each task's score and
    # `<task>_recovery`, `median_recovery`, `kl_divergence`: one column per task, so a dict
    table: list[dict[str, Any]]


class ServingNotes(_Strict):  # what each GPU and serving engine needs; also artifacts/export/serving.json
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    blackwell: str
    hopper: str
    vllm: str
    tensorrt_llm: str
    sglang: str
    checked: str


class ServingCheck(_Strict):
    level: str
    summary: str


class ExportMetrics(_Strict):  # metrics/export.json (tasks/export.py: run_export)
    path: str
    source: str  # what was exported: qad (the QAD student) or ptq/<candidate> (a PTQ checkpoint)
    size_bytes: int
    bf16_size_bytes: int
    size_ratio: float
    effective_bpe: float
    layer_formats: dict[str, str]
    layers_by_format: dict[str, int]
    repaired_layer_names: int
    # formats, size, lint, reload and (unless skipped) serving: each check's own figures, and `passed`
    checks: dict[str, dict[str, Any]]
    serving: ServingNotes
    serving_check: ServingCheck
    passed: bool


class TrackingRecord(_Strict):  # artifacts/mlflow_run.json (flows/pipeline.py, qad-pipeline log-mlflow)
    """Which MLflow run holds this out-root's pipeline run, and whether it is logged whole."""

    uri: str  # the tracking store, secrets masked
    run_id: str
    logged: bool  # every file logged and the run ended; False: started, or cut short (log-mlflow completes it)
    model_version: str | None = None


class RunSummary(_Strict):
    """The flow's result: what `flows/pipeline.py: run_dag` returns (as a dict), with the flow's
    `plots`, `mlflow` and `dvc`. Also the report's input, which `report.read_summary` and
    `qad-pipeline log-mlflow` make from the files alone: hence the defaults."""

    selection: SelectionResult
    recipes: list[dict[str, Any]]  # report.recipe_rows: display columns ("median rec. %", ...)
    weight_error: list[dict[str, Any]] = []  # report.weight_error_rows
    failed: list[str] = []
    cached: list[str] = []
    baseline_cached: bool = False
    seconds: dict[str, float] = {}
    root: str | None = None
    qad: QADMetrics | None = None
    export: ExportMetrics | None = None
    sweep: BPESweep | None = None  # when the run swept first (selection.sweep set)
    plots: list[str] = []
    mlflow: dict[str, Any] = {}  # flows/pipeline.py: track: uri, run id, model version; or error
    dvc: str | None = None


class ResultFileError(ConfigError):
    """A stage's JSON file does not match its model; the message names the file and the key."""


def dump_result(model: BaseModel) -> Any:
    """A model's JSON data as its file holds it: the fields that were set, in declaration order."""
    return model.model_dump(mode="json", exclude_unset=True)


def write_result(path: Path, model: BaseModel) -> Path:
    """Write a stage's result file atomically (`artifacts.write_json`)."""
    return write_json(path, dump_result(model))


@functools.cache
def _adapter(kind: Any) -> TypeAdapter:
    return TypeAdapter(kind)


def read_result(path: Path, kind: type[T], *, missing_ok: bool = False) -> T:
    """A stage's result file as `kind` (a model above, or PTQResult / RecipeResult); a file that does
    not match is a ResultFileError naming the file and the offending keys. With `missing_ok`, a file
    that is not there (a stage that has not run, or failed) is None."""
    if missing_ok and not Path(path).is_file():
        return None  # type: ignore[return-value]
    data = read_json(path)
    try:
        return _adapter(kind).validate_python(data)
    except ValidationError as err:
        union = not isinstance(kind, type)  # PTQResult, RecipeResult: an error's location starts with the tag
        name = " or ".join(k.__name__ for k in get_args(get_args(kind)[0])) if union else kind.__name__
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][union:])) or 'status'}: {e['msg']}"
                             for e in err.errors()[:5])
        raise ResultFileError(f"{path} is not a valid {name} file: {problems}") from None
