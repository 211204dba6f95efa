"""The `qad-pipeline` command: `qad-pipeline run` runs the whole flow locally; `stage` runs one stage.

    qad-pipeline run                                   # the demo model, params.yaml defaults
    qad-pipeline run --base-model org/model --set calibration.num_samples=1000
    qad-pipeline stage ptq nvfp4_max-mamba_fp8-kv_fp8  # one stage, as `dvc repro` runs it
    qad-pipeline plan --set qad.seq_len=32768          # each stage's peak memory, before any weights load
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from qad_pipeline.config import (
    ConfigError,
    Params,
    StageError,
    check_recipes,
    load_params,
)
from qad_pipeline.layout import Layout, output_root
from qad_pipeline.runlock import TOKEN_ENV, run_lock

app = typer.Typer(add_completion=False, no_args_is_help=True, help="BF16 -> NVFP4 PTQ -> QAD pipeline.")

ParamsOpt = Annotated[
    Path, typer.Option("--params", help="params file with every default; relative paths in it are relative to its folder")
]
DEFAULT_PARAMS = Path("params.yaml")
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="override one parameter: section.key=value (repeatable)"),
]
BaseOpt = Annotated[
    str | None, typer.Option("--base-model", help="base model: local folder or hub id (base_model.path)")
]
RootOpt = Annotated[
    Path | None,
    typer.Option("--out-root", help="folder that receives artifacts/ and metrics/ [default: the params file's folder]"),
]


class Stage(str, Enum):
    calibration = "calibration"
    baseline = "baseline"
    ptq = "ptq"
    selection = "selection"
    qad = "qad"
    final_eval = "final_eval"
    export = "export"


def resolve_params(params_file: Path, overrides: list[str] | None, base_model: str | None) -> Params:
    items = list(overrides or [])
    if base_model is not None:
        if not base_model.strip():
            raise ConfigError("--base-model is empty: give a local model folder or a hub id such as 'org/name'")
        items.append(f"base_model.path={base_model}")
    return load_params(params_file, items)


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
    emulation_note = logging.getLogger("qad_pipeline.nvfp4_cpu")
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


def preflight(params: Params, out_root: Path, memory: bool = True, tracking: bool = True, serving: bool = True) -> None:
    """Every check that needs no model weights, before any stage process starts; a failure is one
    `ConfigError` line. In order: the tracking store (reachable and MLflow; with `tracking`), every
    recipe's file, the base model's config and sequence lengths, the eval tasks, every recipe loaded
    and validated by Model Optimizer, (with `memory`) the memory plan against this machine's free
    memory, the base model's weight files (headers and sizes, no tensors), and the calibration text
    (exists, decodes, yields the samples asked for), and (with `serving`) that the serving check's
    vLLM environment exists when the export will run it. Value ranges across keys are checked when params.yaml is
    loaded."""
    from qad_pipeline import tracking as mlflow_tracking
    from qad_pipeline.memory import check_fits, plan
    from qad_pipeline.modeling import check_base_model, check_model_files, load_tokenizer
    from qad_pipeline.tasks.calibration import check_calibration
    from qad_pipeline.tasks.evaluate import check_tasks
    from qad_pipeline.tasks.ptq import check_recipe

    if tracking:
        mlflow_tracking.check_reachable(mlflow_tracking.tracking_uri(out_root))
    check_recipes(params)
    with _quiet_libraries():
        check_base_model(
            params.base_model,
            {"calibration.seq_len": params.calibration.seq_len, "eval.seq_len": params.eval.seq_len,
             "qad.seq_len": params.qad.seq_len},
        )
        check_tasks(params.eval)
        for name in params.ptq.recipes:  # before the memory plan, which reads them
            check_recipe(params.recipe_path(name))
        if memory:
            check_fits(plan(params))  # the memory plan: refuses a setting that cannot fit, naming the knob
        check_model_files(params.base_model)
        check_calibration(params, load_tokenizer(params.base_model))
    if serving and params.selection.policy == "qad" and params.export.serving_check != "skip":
        from qad_pipeline.serving import vllm_python

        vllm_python()  # the export's serving check needs it: say so now, not after QAD


def _fail(err: Exception) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(2)


@app.command()
def run(
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    out_root: RootOpt = None,
) -> None:
    """Run the qad-pipeline Prefect flow locally and print the recipe table and the choice."""
    out_root = output_root(out_root, params_file)
    try:
        params = resolve_params(params_file, overrides, base_model)
        preflight(params, out_root)
    except ConfigError as err:
        _fail(err)
    # A local run talks to Prefect's temporary server unless PREFECT_API_URL names one; offline,
    # analytics must be off, and on a busy machine the server may need more than 20 s to start.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from qad_pipeline.flows.pipeline import StageFailed, qad_pipeline
    from qad_pipeline.report import report_text

    from qad_pipeline.runlock import LockHeld

    try:
        summary = qad_pipeline(params_file=str(params_file), overrides=list(overrides or []), out_root=str(out_root),
                               base_model=base_model)
    except (StageFailed, LockHeld) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(report_text(summary))
    tracked = summary.get("mlflow", {})
    if "run_id" in tracked:
        model = f"; registered {tracked['registered_model']} v{tracked['model_version']} @candidate" if tracked.get(
            "model_version") else ""
        typer.echo(f"MLflow: run {tracked['run_id']} in {tracked['uri']}{model}")
    if summary["selection"]["selected"] is None:
        raise typer.Exit(1)


@app.command()
def stage(
    name: Annotated[Stage, typer.Argument(help="stage to run")],
    recipe: Annotated[str | None, typer.Argument(help="recipe name (ptq only)")] = None,
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    out_root: RootOpt = None,
) -> None:
    """Run one stage by itself; the flow's tasks and `dvc repro` call exactly this."""
    try:
        params = resolve_params(params_file, overrides, base_model)
        if name is Stage.ptq:
            if recipe is None:
                raise ConfigError(f"stage ptq needs a recipe name: one of {params.ptq.recipes}")
            if recipe not in params.ptq.recipes:
                raise ConfigError(f"unknown recipe {recipe!r}: ptq.recipes lists {params.ptq.recipes}")
        if TOKEN_ENV not in os.environ:  # by itself (dvc repro, by hand); a pipeline run checked before starting it
            preflight(params, output_root(out_root, params_file), memory=False, tracking=False,
                      serving=name is Stage.export)
    except ConfigError as err:
        _fail(err)

    layout = Layout(output_root(out_root, params_file))
    what = f"run stage {name.value}" + (f" {recipe}" if recipe else "")
    try:
        with run_lock(layout.root, what, on_stale=lambda msg: typer.echo(f"warning: {msg}", err=True)):
            run_stage(name, params, layout, recipe)
    except (ConfigError, StageError) as err:
        _fail(err)


