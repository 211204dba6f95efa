"""The cached teacher stage: `qad-pipeline stage teacher_cache` (only with `qad.teacher: cached`).

Runs the BF16 teacher once over the training windows QAD will draw and writes its next-token
distribution at `qad.temperature` in bounded form (top k + tail samples) to
artifacts/teacher_cache/, which QAD then reads instead of loading the teacher
(`qad_pipeline/training/cached_teacher.py` has the format and the loss estimator). It needs only the
calibration data, so it runs beside the baseline and the PTQ recipes.
"""

from __future__ import annotations

from qad_pipeline.core.artifacts import staged_dir
from qad_pipeline.core.config import Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.core.modeling import load_model, load_tokenizer
from qad_pipeline.training.cached_teacher import write_cache
from qad_pipeline.training.training_text import training_windows


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """The teacher_cache stage."""
    windows = training_windows(params, load_tokenizer(params.base_model), layout.data)
    teacher = load_model(params.base_model, params.hardware).requires_grad_(False).eval()
    with staged_dir(layout.teacher_cache) as tmp:
        manifest = write_cache(teacher, windows, params, tmp, params.eval.batch_size)
    tokens = len(manifest["windows"]) * manifest["seq_len"]
    return (f"teacher_cache: {len(manifest['windows'])} windows x {manifest['seq_len']} tokens, "
            f"{manifest['bytes_per_token']} bytes per token ({tokens * manifest['bytes_per_token'] / 2**20:.1f} MiB)")
