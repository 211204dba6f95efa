"""What a whole run writes beside the stages: the MLflow record and the run summary (every report's input)."""

from __future__ import annotations

from typing import Any

from qad_pipeline.results.base import Strict
from qad_pipeline.results.export_metrics import ExportMetrics
from qad_pipeline.results.qad_metrics import QADMetrics
from qad_pipeline.results.selection_metrics import SelectionResult
from qad_pipeline.results.served import ServedEval
from qad_pipeline.results.sweep_metrics import BPESweep


class TrackingRecord(Strict):  # artifacts/mlflow_run.json (flows/pipeline.py, qad-pipeline log-mlflow)
    """Which MLflow run holds this out-root's pipeline run, and whether it is logged whole."""

    uri: str  # the tracking store, secrets masked
    run_id: str
    logged: bool  # every file logged and the run ended; False: started, or cut short (log-mlflow completes it)
    model_version: str | None = None


class RunSummary(Strict):
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
    settled: list[str] = []  # what the memory plan chose for the `auto` keys (flows/runtime.py: Job.settled)
    qad: QADMetrics | None = None
    export: ExportMetrics | None = None
    served: ServedEval | None = None  # with eval.backend vllm: the export scored as vLLM serves it
    sweep: BPESweep | None = None  # when the run swept first (selection.sweep set)
    # the report's section of each stage that declares one (`Stage.report`), by stage: its lines
    sections: dict[str, list[str]] = {}
    plots: list[str] = []
    mlflow: dict[str, Any] = {}  # flows/pipeline.py: track: uri, run id, model version; or error
    dvc: str | None = None