@app.command("log-mlflow")
def log_mlflow(
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    out_root: RootOpt = None,
) -> None:
    """Log a finished run's files to MLflow again (e.g. after the tracking server was away)."""
    from qad_pipeline import tracking
    from qad_pipeline.artifacts import read_json
    from qad_pipeline.report import recipe_rows, report_text

    layout = Layout(output_root(out_root, params_file))
    try:
        params = resolve_params(params_file, overrides, base_model)
        tracking.check_reachable(tracking.tracking_uri(layout.root))
        if not layout.selection_metrics.is_file():
            raise ConfigError(f"no finished run under {layout.root} (no {layout.selection_metrics})")
    except ConfigError as err:
        _fail(err)
    summary = {"selection": read_json(layout.selection_metrics), "recipes": recipe_rows(layout, params.ptq.recipes)}
    for key, path in (("qad", layout.qad_metrics), ("export", layout.export_metrics)):
        if path.is_file():
            summary[key] = read_json(path)
    run_id = tracking.log_pipeline(layout, params, flow_run_id=None, git_commit=tracking.git_commit(),
                                   report=report_text(summary))
    version = tracking.register_export(layout, params, run_id) if summary.get("export", {}).get("passed") else None
    typer.echo(f"logged run {run_id} to {tracking.tracking_uri(layout.root)}"
               + (f"; registered model version {version}" if version else ""))


