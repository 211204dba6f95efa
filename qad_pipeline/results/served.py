"""The served evaluation's metrics/served.json (tasks/served_eval.py, with eval.backend vllm)."""

from __future__ import annotations

from typing import Any

from qad_pipeline.results.base import Strict
from qad_pipeline.results.scores import TaskScore


class InMemory(Strict):
    """The recovery the pipeline measured on the model in memory (transformers, fake quantization)."""

    stage: str  # final_eval (the QAD student) or ptq/<candidate>
    median_recovery: float
    median_recovery_ci: tuple[float, float] | None
    tasks: dict[str, float | None]  # each task's recovery
    tasks_ci: dict[str, tuple[float, float] | None] = {}  # and its interval


class ServedEval(Strict):  # metrics/served.json
    backend: str  # vllm
    ran: bool
    why_not: str | None = None  # when it did not run: why (vLLM cannot run the export here)
    export: str | None = None
    source: str | None = None  # what the export holds: qad or ptq/<candidate>
    baseline_tasks: dict[str, TaskScore] = {}  # the BF16 base model, served by vLLM
    tasks: dict[str, TaskScore] = {}  # the exported checkpoint, served by vLLM, with recovery vs the served BF16
    median_recovery: float | None = None
    median_recovery_ci: tuple[float, float] | None = None
    recovery_interval: str | None = None
    in_memory: InMemory | None = None
    agree: bool | None = None  # the served and in-memory median-recovery intervals overlap
    table: list[dict[str, Any]] = []  # per task (and the median): in-memory and served recovery, their intervals
    served: dict[str, dict[str, Any]] = {}  # per model (bf16, export): vLLM version, quantization, KV cache, seconds
    seconds: float | None = None
