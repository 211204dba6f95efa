"""The pipeline's stages, each declared once: `qad-pipeline dvc-yaml` writes dvc.yaml from here.

    calibration ── baseline ── ptq × recipes ──────────────────────── (race) ── selection ── qad ── final_eval ── export ── (served_eval)
               ├── sweep_search ── sweep × budgets ── bpe_sweep ──┘   (the BPE sweep and the race, when asked for)
               └── teacher_cache ───────────────────────────────────────────────┘ (qad.teacher: cached)

A `Stage` (`qad_pipeline/core/stage_types.py`) names its entry point (`module:function`, called as
`entry(params, layout, recipe)`), the stages it waits for (`after`: the flows' edges), the
params.yaml keys it reads, its input data and the files it writes, when it runs (`when`: gates on
the params, below), the GPUs it claims, its cost and memory models for the plan, its result file
and that file's model, the function that fills its MLflow run from that result, and its report
section. Everything else reads this table, and no other module of the library or the flows names a
stage (tests/test_stages.py): the CLI's `qad-pipeline stage` dispatch and its command line
(`Stage.command`: what the flows start and `dvc repro` runs), the Prefect flows' task runs, their
edges and cache keys (`flows/runtime.py`), `dvc.yaml` (generated, and a test proves it is current),
the DVC stage names a Prefect run records, the GPU flows, the plan (`qad_pipeline.plan.memory`,
`costs`, `eval_costs`, `gpus`), the report and the MLflow runs (`qad_pipeline.tracking.children`).
Whether a stage runs is one function, `Stage.runs`, which `planned` and dvc.yaml call. A stage's
code dependencies are not listed by hand: they are the project modules its entry module imports,
directly or not, as `code_deps.code_modules` finds them in the source. The table names other
modules' objects as `module:name` strings, imported when used (`Stage.load`), so reading it imports
nothing heavy.

Adding a stage: a module under tasks/ with a `main(params, layout, recipe=None) -> str`, one
`Stage(...)` below, then `qad-pipeline dvc-yaml` (see docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qad_pipeline.core.stage_types import Gate, Output, Stage

if TYPE_CHECKING:
    from qad_pipeline.core.config import Params


def with_sweep(params: Params) -> bool:
    """A pipeline run runs the BPE sweep too: selection takes its points as candidates."""
    return params.selection.sweep != "none" and bool(params.sweep.budgets)


# -- when a stage runs: its gates (`Stage.when`), each a named predicate on (params, sweep_only) ----

# the stages from selection on: a pipeline run's, not the BPE sweep's flow (`qad-pipeline sweep`)
PIPELINE_RUN = Gate("a pipeline run, not `qad-pipeline sweep`", lambda params, sweep_only: not sweep_only)
# QAD and what evaluates its student: with `selection.policy: qad` (dvc.yaml declares them whatever the policy)
QAD_POLICY = Gate("selection.policy: qad", lambda params, sweep_only: params.selection.policy == "qad", dvc=False)
# the export and what reads it: unless `export.source: none` (dvc.yaml declares them whatever the source)
EXPORTING = Gate("export.source not none", lambda params, sweep_only: params.export.source != "none", dvc=False)
# the BPE sweep's branch: `qad-pipeline sweep`, or a pipeline run that sweeps (`with_sweep`)
SWEEPING = Gate("the BPE sweep", lambda params, sweep_only: sweep_only or with_sweep(params))
CACHED_TEACHER = Gate("qad.teacher: cached",
                      lambda params, sweep_only: not sweep_only and params.qad.teacher == "cached")
RACING = Gate("race.enabled", lambda params, sweep_only: params.race.enabled)
# scoring the export as vLLM serves it
SERVED = Gate("eval.backend: vllm", lambda params, sweep_only: not sweep_only and params.eval.backend == "vllm")

EVAL_DATA = "${eval.task_dir}"
MODEL = "${base_model.path}"
SWEEP_RECIPE = "${ptq.recipe_dir}/${sweep.recipe}.yaml"

STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("calibration", "tasks.calibration:main", after=(),
          params=("base_model.path", "base_model.revision", "base_model.trust_remote_code", "calibration",
                  "eval.seq_len", "eval.ppl_samples", "eval.num_cloze", "eval.num_continuation"),
          inputs=(MODEL, "${calibration.source}"),
          outputs=(Output("artifacts/calibration"),),
          cached=True, fingerprints=("${calibration.source}",), done=("artifacts/calibration/manifest.json",),
          result="artifacts/calibration/manifest.json", schema="qad_pipeline.results.data:CalibrationManifest",
          mlflow="qad_pipeline.tracking.children:calibration_run",
          memory="qad_pipeline.plan.memory_model:LIGHT_PROCESS_BASE",
          cost="qad_pipeline.plan.costs:CALIBRATION"),
    Stage("baseline", "tasks.baseline:main", after=("calibration",),
          params=("base_model", "eval"),
          inputs=(MODEL, EVAL_DATA, "artifacts/calibration"),
          outputs=(Output("metrics/baseline.json", "metrics"),
                   Output("artifacts/baseline", note="the BF16 reference distribution every KL is measured against")),
          gpus="qad_pipeline.plan.gpus:WHOLE_MODEL", cached=True, fingerprints=("artifacts/calibration/manifest.json",),
          done=("metrics/baseline.json", "artifacts/baseline/reference/manifest.json"),
          result="metrics/baseline.json", schema="qad_pipeline.results.scores:BaselineMetrics",
          mlflow="qad_pipeline.tracking.children:baseline_run", memory="qad_pipeline.plan.memory_model:baseline_phases",
          knobs=("eval.batch_size",),
          cost="qad_pipeline.plan.costs:BASELINE", eval_cost="qad_pipeline.plan.eval_costs:full"),
    Stage("ptq", "tasks.ptq:main", after=("calibration", "baseline"),
          params=("base_model", "ptq.recipe_dir", "ptq.calib_batch_size", "ptq.layerwise", "eval", "race"),
          inputs=(MODEL, "${ptq.recipe_dir}/{recipe}.yaml", EVAL_DATA, "artifacts/calibration", "artifacts/baseline"),
          outputs=(Output("artifacts/ptq/{recipe}"),),
          foreach="ptq.recipes", gpus="qad_pipeline.plan.gpus:RECIPE", cached=True, may_fail=True,
          fingerprints=("${ptq.recipe_dir}/{recipe}.yaml", "artifacts/calibration/manifest.json",
                        "artifacts/baseline/reference/manifest.json"),
          done=("artifacts/ptq/{recipe}/scores.json", "artifacts/ptq/{recipe}/checkpoint"),
          memory="qad_pipeline.plan.memory_model:ptq_phases",
          knobs=("ptq.calib_batch_size", "ptq.mse_chunk_rows", "eval.batch_size"),
          cost="qad_pipeline.plan.costs:PTQ", eval_cost="qad_pipeline.plan.eval_costs:first_round"),
    Stage("teacher_cache", "tasks.teacher_cache:main", after=("calibration",),
          params=("base_model", "calibration", "qad"),
          inputs=(MODEL, "${calibration.source}", "artifacts/calibration"),
          outputs=(Output("artifacts/teacher_cache", note="the teacher's top-k + tail over QAD's training windows"),),
          gpus="qad_pipeline.plan.gpus:WHOLE_MODEL", cached=True,
          fingerprints=("artifacts/calibration/manifest.json",), done=("artifacts/teacher_cache/manifest.json",),
          memory="qad_pipeline.plan.memory_model:teacher_cache_phases", knobs=("eval.batch_size",),
          when=(QAD_POLICY, CACHED_TEACHER), cost="qad_pipeline.plan.costs:TEACHER_CACHE"),
    Stage("sweep_search", "tasks.sweep_search:main", after=("calibration",),
          params=("base_model", "ptq.recipe_dir", "ptq.calib_batch_size", "sweep.recipe"),
          inputs=(MODEL, SWEEP_RECIPE, "artifacts/calibration"),
          outputs=(Output("artifacts/sweep_search", note="Model Optimizer's search state: calibrations and scores"),),
          gpus="qad_pipeline.plan.gpus:WHOLE_MODEL", cached=True,
          fingerprints=(SWEEP_RECIPE, "artifacts/calibration/manifest.json"),
          done=("artifacts/sweep_search/search.json", "artifacts/sweep_search/state.pt"),
          memory="qad_pipeline.plan.memory_model:sweep_phases",
          when=(SWEEPING,), cost="qad_pipeline.plan.costs:SWEEP_SEARCH"),
    Stage("sweep", "tasks.sweep:main", after=("calibration", "baseline", "sweep_search"),
          params=("base_model", "ptq.recipe_dir", "ptq.calib_batch_size", "sweep.recipe", "eval"),
          inputs=(MODEL, SWEEP_RECIPE, EVAL_DATA, "artifacts/calibration", "artifacts/baseline",
                  "artifacts/sweep_search"),
          outputs=(Output("artifacts/sweep/{recipe}"),),
          foreach="sweep.budgets", gpus="qad_pipeline.plan.gpus:RECIPE", cached=True, may_fail=True,
          fingerprints=(SWEEP_RECIPE, "artifacts/calibration/manifest.json",
                        "artifacts/baseline/reference/manifest.json", "artifacts/sweep_search/search.json"),
          done=("artifacts/sweep/{recipe}/scores.json", "artifacts/sweep/{recipe}/checkpoint"),
          memory="qad_pipeline.plan.memory_model:sweep_phases",
          when=(SWEEPING,), cost="qad_pipeline.plan.costs:SWEEP", eval_cost="qad_pipeline.plan.eval_costs:full"),
    Stage("bpe_sweep", "tasks.bpe_sweep:main", after=("baseline", "ptq", "sweep"),
          params=("ptq.recipes", "sweep"),
          inputs=("metrics/baseline.json", "artifacts/baseline/items.json", "artifacts/ptq", "artifacts/sweep"),
          outputs=(Output("metrics/bpe_sweep.json", "metrics"),
                   Output("metrics/bpe_curve.json", "plots", plot={
                       "template": "scatter", "x": "effective_bpe", "y": "median_recovery",
                       "title": "BPE sweep: median recovery against whole-model bits per element"}),
                   Output("artifacts/bpe_sweep", note="the Pareto plot")),
          may_fail=True, memory="qad_pipeline.plan.memory_model:SELECTION_PROCESS",
          when=(SWEEPING,), cost="qad_pipeline.plan.costs:JSON_ONLY"),
    Stage("race", "tasks.race:main", after=("baseline", "ptq", "bpe_sweep"),
          params=("base_model", "eval", "race", "ptq.recipes", "selection", "sweep"),
          inputs=(MODEL, EVAL_DATA, "artifacts/calibration", "artifacts/baseline", "metrics/baseline.json",
                  "artifacts/ptq", "metrics/bpe_sweep.json", "artifacts/sweep"),
          outputs=(Output("metrics/race.json", "metrics"),
                   Output("artifacts/race", persist=True,
                          note="each candidate's items per round (reused by a resumed race) and merged scores")),
          gpus="qad_pipeline.plan.gpus:WHOLE_MODEL",
          result="metrics/race.json", schema="qad_pipeline.results.race_metrics:RaceResult",
          mlflow="qad_pipeline.tracking.children:race_run",
          memory="qad_pipeline.plan.memory_model:final_eval_phases", knobs=("eval.batch_size",),
          when=(RACING,), cost="qad_pipeline.plan.costs:EVALUATION", eval_cost="qad_pipeline.plan.eval_costs:later_rounds"),
    Stage("selection", "tasks.selection:main", after=("baseline", "ptq", "bpe_sweep", "race"),
          params=("ptq.recipes", "selection", "sweep", "race"),
          inputs=(f"{MODEL}/config.json", "${ptq.recipe_dir}", "metrics/baseline.json",
                  "artifacts/baseline/items.json", "artifacts/ptq", "metrics/bpe_sweep.json", "artifacts/sweep",
                  "metrics/race.json", "artifacts/race"),
          outputs=(Output("metrics/selection.json", "metrics"), Output("metrics/ptq", "metrics"),
                   Output("metrics/recovery.json", "plots", plot={
                       "template": "scatter", "x": "effective_bpe", "y": "median_recovery",
                       "title": "Median recovery against effective bits per element, per PTQ recipe"})),
          result="metrics/selection.json", schema="qad_pipeline.results.selection_metrics:SelectionResult",
          mlflow="qad_pipeline.tracking.children:selection_run", memory="qad_pipeline.plan.memory_model:SELECTION_PROCESS",
          when=(PIPELINE_RUN,), cost="qad_pipeline.plan.costs:JSON_ONLY"),
    Stage("qad", "tasks.qad:main", after=("selection", "teacher_cache"),
          params=("base_model", "calibration", "qad"),
          inputs=(MODEL, "${calibration.source}", "metrics/selection.json", "artifacts/ptq", "artifacts/sweep",
                  "artifacts/calibration", "artifacts/teacher_cache"),
          outputs=(Output("artifacts/qad"),
                   Output("metrics/qad_loss.json", "plots", plot={
                       "x": "step", "y": "loss", "title": "QAD distillation loss (KL to the BF16 teacher)"})),
          gpus="qad_pipeline.plan.gpus:QAD", cached=True, after_selection=True,
          fingerprints=("metrics/selection.json", "{selected}/checkpoint", "artifacts/calibration/manifest.json",
                        "${calibration.source}", "${qad.source}", "artifacts/teacher_cache/manifest.json"),
          done=("artifacts/qad/loss.json", "artifacts/qad/model", "metrics/qad_loss.json"),
          result="artifacts/qad/loss.json", schema="qad_pipeline.results.qad_metrics:QADTraining",
          mlflow="qad_pipeline.tracking.children:qad_run",
          memory="qad_pipeline.plan.memory_model:qad_phases", knobs=("qad.batch_size", "qad.seq_len"),
          when=(PIPELINE_RUN, QAD_POLICY), cost="qad_pipeline.plan.costs:QAD"),
    Stage("final_eval", "tasks.final_eval:main", after=("qad",),
          params=("base_model", "eval"),
          inputs=(MODEL, EVAL_DATA, "artifacts/calibration", "artifacts/baseline", "artifacts/qad",
                  "metrics/baseline.json", "metrics/selection.json", "metrics/ptq"),
          outputs=(Output("metrics/qad.json", "metrics"), Output("artifacts/final_eval")),
          gpus="qad_pipeline.plan.gpus:WHOLE_MODEL", cached=True, after_selection=True,
          fingerprints=("artifacts/qad/loss.json", "metrics/selection.json", "artifacts/calibration/manifest.json",
                        "artifacts/baseline/reference/manifest.json"),
          done=("metrics/qad.json", "artifacts/final_eval"),
          result="metrics/qad.json", schema="qad_pipeline.results.qad_metrics:QADMetrics",
          mlflow="qad_pipeline.tracking.children:final_eval_run",
          memory="qad_pipeline.plan.memory_model:final_eval_phases", knobs=("eval.batch_size",),
          when=(PIPELINE_RUN, QAD_POLICY), cost="qad_pipeline.plan.costs:EVALUATION",
          eval_cost="qad_pipeline.plan.eval_costs:full"),
    Stage("export", "tasks.export:main", after=("selection", "final_eval"),
          params=("base_model", "selection.policy", "export"),
          inputs=(MODEL, "serving", "artifacts/calibration", "artifacts/qad", "artifacts/ptq", "artifacts/sweep",
                  "metrics/selection.json"),
          outputs=(Output("metrics/export.json", "metrics"), Output("artifacts/export", cleared=False)),
          gpus="qad_pipeline.plan.gpus:WHOLE_MODEL", cached=True, after_selection=True,
          fingerprints=("metrics/selection.json", "{selected}/checkpoint", "artifacts/qad/loss.json",
                        "artifacts/calibration/manifest.json"),
          done=("metrics/export.json", "artifacts/export"),
          result="metrics/export.json", schema="qad_pipeline.results.export_metrics:ExportMetrics",
          mlflow="qad_pipeline.tracking.children:export_run",
          memory="qad_pipeline.plan.memory_model:export_phases", knobs=("eval.batch_size",),
          when=(PIPELINE_RUN, EXPORTING), cost="qad_pipeline.plan.costs:EXPORT"),
    Stage("served_eval", "tasks.served_eval:main", after=("export",),
          params=("base_model", "eval"),
          inputs=(MODEL, EVAL_DATA, "serving", "artifacts/calibration", "artifacts/export", "metrics/export.json",
                  "metrics/qad.json", "metrics/ptq"),
          outputs=(Output("metrics/served.json", "metrics"),
                   Output("artifacts/served_eval", note="per-item values of the BF16 model and the export, served")),
          gpus="qad_pipeline.plan.gpus:WHOLE_MODEL", cached=True, after_selection=True,
          fingerprints=("metrics/export.json", "metrics/qad.json", "artifacts/calibration/manifest.json",
                        "artifacts/baseline/reference/manifest.json"),
          done=("metrics/served.json",),
          result="metrics/served.json", schema="qad_pipeline.results.served:ServedEval",
          mlflow="qad_pipeline.tracking.children:served_eval_run",
          memory="qad_pipeline.plan.memory_model:final_eval_phases", knobs=("eval.batch_size",),
          when=(PIPELINE_RUN, EXPORTING, SERVED), cost="qad_pipeline.plan.costs:EVALUATION",
          eval_cost="qad_pipeline.plan.eval_costs:served"),
)}

# The stages other modules read by what they hold (the report's and MLflow's sections, the plan's
# disk terms, the flows' recipe deployment): named here, so that no other module spells a stage.
CALIBRATION, BASELINE, RECIPES, TEACHER_CACHE, SWEEP_POINTS, BPE_SWEEP, SELECTION, QAD, FINAL_EVAL, EXPORT = (
    STAGES[name] for name in ("calibration", "baseline", "ptq", "teacher_cache", "sweep", "bpe_sweep", "selection",
                              "qad", "final_eval", "export"))

# what `gpu-stage` runs: the recipes too, for a run with a `stage_deployment` and no `recipe_deployment`
GPU_STAGES = tuple(s.name for s in STAGES.values() if s.gpu)


def stage_of(key: str) -> tuple[Stage, str | None]:
    """The stage and item of a summary key (`ptq/<recipe>`, `qad`): an unknown stage is an error."""
    name, _, item = key.partition("/")
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r} (in {key!r}); the registry's: {', '.join(STAGES)}")
    return STAGES[name], item or None


def planned(params: Params, sweep_only: bool = False) -> list[tuple[Stage, str | None]]:
    """The stage processes a run starts, in order, one per item for a per-item stage: the stages
    whose gates hold (`Stage.runs`). `sweep_only`: the BPE sweep's flow (up to the knee)."""
    return [(declared, item) for declared in STAGES.values() if declared.runs(params, sweep_only)
            for item in (declared.items(params) if declared.per_recipe else [None])]