@app.command()
def compare(
    run_id: Annotated[str | None, typer.Argument(help="pipeline run id (default: the latest)")] = None,
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    out_root: RootOpt = None,
) -> None:
    """Print the recipe table of the latest (or a given) pipeline run, read back from MLflow."""
    from qad_pipeline import tracking

    try:
        params = resolve_params(params_file, overrides, base_model)
        uri = tracking.tracking_uri(output_root(out_root, params_file))
        tracking.check_reachable(uri)
        rows = tracking.compare_table(uri, tracking.experiment_name(params.base_model.path), run_id)
    except (ConfigError, LookupError) as err:
        _fail(err)
    typer.echo(tracking.compare_text(rows))


@app.command("prefect-setup")
def prefect_setup(
    kubernetes: Annotated[bool, typer.Option(help="Kubernetes pools with infra/k8s/ job templates")] = False,
    heartbeat_timeout: Annotated[int, typer.Option(help="seconds without a heartbeat before Crashed")] = 90,
) -> None:
    """Create the work pools (qad-control, qad-gpu) and the automation that crashes dead flow runs."""
    from qad_pipeline.prefect_setup import create_crash_automation, create_pools

    if not os.environ.get("PREFECT_API_URL"):
        _fail(ConfigError("PREFECT_API_URL is not set: point it at your Prefect server "
                          "(e.g. http://127.0.0.1:4200/api after `prefect server start`)"))
    if heartbeat_timeout < 60:
        _fail(ConfigError(f"--heartbeat-timeout {heartbeat_timeout} is too short: heartbeats come every 30 s or "
                          "more; use 60 or more"))
    for line in [*create_pools(kubernetes), create_crash_automation(heartbeat_timeout)]:
        typer.echo(line)


def run_stage(name: Stage, params: Params, layout: Layout, recipe: str | None = None) -> None:
    import qad_pipeline  # noqa: F401  (installs the CPU NVFP4 kernels when there is no GPU)

    for path in layout.outputs(name.value, recipe):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

    if name is Stage.calibration:
        from qad_pipeline.modeling import load_tokenizer
        from qad_pipeline.tasks.calibration import build_calibration

        manifest = build_calibration(params, load_tokenizer(params.base_model), layout.data)
        typer.echo(
            f"calibration: {manifest['calibration']['samples']} samples x {manifest['calibration']['seq_len']} "
            f"tokens, fingerprint {manifest['calibration']['fingerprint'][:12]}"
        )
    elif name is Stage.baseline:
        from qad_pipeline.tasks.evaluate import run_baseline

        run_baseline(params, layout.data, layout.baseline_metrics, layout.reference)
    elif name is Stage.ptq:
        from qad_pipeline.tasks.ptq import run_ptq

        result = run_ptq(params, recipe, layout.data, layout.reference, layout.ptq(recipe))
        if result.get("status") == "alias":
            typer.echo(f"ptq {recipe}: the same model as {result['alias_of']} on this base model; not run again")
        else:
            typer.echo(f"ptq {recipe}: {result['effective_bpe']:.3f} bits per element")
    elif name is Stage.selection:
        from qad_pipeline.tasks.selection import run_selection

        typer.echo(run_selection(params, layout).reason)
    elif name is Stage.qad:
        from qad_pipeline.artifacts import read_json, write_json
        from qad_pipeline.tasks.qad import launch_processes, run_qad

        selected = read_json(layout.selection_metrics)["selected"]
        if selected is None:
            raise ConfigError("no PTQ recipe was selected (see metrics/selection.json); QAD has no student")
        if params.qad.num_gpus > 1 and "WORLD_SIZE" not in os.environ:
            launch_processes(params, layout.root)  # torchrun runs this same command in qad.num_gpus processes
            return
        result = run_qad(params, layout.ptq(selected) / "checkpoint", layout.data, layout.qad, layout.qad_checkpoints)
        if int(os.environ.get("RANK", "0")) == 0:  # the only process, or the first of the torchrun ones
            write_json(layout.qad_loss, read_json(layout.qad / "loss.json")["losses"])
            typer.echo(f"qad: {result['steps']} steps, KD loss {result['first_loss']:.5f} -> {result['final_loss']:.5f}"
                       + (f" ({result['world_size']} processes)" if result["world_size"] > 1 else ""))
    elif name is Stage.final_eval:
        from qad_pipeline.tasks.final_eval import run_final_eval

        m = run_final_eval(params, layout)
        typer.echo(f"final eval: QAD median recovery {m['median_recovery']:.4f} vs PTQ {m['ptq_median_recovery']:.4f}")
    elif name is Stage.export:
        from qad_pipeline.tasks.export import run_export

        m = run_export(params, layout)
        typer.echo(f"export: {m['path']} ({m['size_bytes'] / 1e6:.2f} MB, {m['effective_bpe']:.3f} bits per element)")


