"""The `qad-pipeline` command: `qad-pipeline run` runs the whole flow locally; `stage` runs one stage.

    qad-pipeline run                                   # the demo model, params.yaml defaults
    qad-pipeline run --base-model org/model --set calibration.num_samples=1000
    qad-pipeline stage ptq nvfp4_max-mamba_fp8-kv_fp8  # one stage, as `dvc repro` runs it
    qad-pipeline sweep --set 'sweep.budgets=[4.75, 5.0, 6.5]'  # the BPE sweep: AutoQuantize per budget, the knee
    qad-pipeline plan --set qad.seq_len=32768          # each stage's peak memory, before any weights load
    qad-pipeline push --out-root runs/x                # a finished run's outputs to the DVC remote (a retry)
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from qad_pipeline.platform import processes
from qad_pipeline import cli_options
from qad_pipeline.cli_checks import params_doc_command, verify_export_command, verify_serving_command
from qad_pipeline.cli_options import BaseOpt, ParamsOpt, RootOpt, SetOpt, fail
from qad_pipeline.core.config import DEFAULT_PARAMS, ConfigError, Params, StageError, load_params
from qad_pipeline.core.layout import Layout, output_root
from qad_pipeline.core.params_files import inheritance_line
from qad_pipeline.plan import memory
from qad_pipeline.plan.preflight import check_recipes, preflight
from qad_pipeline.platform.runlock import NODE_ENV, TOKEN_ENV, run_lock
from qad_pipeline.core.stages import EXPORT, STAGES, SWEEPING, with_sweep
from qad_pipeline.training.trainjob import trainjob_command

app = typer.Typer(add_completion=False, no_args_is_help=True, help="BF16 -> NVFP4 PTQ -> QAD pipeline.")
app.command("trainjob")(trainjob_command)  # qad_pipeline/training/trainjob.py
app.command("verify-serving")(verify_serving_command)  # qad_pipeline/cli_checks.py
app.command("verify-export")(verify_export_command)
app.command("params-doc")(params_doc_command)  # qad_pipeline/cli_checks.py


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="on a refused input, show the traceback too")] = False,
) -> None:
    cli_options.debug = debug


Stage = Enum("Stage", {name: name for name in STAGES}, type=str)  # the declared stages, in order


def resolve_params(params_file: Path, overrides: list[str] | None, base_model: str | None) -> Params:
    items = list(overrides or [])
    if base_model is not None:
        if not base_model.strip():
            raise ConfigError("--base-model is empty: give a local model folder or a hub id such as 'org/name'")
        items.append(f"base_model.path={base_model}")
    return load_params(params_file, items)


def _start_flow(flow_name: str, params_file: Path, overrides: list[str] | None, out_root: Path,
                base_model: str | None) -> dict:
    """Run one of the project's Prefect flows here (`qad-pipeline` or `bpe-sweep`), with the CLI's
    handling of a failed stage, a held lock and a stop (every stage process stopped, exit 128+signal)."""
    # A local run talks to Prefect's temporary server unless PREFECT_API_URL names one; offline,
    # analytics must be off, and on a busy machine the server may need more than 20 s to start.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from prefect.exceptions import TerminationSignal

    from flows.pipeline import StageFailed, qad_pipeline
    from flows.sweep_flow import bpe_sweep
    from qad_pipeline.platform.runlock import LockHeld

    flow = {"qad-pipeline": qad_pipeline, "bpe-sweep": bpe_sweep}[flow_name]
    processes.start_watchdog()  # a `kill -9` of this run stops what it started too (Prefect's temporary server)
    processes.raise_on_signals()  # Prefect passes a SIGTERM on to this handler once the flow has stopped
    try:
        return flow(params_file=str(params_file), overrides=list(overrides or []), out_root=str(out_root),
                    base_model=base_model)
    except (StageFailed, LockHeld) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    except (processes.Stopped, KeyboardInterrupt, TerminationSignal) as err:  # the flow stopped its stages
        sig = getattr(err, "signal", signal.SIGINT)
        typer.echo(f"error: stopped by {signal.Signals(sig).name}; every stage process was stopped and nothing "
                   "half-written is left: the same command resumes", err=True)
        raise typer.Exit(128 + sig) from None


def _checked(params_file: Path, overrides: list[str] | None, base_model: str | None, out_root: Path | None,
             sweep: bool = False) -> Path:
    """The out-root, once the preflight has read every input (a refusal: one line, exit 2)."""
    out_root = output_root(out_root, params_file)
    try:
        params = resolve_params(params_file, overrides, base_model)
        if sweep and not params.sweep.budgets:
            raise ConfigError("sweep.budgets is empty: list the budgets to sweep, e.g. --set 'sweep.budgets=[4.5, 5.0]'")
        preflight(params, out_root, sweep=sweep)
    except ConfigError as err:
        fail(err)
    return out_root


@app.command()
def run(
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    out_root: RootOpt = None,
) -> None:
    """Run the qad-pipeline Prefect flow locally and print the recipe table and the choice."""
    from qad_pipeline.reporting.report import report_text

    out_root = _checked(params_file, overrides, base_model, out_root)
    summary = _start_flow("qad-pipeline", params_file, overrides, out_root, base_model)
    typer.echo(report_text(summary))
    tracked = summary.get("mlflow", {})
    if "run_id" in tracked:
        model = f"; registered {tracked['registered_model']} v{tracked['model_version']} @candidate" if tracked.get(
            "model_version") else ""
        typer.echo(f"MLflow: run {tracked['run_id']} in {tracked['uri']}{model}")
    if summary["selection"]["selected"] is None:
        raise typer.Exit(1)


@app.command()
def sweep(
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    out_root: RootOpt = None,
) -> None:
    """Run the BPE sweep (the `bpe-sweep` Prefect flow) locally: sweep.recipe at every budget in
    sweep.budgets, the fixed recipes on the same curve, the knee; print the table and the knee."""
    from qad_pipeline.reporting.report import sweep_text

    out_root = _checked(params_file, overrides, base_model, out_root, sweep=True)
    summary = _start_flow("bpe-sweep", params_file, overrides, out_root, base_model)
    typer.echo(sweep_text(summary["sweep"]))
    if summary.get("mlflow", {}).get("run_id"):
        typer.echo(f"MLflow: run {summary['mlflow']['run_id']} in {summary['mlflow']['uri']}")


@app.command()
def stage(
    name: Annotated[Stage, typer.Argument(help="stage to run")],
    recipe: Annotated[str | None, typer.Argument(help="recipe name (ptq) or budget (sweep, e.g. 5.0)")] = None,
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    out_root: RootOpt = None,
) -> None:
    """Run one stage by itself; the flow's tasks and `dvc repro` call exactly this."""
    try:
        params = resolve_params(params_file, overrides, base_model)
        declared = STAGES[name.value]
        if declared.per_recipe:
            what = "recipe" if declared.foreach == "ptq.recipes" else "budget"
            if recipe is None:
                raise ConfigError(f"stage {name.value} needs a {what} name: one of {declared.items(params)}")
            if recipe not in declared.items(params):
                raise ConfigError(f"unknown {what} {recipe!r}: {declared.foreach} lists {declared.items(params)}")
        if TOKEN_ENV not in os.environ and NODE_ENV not in os.environ:  # by itself (dvc repro, by hand); a
            # pipeline run checked before starting it
            preflight(params, output_root(out_root, params_file), memory=False, tracking=False,
                      serving=declared is EXPORT, sweep=declared.gated_by(SWEEPING))
        params = memory.settled_here(params, sweep=declared.gated_by(SWEEPING))  # each `auto` a run left
    except ConfigError as err:
        fail(err)

    layout = Layout(output_root(out_root, params_file))
    processes.exit_on_sigterm()  # a stopped stage cleans up: no half-written output is left
    if TOKEN_ENV in os.environ:  # started by a pipeline run: it ends when that run's process ends
        processes.die_with_parent(signal.SIGTERM)
        if os.getppid() == 1:
            fail(ConfigError("the pipeline run that started this stage has already ended"))
    what = f"run stage {name.value}" + (f" {recipe}" if recipe else "")
    try:
        with run_lock(layout.root, what, on_stale=lambda msg: typer.echo(f"warning: {msg}", err=True)):
            run_stage(name, params, layout, recipe)
    except (ConfigError, StageError) as err:
        fail(err)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        fail(StageError(f"stage {name.value}: {err.strerror} writing {err.filename or layout.root}; nothing "
                         "half-written was put in place (outputs are staged, then moved in whole); free some space "
                         "and run it again"))


