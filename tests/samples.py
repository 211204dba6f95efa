"""Stage result files built from their models (qad_pipeline/results.py), for tests that fake a run.

Each builder fills every field the stage writes with a plausible value and takes, as keywords, the
values a test cares about; a fixture built from them cannot write a schema the stages no longer
write. `result_files` pairs every file of a run with its model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qad_pipeline.core.layout import Layout
from qad_pipeline.results.data import CalibrationManifest
from qad_pipeline.results.export_metrics import ExportMetrics, ServingNotes
from qad_pipeline.results.qad_metrics import LossCurve, QADMetrics, QADTraining
from qad_pipeline.results.race_metrics import RaceCandidate, RaceResult, RaceStop
from qad_pipeline.results.run import RunSummary
from qad_pipeline.results.scores import (
    BaselineMetrics,
    PTQAlias,
    PTQResult,
    PTQScores,
    TaskScore,
)
from qad_pipeline.results.selection_metrics import (
    RecipeAlias,
    RecipeFailed,
    RecipeMetrics,
    RecipeResult,
    RecipeRow,
    RecoveryTable,
    SelectionResult,
)
from qad_pipeline.results.served import ServedEval

FINGERPRINT = "0" * 64


def score(value: float, metric: str = "acc", higher_is_better: bool = True, **fields: Any) -> TaskScore:
    """One task's score; `recovery=` and `recovery_ci=` once compared with BF16."""
    return TaskScore(metric=metric, value=value, higher_is_better=higher_is_better, **fields)


def manifest(**fields: Any) -> CalibrationManifest:
    return CalibrationManifest(**{
        "source": "data/heldout", "documents": 10, "calibration_documents": [0, 2, 3, 5, 7],
        "eval_documents": [1, 4, 6, 8, 9],
        "calibration": {"samples": 4, "seq_len": 64, "fingerprint": FINGERPRINT},
        "eval": {"ppl_samples": 4, "seq_len": 64, "heldout_cloze": 16, "heldout_continuation": 8,
                 "fingerprint": FINGERPRINT},
        "tokenizer": "demo/model", "seed": 0, **fields})


def baseline(tasks: dict[str, TaskScore], **fields: Any) -> BaselineMetrics:
    return BaselineMetrics(**{
        "model": {"path": "demo/model", "revision": None, "sha256": FINGERPRINT}, "tasks": tasks,
        "reference": {"k": 32, "tail_samples": 32, "fingerprint": FINGERPRINT}, "effective_bpe": 16.0,
        "size_bytes": 6_000_000, "status": "ok", **fields})


def _ptq_fields(recipe: str, tasks: dict[str, TaskScore]) -> dict[str, Any]:
    return {
        "recipe": recipe, "status": "ok", "tasks": tasks, "kl_divergence": 0.01,
        "kl_estimator": "exact over the top 32 tokens + 32 tail samples per position", "effective_bpe": 4.75,
        "size_bytes": 700_000, "bf16_size_bytes": 2_000_000, "kv_cache": "fp8",
        "elements_by_format": {"nvfp4": 900_000, "bf16": 100_000},
        "layer_formats": {"model.layers.0.mlp.up_proj.weight": "nvfp4", "lm_head.weight": "nvfp4"},
        "weight_error": {"median": 0.08, "mean": 0.08, "layers": {"model.layers.0.mlp.up_proj": 0.08},
                         "worst": [{"layer": "model.layers.0.mlp.up_proj", "error": 0.08}]},
        "settings": {"algorithm": "max", "weight_scale": "max", "mamba_format": "fp8 W8A8", "kv_cache": "fp8"},
        "timing_s": {"quantize": 3.5, "eval": 20.0, "total": 30.0}, "started_at": 1000.0, "finished_at": 1030.0,
        "peak_rss_mb": 900.0, "peak_device_mb": None,
    }


def ptq_scores(recipe: str, tasks: dict[str, TaskScore], **fields: Any) -> PTQScores:
    """artifacts/ptq/<recipe>/scores.json of a recipe that ran."""
    return PTQScores(**{**_ptq_fields(recipe, tasks), **fields})


def recipe_metrics(recipe: str, tasks: dict[str, TaskScore], median_recovery: float = 0.98,
                   **fields: Any) -> RecipeMetrics:
    """metrics/ptq/<recipe>.json of a recipe that ran: its scores (tasks with their recovery) and
    median recovery, with an interval around it unless `median_recovery_ci=` says otherwise."""
    return RecipeMetrics(**{
        **_ptq_fields(recipe, tasks), "median_recovery": median_recovery,
        "median_recovery_ci": (median_recovery - 0.01, median_recovery + 0.005),
        "recovery_interval": "95 % paired bootstrap over eval items, 2000 resamples, seed 0", **fields})


