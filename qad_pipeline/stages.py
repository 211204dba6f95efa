"""The pipeline's stages, each declared once: `qad-pipeline dvc-yaml` writes dvc.yaml from here.

    calibration ── baseline ── ptq × recipes ──────────────────────── (race) ── selection ── qad ── final_eval ── export ── (served_eval)
               ├── sweep_search ── sweep × budgets ── bpe_sweep ──┘   (the BPE sweep and the race, when asked for)
               └── teacher_cache ───────────────────────────────────────────────┘ (qad.teacher: cached)

A `Stage` names its entry point (`module:function`, called as `entry(params, layout, recipe)`),
the stages it waits for (`after`: the flows' edges), the params.yaml keys it reads, its input
data and the files it writes, its result file and that file's model, the function that fills its
MLflow run from that result, and its memory model. Everything else reads this table: the CLI's
`qad-pipeline stage` dispatch and its command line (`Stage.command`: what the flows start and
`dvc repro` runs), the Prefect flows' task runs, their edges and cache keys (`flows/runtime.py`),
`dvc.yaml` (generated, and a test proves it is current), the DVC stage names a Prefect run
records, the GPU flows, the memory plan (`qad_pipeline.memory`) and the MLflow runs
(`qad_pipeline.tracking.children`). A stage's code dependencies are not listed by hand: they are
the project modules its entry module imports, directly or not, as `code_modules` finds them in
the source. The table names other modules' objects as `module:name` strings, imported when used
(`load_reference`), so reading it imports nothing heavy.

Adding a stage: a module under tasks/ with a `main(params, layout, recipe=None) -> str`, one
`Stage(...)` below, then `qad-pipeline dvc-yaml` (see docs/architecture.md).
"""

from __future__ import annotations

import ast
import importlib
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from qad_pipeline.config import PROJECT_ROOT

if TYPE_CHECKING:
    from collections.abc import Sequence

    from qad_pipeline.config import Params
    from qad_pipeline.layout import Layout

# The project's packages (pyproject.toml): each is the folder of its name at the project root.
PACKAGES = ("qad_pipeline", "tasks", "flows")


@dataclass(frozen=True)
class Output:
    """A path a stage writes, relative to the out-root (`{recipe}` for a per-recipe stage).

    `kind` is how DVC declares it; `cleared` outputs are removed before the stage runs, so a
    failed run leaves no stale result (the export folder is not: the export checks what it holds).
    A `persist` output is neither cleared nor removed by DVC before the stage runs (`persist: true`):
    the stage keys what it keeps there and reuses it (the race's scored items).
    """

    path: str
    kind: Literal["outs", "metrics", "plots"] = "outs"
    cleared: bool = True
    persist: bool = False
    plot: dict | None = None
    note: str = ""


