"""QAD's loss curve (artifacts/qad/loss.json, metrics/qad_loss.json) and the final eval's
metrics/qad.json."""

from __future__ import annotations

from typing import Any

from pydantic import RootModel

from qad_pipeline.results.base import Strict
from qad_pipeline.results.scores import TaskScore


class LossPoint(Strict):
    step: int
    loss: float
    grad_norm: float | None = None  # before clipping; None in a curve written before it was recorded
    lr: float


class QADTraining(Strict):  # artifacts/qad/loss.json (tasks/qad.py: run_qad)
    losses: list[LossPoint]
    steps: int
    resumed_from: int
    final_loss: float
    first_loss: float
    steps_per_second: float | None
    tokens_per_step: int
    tokens_per_second: float | None
    seconds: float
    batch_size: int | None = None  # rows per micro-batch over all processes (qad.batch_size, as the plan settled auto)
    grad_accum: int | None = None  # micro-batches per step (None: a curve written before they were recorded)
    world_size: int
    sharding: str | None
    compute_dtype: str
    gradient_checkpointing: bool
    peak_gpu_memory_gb: float | None
    offload: bool | None = None  # with fsdp over several processes
    teacher: str = "live"  # live | cached (qad.teacher)
    num_nodes: int = 1
    teacher_bytes: int | None = None  # of the teacher's parameters and buffers, what the first process held
    student_bytes: int | None = None  # the same of the student (its shards under fsdp)
    learn_scales: str = "none"  # qad.learn_scales
    learned_scales: int = 0  # weight quantizers whose block scales were trained (lsq)


class LossCurve(RootModel[list[LossPoint]]):
    """metrics/qad_loss.json, DVC's loss plot: the QAD loss per step."""


class QADMetrics(Strict):  # metrics/qad.json (tasks/final_eval.py)
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
    batch_size: int | None = None  # QAD's micro-batch and accumulation (artifacts/qad/loss.json)
    grad_accum: int | None = None
    world_size: int | None = None
    # comparison_table: rows bf16, ptq:<recipe>, qad with `name`, each task's score and
    # `<task>_recovery`, `median_recovery`, `kl_divergence`: one column per task, so a dict
    table: list[dict[str, Any]]
