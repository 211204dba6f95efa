"""The export's metrics/export.json and its serving notes."""

from __future__ import annotations

from typing import Any


from qad_pipeline.results.base import Strict


class ServingNotes(Strict):  # what each GPU and serving engine needs; also artifacts/export/serving.json
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    blackwell: str
    hopper: str
    vllm: str
    tensorrt_llm: str
    sglang: str
    checked: str


class ServingCheck(Strict):
    level: str
    summary: str


class ExportMetrics(Strict):  # metrics/export.json (tasks/export.py: run_export)
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
