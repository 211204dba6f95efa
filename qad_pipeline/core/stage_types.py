"""What a stage of the registry (`qad_pipeline/core/stages.py`) is: a `Stage`, the `Output`s it writes
and the `Gate`s it runs under. The table names other modules' objects as `module:name` strings,
imported when used (`load_reference`), so reading it imports nothing heavy."""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from qad_pipeline.core.code_deps import code_modules, module_file

if TYPE_CHECKING:
    from collections.abc import Sequence

    from qad_pipeline.core.config import Params
    from qad_pipeline.core.layout import Layout


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
class Gate:
    """A condition on the params a stage runs under (`Stage.when`), e.g. `race.enabled`.

    `holds(params, sweep_only)`: `sweep_only` is the BPE sweep's flow (`qad-pipeline sweep`).
    dvc.yaml leaves the stage out when a gate with `dvc` fails; a gate without `dvc` is decided
    when the pipeline runs, and dvc.yaml declares the stage whatever the params say.
    """

    name: str
    holds: Callable[[Params, bool], bool]
    dvc: bool = True


@dataclass(frozen=True)
class Stage:
    name: str
    entry: str
    after: tuple[str, ...]
    params: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[Output, ...]
    foreach: str | None = None  # a per-item stage: "ptq.recipes" (one per recipe) or "sweep.budgets" (per budget)
    when: tuple[Gate, ...] = ()  # it runs when every gate holds (`runs`); none: always
    # its GPUs: `module:NAME` of a `gpus.GpuClaim` (how many one process claims, the setting that decides);
    # None: no GPU. A GPU stage is a flow run on the GPU pool when the flow has `stage_deployment`
    gpus: str | None = None
    cached: bool = False  # taken from Prefect's cache when its inputs are unchanged (flows/runtime.py: stage_cache_key)
    after_selection: bool = False  # runs on the selected candidate, when one was selected
    may_fail: bool = False  # fails alone: the stages after it wait for it whatever its end and go on without it
    # cached: the files whose bytes stand for its data inputs (a folder: its files' names, sizes and times;
    # `{selected}`: the selected candidate's folder, artifacts/ptq/<recipe> or artifacts/sweep/<budget>)
    fingerprints: tuple[str, ...] = ()
    done: tuple[str, ...] = ()  # cached: the outputs a cached result points at (gone: run again)
    result: str | None = None  # the file its MLflow run is read from and holds (a per-item stage's: its own reader)
    schema: str | None = None  # that file's model, `module:Class`
    mlflow: str | None = None  # `module:function(child, result, params)`: fills its MLflow run from the result
    # the report's section on it: `module:function(result, params) -> [lines]`, from its `result`
    # (the stages before this field have theirs in qad_pipeline/reporting/report.py, read from typed fields)
    report: str | None = None
    # its memory model: `module:function(params, shape, device, item) -> [Phase]`, or `module:NAME`
    # holding the bytes of a process that loads no model
    memory: str | None = None
    knobs: tuple[str, ...] = ()  # the settings that lower its peak memory, which the plan names when it does not fit
    cost: str | None = None  # its disk and wall time in the plan: `module:NAME` of a `costs.CostModel`
    eval_cost: str | None = None  # what one process evaluates: `module:function(params) -> EvalCost`; None: nothing

    def runs(self, params: Params, sweep_only: bool = False, dvc: bool = False) -> bool:
        """Whether it runs with these params: the one answer that the run's plan (`stages.planned`),
        `qad-pipeline sweep` (`sweep_only`) and dvc.yaml (`dvc`: its gates marked `dvc` only) read."""
        return all(gate.holds(params, sweep_only) for gate in self.when if gate.dvc or not dvc)

    def gated_by(self, gate: Gate) -> bool:
        return gate in self.when

    @property
    def gpu(self) -> bool:
        """A GPU-heavy stage: it claims GPUs, and runs on the GPU pool when the flow has one."""
        return self.gpus is not None

    @property
    def per_recipe(self) -> bool:
        """One process per item (a recipe, a budget): `{recipe}` in its paths is the item."""
        return self.foreach is not None

    @property
    def over_recipes(self) -> bool:
        """One process per PTQ recipe (`ptq.recipes`): a recipe deployment (`ptq-recipe`) runs it."""
        return self.foreach == "ptq.recipes"

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
        what the flows start (`flows/stage_process.py`), `dvc repro` runs (dvc.yaml's `cmd`) and tests call."""
        cmd = ["qad-pipeline", "stage", self.name, *([item] if item else [])]
        cmd += ["--params", params_file] if params_file else []
        cmd += ["--out-root", out_root] if out_root else []
        return cmd + [arg for value in overrides for arg in ("--set", value)]

    def load(self, field: str):
        """The object its `module:name` field `field` (`cost`, `gpus`, `memory`, ...) names, imported
        now; a stage that declares none is an error naming the stage and the field."""
        reference = getattr(self, field)
        if reference is None:
            raise ValueError(f"stage {self.name} declares no {field} (its Stage(...) in qad_pipeline/core/stages.py)")
        return load_reference(reference)

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