@dataclass(frozen=True)
class Stage:
    name: str
    entry: str
    after: tuple[str, ...]
    params: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[Output, ...]
    foreach: str | None = None  # a per-item stage: "ptq.recipes" (one per recipe) or "sweep.budgets" (per budget)
    gpu: bool = False  # a GPU-heavy stage: a flow run on the GPU pool when the flow has `stage_deployment`
    cached: bool = False  # taken from Prefect's cache when its inputs are unchanged (flows/runtime.py: stage_cache_key)
    after_selection: bool = False  # runs on the selected candidate, when one was selected
    qad_only: bool = False  # runs only with selection.policy qad
    sweep: bool = False  # the BPE sweep's branch: `qad-pipeline sweep`; a pipeline run with selection.sweep set
    cached_teacher: bool = False  # runs only with qad.teacher cached (and selection.policy qad)
    racing: bool = False  # runs only with race.enabled (racing the recipes)
    served: bool = False  # runs only with eval.backend vllm (scoring the export as vLLM serves it)
    may_fail: bool = False  # fails alone: the stages after it wait for it whatever its end and go on without it
    # cached: the files whose bytes stand for its data inputs (a folder: its files' names, sizes and times;
    # `{selected}`: the selected candidate's folder, artifacts/ptq/<recipe> or artifacts/sweep/<budget>)
    fingerprints: tuple[str, ...] = ()
    done: tuple[str, ...] = ()  # cached: the outputs a cached result points at (gone: run again)
    result: str | None = None  # the file its MLflow run is read from and holds (a per-item stage's: its own reader)
    schema: str | None = None  # that file's model, `module:Class`
    mlflow: str | None = None  # `module:function(child, result, params)`: fills its MLflow run from the result
    # its memory model: `module:function(params, shape, device, item) -> [Phase]`, or `module:NAME`
    # holding the bytes of a process that loads no model
    memory: str | None = None
    knobs: tuple[str, ...] = ()  # the settings that lower its peak memory, which the plan names when it does not fit

    @property
    def per_recipe(self) -> bool:
        """One process per item (a recipe, a budget): `{recipe}` in its paths is the item."""
        return self.foreach is not None

    def items(self, params: Params) -> list[str]:
        """What a per-item stage runs over: recipe names, or the sweep's budgets as names (`5.0`)."""
        return params.sweep.points if self.foreach == "sweep.budgets" else list(params.ptq.recipes)

    def run_name(self, recipe: str | None = None) -> str:
        """Its Prefect task run, stage process and log name: `ptq-<recipe>`, else the stage's name."""
        return f"{self.name}-{recipe}" if recipe else self.name

    def dvc_name(self, recipe: str | None = None) -> str:
        """Its name in dvc.yaml and dvc.lock: `ptq@<recipe>` for the foreach stage."""
        return f"{self.name}@{recipe}" if recipe else self.name

    def summary_key(self, recipe: str | None = None) -> str:
        """Its key in the run summary's `seconds` and the artifact folder: `ptq/<recipe>`."""
        return f"{self.name}/{recipe}" if recipe else self.name

    def output_paths(self, root: Path, recipe: str | None = None, cleared_only: bool = False) -> list[Path]:
        if self.per_recipe and recipe is None:
            return []
        return [root / fill(o.path, recipe) for o in self.outputs
                if (o.cleared and not o.persist) or not cleared_only]

    def clear_outputs(self, root: Path, recipe: str | None = None) -> None:
        for path in self.output_paths(root, recipe, cleared_only=True):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def run(self, params: Params, layout: Layout, recipe: str | None = None) -> str | None:
        """Clear its outputs, then run its entry point; the one line it reports (None: nothing to say)."""
        self.clear_outputs(layout.root, recipe)
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)(params, layout, recipe)

    @property
    def module(self) -> str:
        return self.entry.split(":")[0]

    def command(self, item: str | None = None, params_file: str | None = None, out_root: str | None = None,
                overrides: Sequence[str] = ()) -> list[str]:
        """Its command line, `qad-pipeline stage <name> [<item>] [--params F] [--out-root D] [--set k=v ...]`:
        what the flows start (`flows/stages.py`), `dvc repro` runs (dvc.yaml's `cmd`) and tests call."""
        cmd = ["qad-pipeline", "stage", self.name, *([item] if item else [])]
        cmd += ["--params", params_file] if params_file else []
        cmd += ["--out-root", out_root] if out_root else []
        return cmd + [arg for value in overrides for arg in ("--set", value)]

    def code_files(self) -> list[Path]:
        """The project's source files this stage runs: its entry module and all it imports."""
        return [module_file(m) for m in code_modules(self.module)]


def load_reference(reference: str):
    """The object a `module:name` reference of the table names (imported now)."""
    module, name = reference.split(":")
    return getattr(importlib.import_module(module), name)


