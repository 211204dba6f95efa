"""Where each stage reads and writes, relative to an output root (`output_root`: never the source tree by default).

One name per thing: the DVC stage, the Prefect task, the artifact folder and the metrics file of
a stage share its name (`calibration`, `baseline`, `ptq/<recipe>`, `selection`); what each stage
writes is declared in `qad_pipeline.core.stages`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from qad_pipeline.core.config import PROJECT_ROOT

OUT_ROOT_ENV = "QAD_OUT_ROOT"  # a folder under which each run gets <params file stem>/
RUNS = "runs"  # git- and dvc-ignored; the image's shared volume is mounted over /opt/qad-pipeline/runs


def output_root(out_root: str | Path | None, params_file: str | Path) -> Path:
    """The folder that receives artifacts/ and metrics/, the first of:

    1. `out_root` (`--out-root`), as given;
    2. `$QAD_OUT_ROOT/<params file stem>`;
    3. the params file's folder, when it lies outside this source tree (a project of your own with
       params.yaml and dvc.yaml: `dvc repro` and `qad-pipeline run` write to the same place);
    4. `runs/<params file stem>` under the working directory, or under the source tree's root when
       the working directory is inside it (this repository's params.yaml and profiles/: a run never
       writes into the source tree's tracked folders).
    """
    if out_root:
        return Path(out_root).resolve()
    params = Path(params_file).resolve()
    if os.environ.get(OUT_ROOT_ENV, "").strip():
        return (Path(os.environ[OUT_ROOT_ENV].strip()).expanduser() / params.stem).resolve()
    if not params.is_relative_to(PROJECT_ROOT):
        return params.parent
    here = Path.cwd().resolve()
    return (PROJECT_ROOT if here.is_relative_to(PROJECT_ROOT) else here) / RUNS / params.stem


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "artifacts" / "calibration"

    @property
    def baseline(self) -> Path:
        """The baseline's artifact folder: the BF16 reference distribution (`reference/`)."""
        return self.root / "artifacts" / "baseline"

    @property
    def reference(self) -> Path:
        return self.baseline / "reference"

    def ptq(self, recipe: str) -> Path:
        return self.root / "artifacts" / "ptq" / recipe

    def ptq_layerwise(self, recipe: str) -> Path:
        """A recipe's per-layer calibration checkpoints while it runs layerwise (outside its artifact
        folder, which the stage clears before it runs, so a killed recipe resumes from them)."""
        return self.root / "artifacts" / "ptq_layerwise" / recipe

    @property
    def sweep_search(self) -> Path:
        """The BPE sweep's one AutoQuantize search: Model Optimizer's state (`state.pt`), `search.json`."""
        return self.root / "artifacts" / "sweep_search"

    def sweep(self, budget: str) -> Path:
        """One sweep point, as a PTQ recipe's folder: `checkpoint/`, `scores.json`, `items.json`."""
        return self.root / "artifacts" / "sweep" / budget

    def candidate(self, name: str) -> Path:
        """A selection candidate's PTQ folder: a recipe's, or a sweep point's (`<recipe>@<budget>`)."""
        return self.sweep(name.rpartition("@")[2]) if "@" in name else self.ptq(name)

    def race(self, name: str) -> Path:
        """A raced candidate's merged scores and items, and each round's items (`round<k>.json`)."""
        return self.root / "artifacts" / "race" / name

    @property
    def race_metrics(self) -> Path:
        return self.metrics / "race.json"

    @property
    def bpe_sweep(self) -> Path:
        """The sweep's plot folder (`bpe_plot`)."""
        return self.root / "artifacts" / "bpe_sweep"

    @property
    def bpe_plot(self) -> Path:
        """The sweep's Pareto plot."""
        return self.bpe_sweep / "pareto.png"

    @property
    def bpe_sweep_metrics(self) -> Path:
        """The sweep's points, the knee and its reason."""
        return self.metrics / "bpe_sweep.json"

    @property
    def bpe_curve(self) -> Path:
        """The sweep's points as DVC's plot data."""
        return self.metrics / "bpe_curve.json"

    def items(self, stage: str, recipe: str | None = None) -> Path:
        """A scored model's per-item values (for the recovery's confidence interval)."""
        folder = {"baseline": self.baseline, "ptq": self.ptq(recipe) if recipe else None,
                  "final_eval": self.final_eval}[stage]
        return folder / "items.json"

    @property
    def final_eval(self) -> Path:
        return self.root / "artifacts" / "final_eval"

    @property
    def qad(self) -> Path:
        return self.root / "artifacts" / "qad"

    @property
    def teacher_cache(self) -> Path:
        return self.root / "artifacts" / "teacher_cache"

    @property
    def qad_checkpoints(self) -> Path:
        return self.root / "artifacts" / "qad_checkpoints"

    @property
    def export(self) -> Path:
        return self.root / "artifacts" / "export"

    @property
    def served_eval(self) -> Path:
        """Each model's per-item values as vLLM served it (the served eval, eval.backend vllm)."""
        return self.root / "artifacts" / "served_eval"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def tracking_record(self) -> Path:
        """Which MLflow run this out-root's pipeline run is logged in (`results.TrackingRecord`)."""
        return self.root / "artifacts" / "mlflow_run.json"

    @property
    def baseline_metrics(self) -> Path:
        return self.metrics / "baseline.json"

    def ptq_metrics(self, recipe: str) -> Path:
        return self.metrics / "ptq" / f"{recipe}.json"

    @property
    def selection_metrics(self) -> Path:
        return self.metrics / "selection.json"

    @property
    def recovery_table(self) -> Path:
        """Median recovery and bits per element per recipe: the data of DVC's recovery plot."""
        return self.metrics / "recovery.json"

    @property
    def qad_loss(self) -> Path:
        """The QAD loss per step: the data of DVC's loss plot."""
        return self.metrics / "qad_loss.json"

    @property
    def qad_metrics(self) -> Path:
        return self.metrics / "qad.json"

    @property
    def export_metrics(self) -> Path:
        return self.metrics / "export.json"

    @property
    def served_metrics(self) -> Path:
        return self.metrics / "served.json"

    @property
    def logs(self) -> Path:
        return self.root / "artifacts" / "logs"
