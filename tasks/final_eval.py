"""Final evaluation: `qad-pipeline stage final_eval`.

Scores the QAD student on the same tasks as the PTQ stage (lm-eval tasks, perplexity, KL to the
BF16 reference the baseline wrote) and writes `metrics/qad.json`: its per-task scores and median recovery next to the
selected PTQ recipe's, and one table with BF16, the PTQ recipe and QAD.
"""

from __future__ import annotations

from typing import Any

from qad_pipeline.core.artifacts import read_json, write_json
from qad_pipeline.core.config import Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.scoring.recovery import score_recovery
from qad_pipeline.results.base import dump_result, read_result, write_result
from qad_pipeline.results.qad_metrics import QADMetrics, QADTraining
from qad_pipeline.results.scores import BaselineMetrics
from qad_pipeline.results.selection_metrics import RecipeMetrics, SelectionResult


def comparison_table(baseline: BaselineMetrics, ptq: RecipeMetrics, qad: QADMetrics,
                     recipe: str) -> list[dict[str, Any]]:
    """One row each for BF16, the selected PTQ recipe and QAD: per-task score and recovery (BF16,
    the reference, has no recovery or KL of its own: 1 and 0)."""
    rows = []
    for name, m in (("bf16", baseline), (f"ptq:{recipe}", ptq), ("qad", qad)):
        row: dict[str, Any] = {"name": name}
        for task, score in m.tasks.items():
            row[task] = score.value
            row[f"{task}_recovery"] = 1.0 if score.recovery is None else score.recovery
        row["median_recovery"] = getattr(m, "median_recovery", 1.0)
        row["kl_divergence"] = getattr(m, "kl_divergence", 0.0)
        rows.append(row)
    return rows


def run_final_eval(params: Params, layout: Layout) -> dict:
    """Stage core: evaluate the QAD student against the BF16 baseline; write metrics/qad.json."""
    import torch

    from qad_pipeline.scoring.evaluation import evaluate_model
    from qad_pipeline.core.modeling import load_model, load_tokenizer

    recipe = read_result(layout.selection_metrics, SelectionResult).selected
    baseline = read_result(layout.baseline_metrics, BaselineMetrics)
    ptq = read_result(layout.ptq_metrics(recipe), RecipeMetrics)  # a selected recipe ran ("ok")
    student = load_model(params.base_model, params.hardware, folder=layout.qad / "model", dtype=torch.bfloat16)
    scores = evaluate_model(student, load_tokenizer(params.base_model), params.eval, layout.data, layout.reference)
    items = scores.pop("items")
    baseline_items = read_json(layout.items("baseline")) if layout.items("baseline").is_file() else None
    scored = score_recovery(scores, items, dump_result(baseline), baseline_items)
    write_json(layout.items("final_eval"), items)
    training = read_result(layout.qad / "loss.json", QADTraining)
    metrics = QADMetrics(
        recipe=recipe,
        **scored,
        ptq_median_recovery=ptq.median_recovery,
        ptq_median_recovery_ci=ptq.median_recovery_ci,
        qad_beats_ptq=scored["median_recovery"] > ptq.median_recovery,
        steps=training.steps,
        final_loss=training.final_loss,
        first_loss=training.first_loss,
        steps_per_second=training.steps_per_second,
        batch_size=training.batch_size,
        grad_accum=training.grad_accum,
        world_size=training.world_size,
        table=[],
    )
    metrics.table = comparison_table(baseline, ptq, metrics, recipe)
    write_result(layout.qad_metrics, metrics)
    return dump_result(metrics)


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """The final evaluation: `qad-pipeline stage final_eval`."""
    m = run_final_eval(params, layout)
    return f"final eval: QAD median recovery {m['median_recovery']:.4f} vs PTQ {m['ptq_median_recovery']:.4f}"
