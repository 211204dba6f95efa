"""Final evaluation: `qad-pipeline stage final_eval`.

Scores the QAD student on the same tasks as the PTQ stage (lm-eval tasks, perplexity, KL to the
BF16 reference the baseline wrote) and writes `metrics/qad.json`: its per-task scores and median recovery next to the
selected PTQ recipe's, and one table with BF16, the PTQ recipe and QAD.
"""

from __future__ import annotations

from qad_pipeline.artifacts import read_json, write_json
from qad_pipeline.config import Params
from qad_pipeline.layout import Layout
from qad_pipeline.recovery import score_recovery


def comparison_table(baseline: dict, ptq: dict, qad: dict, recipe: str) -> list[dict]:
    """One row each for BF16, the selected PTQ recipe and QAD: per-task score and recovery."""
    rows = []
    for name, m in (("bf16", baseline), (f"ptq:{recipe}", ptq), ("qad", qad)):
        row = {"name": name}
        for task, score in m["tasks"].items():
            row[task] = score["value"]
            row[f"{task}_recovery"] = score.get("recovery", 1.0)
        row["median_recovery"] = m.get("median_recovery", 1.0)
        row["kl_divergence"] = m.get("kl_divergence", 0.0)
        rows.append(row)
    return rows


def run_final_eval(params: Params, layout: Layout) -> dict:
    """Stage core: evaluate the QAD student against the BF16 baseline; write metrics/qad.json."""
    import torch

    import qad_pipeline  # noqa: F401  (CPU NVFP4 kernels when there is no GPU)
    from qad_pipeline.modeling import load_model, load_tokenizer
    from qad_pipeline.tasks.evaluate import evaluate_model

    selection = read_json(layout.selection_metrics)
    recipe = selection["selected"]
    baseline = read_json(layout.baseline_metrics)
    ptq = read_json(layout.ptq_metrics(recipe))
    student = load_model(params.base_model, params.hardware, folder=layout.qad / "model", dtype=torch.bfloat16)
    scores = evaluate_model(student, load_tokenizer(params.base_model), params.eval, layout.data, layout.reference)
    items = scores.pop("items")
    baseline_items = read_json(layout.items("baseline")) if layout.items("baseline").is_file() else None
    scored = score_recovery(scores, items, baseline, baseline_items)
    write_json(layout.items("final_eval"), items)
    training = read_json(layout.qad / "loss.json")
    metrics = {
        "recipe": recipe,
        **scored,
        "ptq_median_recovery": ptq["median_recovery"],
        "ptq_median_recovery_ci": ptq.get("median_recovery_ci"),
        "qad_beats_ptq": scored["median_recovery"] > ptq["median_recovery"],
        "steps": training["steps"],
        "final_loss": training["final_loss"],
        "first_loss": training["first_loss"],
        "steps_per_second": training["steps_per_second"],
    }
    metrics["table"] = comparison_table(baseline, ptq, metrics, recipe)
    write_json(layout.qad_metrics, metrics)
    return metrics


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """The final evaluation: `qad-pipeline stage final_eval`."""
    m = run_final_eval(params, layout)
    return f"final eval: QAD median recovery {m['median_recovery']:.4f} vs PTQ {m['ptq_median_recovery']:.4f}"