def fill(template: str, recipe: str | None) -> str:
    """A declared path for one recipe (`{recipe}`; the `${...}` of params.yaml are DVC's to fill)."""
    return template.replace("{recipe}", recipe) if recipe is not None else template


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
          memory="qad_pipeline.memory_model:LIGHT_PROCESS_BASE"),
    Stage("baseline", "tasks.baseline:main", after=("calibration",),
          params=("base_model", "eval"),
          inputs=(MODEL, EVAL_DATA, "artifacts/calibration"),
          outputs=(Output("metrics/baseline.json", "metrics"),
                   Output("artifacts/baseline", note="the BF16 reference distribution every KL is measured against")),
          gpu=True, cached=True, fingerprints=("artifacts/calibration/manifest.json",),
          done=("metrics/baseline.json", "artifacts/baseline/reference/manifest.json"),
          result="metrics/baseline.json", schema="qad_pipeline.results.scores:BaselineMetrics",
          mlflow="qad_pipeline.tracking.children:baseline_run", memory="qad_pipeline.memory_model:baseline_phases",
          knobs=("eval.batch_size",)),
    Stage("ptq", "tasks.ptq:main", after=("calibration", "baseline"),
          params=("base_model", "ptq.recipe_dir", "ptq.calib_batch_size", "ptq.layerwise", "eval", "race"),
          inputs=(MODEL, "${ptq.recipe_dir}/{recipe}.yaml", EVAL_DATA, "artifacts/calibration", "artifacts/baseline"),
          outputs=(Output("artifacts/ptq/{recipe}"),),
          foreach="ptq.recipes", gpu=True, cached=True, may_fail=True,
          fingerprints=("${ptq.recipe_dir}/{recipe}.yaml", "artifacts/calibration/manifest.json",
                        "artifacts/baseline/reference/manifest.json"),
          done=("artifacts/ptq/{recipe}/scores.json", "artifacts/ptq/{recipe}/checkpoint"),
          memory="qad_pipeline.memory_model:ptq_phases", knobs=("ptq.calib_batch_size", "eval.batch_size")),
    Stage("teacher_cache", "tasks.teacher_cache:main", after=("calibration",),
          params=("base_model", "calibration", "qad"),
          inputs=(MODEL, "${calibration.source}", "artifacts/calibration"),
          outputs=(Output("artifacts/teacher_cache", note="the teacher's top-k + tail over QAD's training windows"),),
          gpu=True, cached=True, qad_only=True, cached_teacher=True,
          fingerprints=("artifacts/calibration/manifest.json",), done=("artifacts/teacher_cache/manifest.json",),
          memory="qad_pipeline.memory_model:teacher_cache_phases", knobs=("eval.batch_size",)),
    Stage("sweep_search", "tasks.sweep_search:main", after=("calibration",),
          params=("base_model", "ptq.recipe_dir", "ptq.calib_batch_size", "sweep.recipe"),
          inputs=(MODEL, SWEEP_RECIPE, "artifacts/calibration"),
          outputs=(Output("artifacts/sweep_search", note="Model Optimizer's search state: calibrations and scores"),),
          gpu=True, cached=True, sweep=True,
          fingerprints=(SWEEP_RECIPE, "artifacts/calibration/manifest.json"),
          done=("artifacts/sweep_search/search.json", "artifacts/sweep_search/state.pt"),
          memory="qad_pipeline.memory_model:sweep_phases"),
    Stage("sweep", "tasks.sweep:main", after=("calibration", "baseline", "sweep_search"),
          params=("base_model", "ptq.recipe_dir", "ptq.calib_batch_size", "sweep.recipe", "eval"),
          inputs=(MODEL, SWEEP_RECIPE, EVAL_DATA, "artifacts/calibration", "artifacts/baseline",
                  "artifacts/sweep_search"),
          outputs=(Output("artifacts/sweep/{recipe}"),),
          foreach="sweep.budgets", gpu=True, cached=True, sweep=True, may_fail=True,
          fingerprints=(SWEEP_RECIPE, "artifacts/calibration/manifest.json",
                        "artifacts/baseline/reference/manifest.json", "artifacts/sweep_search/search.json"),
          done=("artifacts/sweep/{recipe}/scores.json", "artifacts/sweep/{recipe}/checkpoint"),
          memory="qad_pipeline.memory_model:sweep_phases"),
    Stage("bpe_sweep", "tasks.bpe_sweep:main", after=("baseline", "ptq", "sweep"),
          params=("ptq.recipes", "sweep"),
          inputs=("metrics/baseline.json", "artifacts/baseline/items.json", "artifacts/ptq", "artifacts/sweep"),
          outputs=(Output("metrics/bpe_sweep.json", "metrics"),
                   Output("metrics/bpe_curve.json", "plots", plot={
                       "template": "scatter", "x": "effective_bpe", "y": "median_recovery",
                       "title": "BPE sweep: median recovery against whole-model bits per element"}),
                   Output("artifacts/bpe_sweep", note="the Pareto plot")),
          sweep=True, may_fail=True, memory="qad_pipeline.memory_model:SELECTION_PROCESS"),
    Stage("race", "tasks.race:main", after=("baseline", "ptq", "bpe_sweep"),
          params=("base_model", "eval", "race", "ptq.recipes", "selection", "sweep"),
          inputs=(MODEL, EVAL_DATA, "artifacts/calibration", "artifacts/baseline", "metrics/baseline.json",
                  "artifacts/ptq", "metrics/bpe_sweep.json", "artifacts/sweep"),
          outputs=(Output("metrics/race.json", "metrics"),
                   Output("artifacts/race", persist=True,
                          note="each candidate's items per round (reused by a resumed race) and merged scores")),
          gpu=True, racing=True,
          result="metrics/race.json", schema="qad_pipeline.results.race:RaceResult",
          mlflow="qad_pipeline.tracking.children:race_run",
          memory="qad_pipeline.memory_model:final_eval_phases", knobs=("eval.batch_size",)),
    Stage("selection", "tasks.selection:main", after=("baseline", "ptq", "bpe_sweep", "race"),
          params=("ptq.recipes", "selection", "sweep", "race"),
          inputs=(f"{MODEL}/config.json", "${ptq.recipe_dir}", "metrics/baseline.json",
                  "artifacts/baseline/items.json", "artifacts/ptq", "metrics/bpe_sweep.json", "artifacts/sweep",
                  "metrics/race.json", "artifacts/race"),
          outputs=(Output("metrics/selection.json", "metrics"), Output("metrics/ptq", "metrics"),
                   Output("metrics/recovery.json", "plots", plot={
                       "template": "scatter", "x": "effective_bpe", "y": "median_recovery",
                       "title": "Median recovery against effective bits per element, per PTQ recipe"})),
          result="metrics/selection.json", schema="qad_pipeline.results.selection:SelectionResult",
          mlflow="qad_pipeline.tracking.children:selection_run", memory="qad_pipeline.memory_model:SELECTION_PROCESS"),
    Stage("qad", "tasks.qad:main", after=("selection", "teacher_cache"),
          params=("base_model", "calibration", "qad"),
          inputs=(MODEL, "${calibration.source}", "metrics/selection.json", "artifacts/ptq", "artifacts/sweep",
                  "artifacts/calibration", "artifacts/teacher_cache"),
          outputs=(Output("artifacts/qad"),
                   Output("metrics/qad_loss.json", "plots", plot={
                       "x": "step", "y": "loss", "title": "QAD distillation loss (KL to the BF16 teacher)"})),
          gpu=True, cached=True, after_selection=True, qad_only=True,
          fingerprints=("metrics/selection.json", "{selected}/checkpoint", "artifacts/calibration/manifest.json",
                        "${calibration.source}", "${qad.source}", "artifacts/teacher_cache/manifest.json"),
          done=("artifacts/qad/loss.json", "artifacts/qad/model", "metrics/qad_loss.json"),
          result="artifacts/qad/loss.json", schema="qad_pipeline.results.qad:QADTraining",
          mlflow="qad_pipeline.tracking.children:qad_run",
          memory="qad_pipeline.memory_model:qad_phases", knobs=("qad.batch_size", "qad.seq_len")),
    Stage("final_eval", "tasks.final_eval:main", after=("qad",),
          params=("base_model", "eval"),
          inputs=(MODEL, EVAL_DATA, "artifacts/calibration", "artifacts/baseline", "artifacts/qad",
                  "metrics/baseline.json", "metrics/selection.json", "metrics/ptq"),
          outputs=(Output("metrics/qad.json", "metrics"), Output("artifacts/final_eval")),
          gpu=True, cached=True, after_selection=True, qad_only=True,
          fingerprints=("artifacts/qad/loss.json", "metrics/selection.json", "artifacts/calibration/manifest.json",
                        "artifacts/baseline/reference/manifest.json"),
          done=("metrics/qad.json", "artifacts/final_eval"),
          result="metrics/qad.json", schema="qad_pipeline.results.qad:QADMetrics",
          mlflow="qad_pipeline.tracking.children:final_eval_run",
          memory="qad_pipeline.memory_model:final_eval_phases", knobs=("eval.batch_size",)),
    Stage("export", "tasks.export:main", after=("selection", "final_eval"),
          params=("base_model", "selection.policy", "export"),
          inputs=(MODEL, "serving", "artifacts/calibration", "artifacts/qad", "artifacts/ptq", "artifacts/sweep",
                  "metrics/selection.json"),
          outputs=(Output("metrics/export.json", "metrics"), Output("artifacts/export", cleared=False)),
          gpu=True, cached=True, after_selection=True,
          fingerprints=("metrics/selection.json", "{selected}/checkpoint", "artifacts/qad/loss.json",
                        "artifacts/calibration/manifest.json"),
          done=("metrics/export.json", "artifacts/export"),
          result="metrics/export.json", schema="qad_pipeline.results.export:ExportMetrics",
          mlflow="qad_pipeline.tracking.children:export_run",
          memory="qad_pipeline.memory_model:export_phases", knobs=("eval.batch_size",)),
    Stage("served_eval", "tasks.served_eval:main", after=("export",),
          params=("base_model", "eval"),
          inputs=(MODEL, EVAL_DATA, "serving", "artifacts/calibration", "artifacts/export", "metrics/export.json",
                  "metrics/qad.json", "metrics/ptq"),
          outputs=(Output("metrics/served.json", "metrics"),
                   Output("artifacts/served_eval", note="per-item values of the BF16 model and the export, served")),
          gpu=True, cached=True, after_selection=True, served=True,
          fingerprints=("metrics/export.json", "metrics/qad.json", "artifacts/calibration/manifest.json",
                        "artifacts/baseline/reference/manifest.json"),
          done=("metrics/served.json",),
          result="metrics/served.json", schema="qad_pipeline.results.served:ServedEval",
          mlflow="qad_pipeline.tracking.children:served_eval_run",
          memory="qad_pipeline.memory_model:final_eval_phases", knobs=("eval.batch_size",)),
)}