def selection(selected: str | None, table: list[RecipeRow], **fields: Any) -> SelectionResult:
    return SelectionResult(**{"selected": selected, "policy": "qad", "band": (0.95, 0.99),
                              "reason": f"{selected}: the most compressed recipe at or above the band's floor.",
                              "table": table, "runner_up": None, "could_compress_further": False, **fields})


def race_result(stopped: dict[str, RaceStop] | None = None, recipes: tuple[str, ...] = ("a", "b"),
                **fields: Any) -> RaceResult:
    stopped = stopped or {}
    candidates = [RaceCandidate(name=r, items=stopped[r].items if r in stopped else 548, reused=0,
                                stopped=stopped.get(r)) for r in recipes]
    spent = sum(c.items for c in candidates)
    return RaceResult(**{"fractions": [0.25, 0.5, 1.0], "confidence": 0.95, "tail": 0.0125, "floor": 0.95,
                         "rounds": [{"perplexity": 12}, {"perplexity": 24}, {"perplexity": 48}],
                         "candidates": candidates, "items_spent": spent, "items_full": 548 * len(recipes),
                         "saved": 1 - spent / (548 * len(recipes)), **fields})


def qad_training(steps: int = 5, **fields: Any) -> QADTraining:
    losses = [{"step": s, "loss": 0.5 / s, "lr": 1e-4 * (1 - s / 10)} for s in range(1, steps + 1)]
    return QADTraining(**{
        "losses": losses, "steps": steps, "resumed_from": 0, "final_loss": losses[-1]["loss"],
        "first_loss": losses[0]["loss"], "steps_per_second": 0.5, "tokens_per_step": 2048,
        "tokens_per_second": 1024.0, "seconds": 10.0, "world_size": 1, "sharding": None, "compute_dtype": "float32",
        "gradient_checkpointing": False, "peak_gpu_memory_gb": None, **fields})


def qad_metrics(recipe: str, tasks: dict[str, TaskScore], median_recovery: float, **fields: Any) -> QADMetrics:
    return QADMetrics(**{
        "recipe": recipe, "tasks": tasks, "kl_divergence": 0.005,
        "kl_estimator": "exact over the top 32 tokens + 32 tail samples per position",
        "median_recovery": median_recovery, "median_recovery_ci": (median_recovery - 0.01, median_recovery + 0.005),
        "recovery_interval": "95 % paired bootstrap over eval items, 2000 resamples, seed 0",
        "ptq_median_recovery": 0.97, "ptq_median_recovery_ci": (0.96, 0.975), "qad_beats_ptq": median_recovery > 0.97,
        "steps": 5, "final_loss": 0.1, "first_loss": 0.5, "steps_per_second": 0.5, "table": [], **fields})


def serving_notes(folder: Path) -> ServingNotes:
    return ServingNotes(
        quant_algo="NVFP4", kv_cache_quant_algo="FP8", blackwell="native NVFP4 W4A4 on FP4 tensor cores (SM100+)",
        hopper="no FP4 tensor cores (SM90): NVFP4 weights run as W4A16",
        vllm=f"vllm serve {folder} --quantization modelopt_fp4 --kv-cache-dtype fp8",
        tensorrt_llm=f"trtllm-serve {folder}", sglang=f"python -m sglang.launch_server --model-path {folder}",
        checked="vllm")


