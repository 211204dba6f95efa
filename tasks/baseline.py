"""The BF16 baseline stage: `qad-pipeline stage baseline` (flow and `dvc repro`).

Scores the base model as every candidate will be scored (`qad_pipeline.scoring.evaluation`), and writes
metrics/baseline.json and the BF16 reference distribution (artifacts/baseline/reference/) that
every KL is measured against, in one pass over the held-out windows.
"""

from __future__ import annotations

from pathlib import Path

from qad_pipeline.core.artifacts import staged_dir, write_json
from qad_pipeline.core.config import Params
from qad_pipeline.scoring.evaluation import evaluate_model
from qad_pipeline.core.layout import Layout
from qad_pipeline.core.modeling import checkpoint_identity, load_model, load_tokenizer
from qad_pipeline.results.base import dump_result, write_result
from qad_pipeline.results.scores import BaselineMetrics
from qad_pipeline.nvfp4.sizes import size_report


def run_baseline(params: Params, data_dir: Path, metrics_path: Path, reference_dir: Path) -> dict:
    """Stage core: score the BF16 base model; write metrics/baseline.json and the BF16 reference."""
    model, tokenizer = load_model(params.base_model, params.hardware), load_tokenizer(params.base_model)
    with staged_dir(reference_dir) as tmp:
        scores = evaluate_model(model, tokenizer, params.eval, data_dir, write_reference=tmp)
    write_json(Path(reference_dir).parent / "items.json", scores.pop("items"))
    sizes = size_report(model)
    metrics = BaselineMetrics(model=checkpoint_identity(params.base_model), **scores,
                              effective_bpe=sizes["effective_bpe"], size_bytes=sizes["size_bytes"], status="ok")
    write_result(metrics_path, metrics)
    return dump_result(metrics)


def main(params: Params, layout: Layout, recipe: str | None = None) -> None:
    """The baseline stage: `qad-pipeline stage baseline`."""
    run_baseline(params, layout.data, layout.baseline_metrics, layout.reference)