@app.command("log-mlflow")
def log_mlflow(
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    out_root: RootOpt = None,
    again: Annotated[bool, typer.Option("--again", help="log a new run even if this run is logged already")] = False,
) -> None:
    """Log a finished run's files to MLflow (e.g. after the tracking server was away).

    The run the pipeline started in MLflow (`artifacts/mlflow_run.json`) is completed: what was
    logged before is kept, nothing is logged twice, and a run logged whole is left as it is
    (`--again` logs a new one).
    """
    from qad_pipeline import tracking
    from qad_pipeline.reporting.report import read_summary, report_text

    layout = Layout(output_root(out_root, params_file))
    uri = tracking.tracking_uri(layout.root)
    try:
        params = resolve_params(params_file, overrides, base_model)
        tracking.check_reachable(uri)
        if not layout.selection_metrics.is_file():
            raise ConfigError(f"no finished run under {layout.root} (no {layout.selection_metrics})")
    except ConfigError as err:
        fail(err)
    record = None if again else tracking.recorded_run(layout, uri)
    if record is not None and record.logged:
        typer.echo(f"run {record.run_id} in {record.uri} holds this run already"
                   + (f" (model version {record.model_version})" if record.model_version else "")
                   + "; nothing logged (--again logs a new run)")
        return
    summary = read_summary(layout, params)  # the same report as the flow's
    run_id = tracking.log_pipeline(layout, params, flow_run_id=None, git_commit=tracking.git_commit(),
                                   report=report_text(summary), run_id=record and record.run_id)
    version = tracking.register_export(layout, params, run_id) if summary.export and summary.export.passed else None
    tracking.record_run(layout, uri, run_id, logged=True, model_version=version)
    typer.echo(f"{'completed' if record else 'logged'} run {run_id} in {tracking.redact_text(uri)}"
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
        fail(err)
    typer.echo(tracking.compare_text(rows))


@app.command()
def push(params_file: ParamsOpt = DEFAULT_PARAMS, overrides: SetOpt = None, out_root: RootOpt = None) -> None:
    """Commit a finished run's outputs to DVC and push them to the remote (`versioning.remote`, else
    $QAD_DVC_REMOTE), as a run does when it ends: the retry of a failed push."""
    from qad_pipeline.platform import dvc_remote
    from qad_pipeline import tracking

    root = output_root(out_root, params_file)
    try:
        remote = dvc_remote.push_remote(resolve_params(params_file, overrides, None), root)
    except ConfigError as err:
        fail(err)
    done, line = dvc_remote.after_run(root, Path(params_file), list(overrides or []), dvc_remote.ran_on_disk(root),
                                      remote, typer.echo)
    record = done and dvc_remote.run_project(root) and tracking.recorded_run(Layout(root), tracking.tracking_uri(root))
    if record:  # the run's MLflow run gets the pointers, as after the run
        line += "; " + dvc_remote.log_pointers(root, tracking.tracking_uri(root), record.run_id)
    typer.echo(line)
    raise typer.Exit(0 if done else 1)


@app.command("prefect-setup")
def prefect_setup(
    kubernetes: Annotated[bool, typer.Option(help="Kubernetes pools with the infra/k8s/base/ job templates")] = False,
    heartbeat_timeout: Annotated[int, typer.Option(help="seconds without a heartbeat before Crashed")] = 90,
) -> None:
    """Create the work pools (qad-control, qad-gpu) and the automation that crashes dead flow runs."""
    from qad_pipeline.platform.prefect_setup import create_crash_automation, create_pools

    if not os.environ.get("PREFECT_API_URL"):
        fail(ConfigError("PREFECT_API_URL is not set: point it at your Prefect server "
                          "(e.g. http://127.0.0.1:4200/api after `prefect server start`)"))
    if heartbeat_timeout < 60:
        fail(ConfigError(f"--heartbeat-timeout {heartbeat_timeout} is too short: heartbeats come every 30 s or "
                          "more; use 60 or more"))
    for line in [*create_pools(kubernetes), create_crash_automation(heartbeat_timeout)]:
        typer.echo(line)


def run_stage(name: Stage, params: Params, layout: Layout, recipe: str | None = None) -> None:
    line = STAGES[name.value].run(params, layout, recipe)
    if line:
        typer.echo(line)


@app.command("dvc-yaml")
def dvc_yaml_command(
    params_file: ParamsOpt = DEFAULT_PARAMS,
    check: Annotated[bool, typer.Option("--check", help="only say whether dvc.yaml is current; exit 1 if not")] = False,
) -> None:
    """Write dvc.yaml beside the params file, from the stage registry (qad_pipeline/core/stages.py) and
    the params (the BPE sweep's stages only when they ask for it)."""
    from qad_pipeline.platform.versioning import write_dvc_yaml

    try:
        current, line = write_dvc_yaml(Path(params_file), check)
    except ConfigError as err:
        fail(err)
    typer.echo(line)
    raise typer.Exit(0 if current or not check else 1)


@app.command("plan")
def plan_command(
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    base_model: BaseOpt = None,
    out_root: RootOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as a JSON list of stage objects")] = False,
    target: Annotated[str | None, typer.Option(
        "--target", help="plan for this GPU node instead of this machine, e.g. 8xH100-80GB or 4xB200-180GB,2TiB-host "
                         "[default: hardware.target]")] = None,
) -> None:
    """Print each stage's GPUs, estimated peak host and GPU memory, disk and time, reading no
    weights, then the out-root and all the disk a run takes (qad_pipeline/plan/disk_plan.py); exit 2 if
    a stage cannot fit."""
    import json

    from qad_pipeline.plan import capacity, disk_plan, plan_table, pools

    try:
        params = resolve_params(params_file, overrides, base_model)
        check_recipes(params)
        node = target or params.hardware.target
        cap = capacity.target_capacity(node) if node else capacity.capacity(params.hardware)
        chosen = memory.settled(params, cap, sweep=with_sweep(params))  # what `auto` stands for here
        estimates, on_pool = memory.plan(params, cap), pools.plan_line(chosen)  # a Job its pool cannot give: refused
        items = [*(overrides or []), *([f"base_model.path={base_model}"] if base_model else [])]  # the run's, for DVC
        disk = disk_plan.run_disk(estimates, params, output_root(out_root, params_file), params_file, items)
        inherits = inheritance_line(params_file)  # a profile: what it extends, how much it changes
    except ConfigError as err:
        fail(err)
    typer.echo(json.dumps([e.as_dict() for e in estimates], indent=2) if as_json
               else "\n".join(filter(None, [inherits, plan_table.table(estimates, cap, params),
                                             plan_table.settled_line(params, chosen), disk.text(), on_pool])))
    try:
        memory.check_fits(estimates)
    except ConfigError as err:
        fail(err)


@app.command("setup-vllm")
def setup_vllm_command(
    env: Annotated[Path | None, typer.Option("--env", help="where to create it [default: $QAD_VLLM_ENV or .venv-vllm]")] = None,
    build: Annotated[str, typer.Option(help="auto: cuda when a GPU is visible, else cpu | cpu | cuda")] = "auto",
) -> None:
    """Create the pinned vLLM environment the serving check runs in (vLLM and the CPU plugin)."""
    from qad_pipeline.checks import vllm_setup

    try:
        vllm_setup.setup_vllm(env, build, log=typer.echo)
    except (ConfigError, OSError) as err:
        fail(err)
    except subprocess.CalledProcessError as err:
        typer.echo(f"error: {' '.join(map(str, err.cmd))} exited with {err.returncode}", err=True)
        raise typer.Exit(1) from None