# what `gpu-stage` runs: the recipes too, for a run with a `stage_deployment` and no `recipe_deployment`
GPU_STAGES = tuple(s.name for s in STAGES.values() if s.gpu)


def with_sweep(params: Params) -> bool:
    """A pipeline run runs the BPE sweep too: selection takes its points as candidates."""
    return params.selection.sweep != "none" and bool(params.sweep.budgets)


def planned(params: Params, sweep_only: bool = False) -> list[tuple[Stage, str | None]]:
    """The stage processes a run starts, in order, one per item for a per-item stage; the race only
    with `race.enabled`; QAD and final_eval only with `selection.policy: qad`, the export unless `export.source` is none (those
    after selection run only if a recipe is selected); the sweep's with `selection.sweep` set.
    `sweep_only`: the BPE sweep's flow (up to the knee)."""
    runs: list[tuple[Stage, str | None]] = []
    for declared in STAGES.values():
        if sweep_only and declared.name == "selection":
            break
        if declared.qad_only and params.selection.policy != "qad":
            continue
        if (declared.name == "export" or declared.served) and params.export.source == "none":
            continue
        if declared.sweep and not (sweep_only or with_sweep(params)):
            continue
        if declared.cached_teacher and (sweep_only or params.qad.teacher != "cached"):
            continue
        if declared.racing and not params.race.enabled:
            continue
        if declared.served and (sweep_only or params.eval.backend != "vllm"):
            continue
        runs += [(declared, r) for r in declared.items(params)] if declared.per_recipe else [(declared, None)]
    return runs


# -- code dependencies: the import graph ----------------------------------------------------------


def is_project_module(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def module_file(module: str) -> Path:
    """The source file of a project module, found in the tree without importing it: its dotted
    path is its file's path."""
    if not is_project_module(module):
        raise ValueError(f"{module} is not a module of this project (its packages: {', '.join(PACKAGES)})")
    base = PROJECT_ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def imports_of(module: str, path: Path) -> set[str]:
    """The project modules named by every import statement in `path`, function-local ones included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]  # `from pkg import module`
        else:
            continue
        found.update(n for n in names if is_project_module(n))
    return found


@cache
def code_modules(entry: str) -> tuple[str, ...]:
    """`entry` and every project module it imports, directly or not, with their packages, sorted."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_file(name)
        if not path.is_file():  # `from module import name`: a name, not a module
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a module runs its packages
        todo += imports_of(name, path)
    return tuple(sorted(seen))
