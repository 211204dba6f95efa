"""The preflight: every input read cheaply, before any stage process starts (`preflight`).

`qad-pipeline run`, `qad-pipeline stage` (by itself, as `dvc repro` runs it) and the Prefect flow
call it; a failure is one `ConfigError` line naming the input and what would be valid.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from qad_pipeline.core.config import ConfigError, Params, resolve
from qad_pipeline.core.redaction import secret_in


def check_recipes(params: Params, root: Path | None = None, sweep: bool = False) -> None:
    """Every named recipe has its file (with `sweep`, the sweep's too): an unknown name fails
    listing the ones that exist."""
    recipe_dir = resolve(params.ptq.recipe_dir, root)
    available = sorted(p.stem for p in recipe_dir.glob("*.yaml"))
    for name in [*params.ptq.recipes, *([params.sweep.recipe] if sweep else [])]:
        if not (recipe_dir / f"{name}.yaml").is_file():
            raise ConfigError(
                f"unknown recipe {name!r}: no {recipe_dir / (name + '.yaml')}; available: {available}"
            )
    exported = params.export.source.removeprefix("ptq/")
    if params.export.source.startswith("ptq/") and exported not in params.ptq.recipes and not (
            sweep and exported.startswith(f"{params.sweep.recipe}@")):
        raise ConfigError(f"export.source {params.export.source!r} is not a candidate of this run; valid: auto, qad, "
                          "none, " + ", ".join(f"ptq/{name}" for name in params.ptq.recipes))


@contextmanager
def _quiet_libraries():
    """While the preflight reads the inputs, the libraries keep their notices to themselves (datasets'
    progress bars, transformers' and Model Optimizer's warnings at import, the note that NVFP4 runs
    emulated, which every stage process that quantizes prints in its own log): a refusal is one line."""
    import logging
    import warnings

    import datasets
    import transformers

    bars, verbosity = datasets.is_progress_bar_enabled(), transformers.logging.get_verbosity()
    emulation_note = logging.getLogger("qad_pipeline.nvfp4.nvfp4_cpu")
    note_level = emulation_note.level
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    emulation_note.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        emulation_note.setLevel(note_level)
        transformers.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def preflight(params: Params, out_root: Path, memory: bool = True, tracking: bool = True, serving: bool = True,
              sweep: bool = False) -> None:
    """Every check that needs no model weights, before any stage process starts; a failure is one
    `ConfigError` line. In order: the tracking store (reachable and MLflow) and the DVC remote
    (`versioning.remote` or $QAD_DVC_REMOTE; the out-root can take it), both with `tracking`, every
    recipe's file, the base model's config and sequence lengths, the eval tasks, every recipe loaded
    and validated by Model Optimizer, (with `memory`) the memory plan against this machine's free
    memory (without it, on GPU workers: against `hardware.target` when it is set), the base model's weight files (headers and sizes, no tensors), and the calibration text
    (exists, decodes, yields the samples asked for), and (with `serving`) that the serving check's
    vLLM environment exists when the export will run it. The BPE sweep's recipe and every budget
    against what its formats allow, when the run sweeps (`sweep`: the sweep's flow or one of its
    stages; a pipeline run with `selection.sweep` set). Value ranges across keys are checked when
    params.yaml is loaded."""
    from qad_pipeline.nvfp4 import autoquant
    from qad_pipeline import tracking as mlflow_tracking
    from qad_pipeline.core.calibration_data import check_calibration
    from qad_pipeline.platform.dvc_remote import check_out_root, remote_for
    from qad_pipeline.scoring.evaluation import check_tasks
    from qad_pipeline.plan.capacity import target_capacity
    from qad_pipeline.plan.memory import check_fits, plan
    from qad_pipeline.core.modeling import check_base_model, check_model_files, load_tokenizer
    from qad_pipeline.nvfp4.recipes import check_recipe
    from qad_pipeline.core.stages import with_sweep

    if tracking:
        mlflow_tracking.check_reachable(mlflow_tracking.tracking_uri(out_root))
        check_out_root(out_root, remote_for(params))  # the DVC remote the run pushes to when it ends
    check_recipes(params, sweep=sweep or with_sweep(params))
    with _quiet_libraries():
        check_base_model(
            params.base_model,
            {"calibration.seq_len": params.calibration.seq_len, "eval.seq_len": params.eval.seq_len,
             "qad.seq_len": params.qad.seq_len},
        )
        check_tasks(params.eval)
        for name in params.ptq.recipes:  # before the memory plan, which reads them
            path = params.recipe_path(name)
            found = secret_in(path.read_text(errors="replace"))
            if found:
                raise ConfigError(f"{path} holds {found}: a recipe is logged to MLflow and Prefect; remove it")
            check_recipe(path, params.base_model)
            if params.ptq.layerwise is True and autoquant.is_auto_quantize(path):
                raise ConfigError(f"ptq.layerwise: recipe {name} is an AutoQuantize recipe, whose search has no "
                                  "layerwise mode in Model Optimizer; set ptq.layerwise to auto or false")
        if sweep or with_sweep(params):
            autoquant.check_recipe(params.recipe_path(params.sweep.recipe), params.sweep.budgets, params.base_model)
        if memory:
            check_fits(plan(params, sweep_only=sweep))  # the memory plan: refuses a setting that cannot fit, naming the knob
        elif params.hardware.target:  # the stages run on GPU workers: plan for the node they are said to be
            check_fits(plan(params, target_capacity(params.hardware.target), sweep_only=sweep))
        check_model_files(params.base_model)
        check_calibration(params, load_tokenizer(params.base_model))
    if serving and not sweep and params.export.source != "none" and params.export.serving_check != "skip":
        from qad_pipeline.checks.vllm_setup import vllm_python

        vllm_python()  # the export's serving check needs it: say so now, not after QAD
    if serving and not sweep and params.eval.backend == "vllm":
        from qad_pipeline.checks.vllm_setup import check_served_eval_env

        check_served_eval_env(params)  # the served eval needs vLLM and lm-eval there: said now, not after QAD
