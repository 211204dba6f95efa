"""`python -m qad_pipeline ...` is the `qad-pipeline` command."""

from qad_pipeline.cli import app

app(prog_name="qad-pipeline")