def main() -> None:  # pragma: no cover
    sys.exit(app())


@app.command("plan")
def plan_command(
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as a JSON list of stage objects")] = False,
) -> None:
    """Print each stage's estimated peak host and GPU memory, reading no weights; exit 2 if one cannot fit."""
    import json

    from qad_pipeline import memory

    try:
        params = resolve_params(params_file, overrides, base_model)
        check_recipes(params)
        cap = memory.capacity(params.hardware)
        estimates = memory.plan(params, cap)
    except ConfigError as err:
        _fail(err)
    typer.echo(json.dumps([e.as_dict() for e in estimates], indent=2) if as_json else memory.table(estimates, cap))
    try:
        memory.check_fits(estimates)
    except ConfigError as err:
        _fail(err)


@app.command("setup-vllm")
def setup_vllm_command(
    env: Annotated[Path | None, typer.Option("--env", help="where to create it [default: $QAD_VLLM_ENV or .venv-vllm]")] = None,
    build: Annotated[str, typer.Option(help="auto: cuda when a GPU is visible, else cpu | cpu | cuda")] = "auto",
) -> None:
    """Create the pinned vLLM environment the serving check runs in (vLLM and the CPU plugin)."""
    from qad_pipeline import serving

    try:
        serving.setup_vllm(env, build, log=typer.echo)
    except (ConfigError, OSError) as err:
        _fail(err)
    except subprocess.CalledProcessError as err:
        typer.echo(f"error: {' '.join(map(str, err.cmd))} exited with {err.returncode}", err=True)
        raise typer.Exit(1) from None


@app.command("verify-serving")
def verify_serving_command(
    export_dir: Annotated[Path, typer.Argument(help="an exported checkpoint folder (artifacts/export)")],
    level: Annotated[str, typer.Option(help="auto: full where vLLM runs the architecture here, else config | full | config")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="print the whole result as JSON before the last line")] = False,
) -> None:
    """Load an export with a real vLLM and compare its log-probs with the student's; exit 0 when it passes.

    The last line names the level that ran (full or config) and its figures."""
    import json

    from qad_pipeline import serving

    try:
        if not export_dir.is_dir():
            raise ConfigError(f"export folder {export_dir} does not exist")
        result = serving.verify_serving(export_dir, level)
    except (ConfigError, StageError) as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    typer.echo(result["summary"])
    if not result["passed"]:
        raise typer.Exit(1)