def export_metrics(folder: Path, **fields: Any) -> ExportMetrics:
    """metrics/export.json as run_export writes it (its keys; made-up values), every check passed."""
    layer_formats = {**{f"layers.{i}.mlp.up_proj": "nvfp4" for i in range(8)}, "embed_tokens": "bf16",
                     "lm_head": "bf16"}
    layers_by_format = {"nvfp4": 8, "bf16": 2}
    summary = "serving check passed: level full, KL 0.00005"
    checks = {
        "formats": {"passed": True, "problems": [], "layer_formats": layer_formats,
                    "layers_by_format": layers_by_format},
        "size": {"passed": True, "expected_bpe": 4.55, "relative_difference": 0.001, "tolerance": 0.01,
                 "effective_bpe": 4.5546, "tensor_bytes": 640_000, "elements": 1_000_000,
                 "bf16_size_bytes": 2_000_000},
        "reload": {"passed": True, "kl_divergence": 2e-4, "tolerance": 1e-3, "top1_agreement": 0.98,
                   "max_abs_logit_diff": 0.01,
                   "compared": "student with weight quantizers only vs dequantized export, bf16, mean KL per token"},
        "serving": {"vllm_version": "0.32.0", "quantization": "modelopt_fp4", "kv_cache_dtype": "fp8",
                    "architecture": "LlamaForCausalLM", "config_problems": [], "layers_checked": 10,
                    "thresholds": {"kl_divergence_max": 0.05, "top1_agreement_min": 0.9, "decided_margin_nats": 1.0},
                    "level": "full", "logprobs_per_position": 20, "served_kv_cache_dtype": "fp8",
                    "kv_cache_fallback": None, "kl_divergence": 5e-5, "kl_max_position": 2e-3,
                    "top1_agreement": 0.99, "decided_positions": 126, "positions": 252, "passed": True,
                    "seconds": 40.0, "summary": summary},
    }
    return ExportMetrics(**{
        "path": str(folder), "source": "qad", "size_bytes": 640_064, "bf16_size_bytes": 2_000_000, "size_ratio": 2_000_000 / 640_064,
        "effective_bpe": 4.5546, "layer_formats": layer_formats, "layers_by_format": layers_by_format,
        "repaired_layer_names": 0, "checks": checks, "serving": serving_notes(folder),
        "serving_check": {"level": "full", "summary": summary}, "passed": True, **fields})


def every_model(folder: Path) -> list[Any]:
    """One instance of every result model (each variant of the PTQ files), for round trips."""
    tasks = {"heldout_cloze": score(0.5, all={"acc": 0.5}), "perplexity": score(40.0, "perplexity", False)}
    recovered = {"heldout_cloze": score(0.49, all={"acc": 0.49}, recovery=0.98, recovery_ci=(0.96, 1.0)),
                 "perplexity": score(41.0, "perplexity", False, recovery=0.9756, recovery_ci=(0.97, 0.98))}
    rows = [RecipeRow("a", "ok", 0.98, 4.75, "fp8", median_recovery_ci=(0.97, 0.985), settings={"kv_cache": "fp8"}),
            RecipeRow("b", "alias", 0.98, 4.75, "fp8", alias_of="a"), RecipeRow("c", "failed", error="killed")]
    chosen = selection("a", rows)
    return [
        manifest(), baseline(tasks), ptq_scores("a", tasks),
        PTQAlias(recipe="b", status="alias", alias_of="a", started_at=1000.0, finished_at=1001.0),
        recipe_metrics("a", recovered), RecipeFailed(recipe="c", status="failed", error="no scores"),
        RecipeAlias(recipe="b", status="alias", alias_of="a"), chosen,
        RecoveryTable([{"recipe": "a", "effective_bpe": 4.75, "median_recovery": 0.98, "ci_low": 0.97,
                        "ci_high": 0.985}]),
        qad_training(), LossCurve(qad_training().losses), qad_metrics("a", recovered, 0.985),
        export_metrics(folder), serving_notes(folder),
        RunSummary(selection=chosen, recipes=[{"name": "a", "median rec. %": 98.0}], failed=["c"],
                   seconds={"selection": 1.0}, root=str(folder), qad=qad_metrics("a", recovered, 0.985),
                   export=export_metrics(folder), plots=[], mlflow={"error": "unreachable"}, dvc="recorded"),
    ]


def result_files(layout: Layout, recipes: list[str]) -> list[tuple[Path, Any]]:
    """Every result file a run under `layout` can hold, with its model, in pipeline order."""
    return [
        (layout.data / "manifest.json", CalibrationManifest),
        (layout.baseline_metrics, BaselineMetrics),
        *((layout.ptq(r) / "scores.json", PTQResult) for r in recipes),
        (layout.race_metrics, RaceResult),
        *((layout.race(r) / "scores.json", PTQResult) for r in recipes),
        *((layout.ptq_metrics(r), RecipeResult) for r in recipes),
        (layout.selection_metrics, SelectionResult),
        (layout.recovery_table, RecoveryTable),
        (layout.qad / "loss.json", QADTraining),
        (layout.qad_loss, LossCurve),
        (layout.qad_metrics, QADMetrics),
        (layout.export_metrics, ExportMetrics),
        (layout.export / "serving.json", ServingNotes),
        (layout.served_metrics, ServedEval),
    ]
