"""The checkpoint checks as commands (registered on the app in qad_pipeline/cli.py):

    qad-pipeline verify-serving EXPORT_DIR                # a real vLLM against the export's own reference
    qad-pipeline verify-export CHECKPOINT --out-root RUN  # every export check against RUN's student
    qad-pipeline params-doc [--check]                     # docs/params.md from params.yaml's comments
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qad_pipeline.cli_options import ParamsOpt, RootOpt, SetOpt, fail
from qad_pipeline.core.config import DEFAULT_PARAMS, PROJECT_PARAMS, ConfigError, StageError
from qad_pipeline.core.params_reference import REFERENCE, model_keys, reference_markdown, undocumented

JsonOpt = Annotated[bool, typer.Option("--json", help="print the whole result as JSON before the last line")]


def verify_serving_command(
    export_dir: Annotated[Path, typer.Argument(help="an exported checkpoint folder (artifacts/export)")],
    level: Annotated[str, typer.Option(help="auto: full where vLLM runs the architecture here, else config | full | config")] = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Load an export with a real vLLM and compare its log-probs with the student's; exit 0 when it passes.

    The last line names the level that ran (full or config) and its figures."""
    from qad_pipeline.checks import serving

    try:
        if not export_dir.is_dir():
            raise ConfigError(f"export folder {export_dir} does not exist")
        result = serving.verify_serving(export_dir, level)
    except (ConfigError, StageError) as err:
        fail(err)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    typer.echo(result["summary"])
    if not result["passed"]:
        raise typer.Exit(1)


def verify_export_command(
    checkpoint: Annotated[Path, typer.Argument(help="a checkpoint folder: an export converted, copied or edited")],
    params_file: ParamsOpt = DEFAULT_PARAMS,
    overrides: SetOpt = None,
    out_root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The export stage's checks (formats, size, lint, reload, serving) on any checkpoint folder,
    against the student of the finished run in --out-root; nothing in the folder changes.

    Exit 0 when every check passes; like the export stage, 2 with one line naming the failed check
    and its figure when one fails (or the input is refused)."""
    from qad_pipeline.core.config import load_params
    from qad_pipeline.checks.export_verify import verify_export
    from qad_pipeline.core.layout import Layout, output_root

    try:
        if not checkpoint.is_dir():
            raise ConfigError(f"checkpoint folder {checkpoint} does not exist")
        params = load_params(params_file, list(overrides or []))
        result = verify_export(params, Layout(output_root(out_root, params_file)), checkpoint)
    except (ConfigError, StageError) as err:
        fail(err)
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    if not result["passed"]:
        fail(StageError(result["summary"]))
    typer.echo(result["summary"])


def params_doc_command(
    check: Annotated[bool, typer.Option("--check", help="only say whether docs/params.md is current; exit 1 if not")]
    = False,
) -> None:
    """Write docs/params.md, every parameter's reference, from params.yaml's comments."""
    try:
        missing = undocumented()
        if missing:
            raise ConfigError(f"{PROJECT_PARAMS}: no comment describes {', '.join(missing)}")
    except ConfigError as err:
        fail(err)
    text = reference_markdown()
    current = REFERENCE.is_file() and REFERENCE.read_text() == text
    if check:
        typer.echo(f"{REFERENCE} is {'current' if current else 'out of date: run `qad-pipeline params-doc`'}")
        raise typer.Exit(0 if current else 1)
    if not current:
        REFERENCE.parent.mkdir(exist_ok=True)
        REFERENCE.write_text(text)
    typer.echo(f"{REFERENCE}: {'unchanged' if current else 'written'} ({len(model_keys())} keys)")
