"""The options the `qad-pipeline` commands share (qad_pipeline/cli.py): the params file, its overrides,
the base model and the out-root; and how every command refuses (`fail`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ParamsOpt = Annotated[
    Path, typer.Option("--params", help="params file with every default; relative paths in it are relative to its folder")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="override one parameter: section.key=value (repeatable)"),
]
BaseOpt = Annotated[
    str | None, typer.Option("--base-model", help="base model: local folder or hub id (base_model.path)")
]
RootOpt = Annotated[
    Path | None,
    typer.Option("--out-root", help="folder that receives artifacts/ and metrics/ [default: $QAD_OUT_ROOT/<params "
                                    "stem>, else the params file's folder, else runs/<params stem> for this "
                                    "repository's own params files]"),
]

debug = False  # --debug, set by the app's callback (qad_pipeline/cli.py)


def fail(err: Exception) -> None:
    """A refused input or failed stage: one line on stderr (the traceback too with --debug), exit 2."""
    from qad_pipeline.core.redaction import redact_text

    if debug:
        import traceback

        typer.echo(redact_text("".join(traceback.format_exception(err))), err=True)
    typer.echo(f"error: {redact_text(str(err))}", err=True)  # an echoed --set item may hold a secret
    raise typer.Exit(2)
