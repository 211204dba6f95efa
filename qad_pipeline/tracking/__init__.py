"""MLflow tracking, done from one place by reading the files the stages wrote.

Nothing here recomputes a number and nothing runs inside a stage process: after (or while) the
flow runs, the parent process calls these functions, which read `metrics/*.json`, the calibration
manifest, QAD's `loss.json` and the export folder from a `Layout` and log them. A run whose
tracking server went away can therefore be logged again later from the same files.

What goes where:

* one experiment per base model, `qad-pipeline/<base_model.path>`, marked as model development
  (`mlflow.experimentKind`), so MLflow 3's UI opens it on the runs table;
* one parent run per pipeline run (tag `qad.kind=pipeline`): the resolved configuration as
  params, the base checkpoint's identity, git commit and Prefect flow-run id as tags, the
  calibration and eval datasets as run inputs, the report, a Markdown description
  (`mlflow.note.content`), the selection's full reason, and headline metrics (the selected
  recipe's and QAD's recovery with its interval, KL and bits);
* one child run (tag `mlflow.parentRunId`, `qad.kind=stage`, `qad.stage=<stage>`) for each stage
  and recipe whose files exist: `calibration`, `baseline`, `ptq-<recipe>`, `selection`, `qad`,
  `final_eval`, `export`, spanning its stage process; a failed recipe (or a failed export check)
  ends FAILED with its error as the tag `error`; each recipe run has the recipe's settings as
  params, so MLflow's compare view has a recipe axis;
* `register_export` logs the exported checkpoint into the parent run and registers it as a new
  version of `<sanitized base model>-nvfp4` with the alias `candidate`.

Every param and tag value, and every JSON/text artifact, passes through `redact`/`redact_text`,
so secrets (`HF_TOKEN`, `api_key`, URL credentials) never reach the tracking store.

The default store is a SQLite file in the output root (`sqlite:///<root>/mlflow.db`, no server to
start); `MLFLOW_TRACKING_URI` points elsewhere (an `http(s)://` server, `postgresql://...`).

Modules, by job: `store` (where, whether, names), `qad_pipeline.core.redaction` (secrets), `children` and `metrics`
(what each stage's run holds, read from its files), `datasets` (data as run inputs), `write`
(writing one run: a redacted batch, files, a child run), `runs` (logging a pipeline run), `sweep`
(logging a BPE sweep), `stale` (runs whose logger died), `registry` (model versions), `compare`
(reading runs back).
"""

from qad_pipeline.tracking.children import ChildRun, read_children, short_reason, stage_span
from qad_pipeline.tracking.compare import compare_table, compare_text, find_experiment, latest_pipeline_run, run_url
from qad_pipeline.core.redaction import REDACTED, flatten, is_secret_name, redact, redact_data, redact_text, secret_values
from qad_pipeline.tracking.registry import CANDIDATE_ALIAS, register_export, version_description, version_facts
from qad_pipeline.tracking.runs import (headline_metrics, log_pipeline, pipeline_status, record_run, recorded_run,
                                        start_pipeline_run)
from qad_pipeline.tracking.stale import mark_stale_runs
from qad_pipeline.tracking.write import log_child
from qad_pipeline.tracking.sweep_runs import log_sweep
from qad_pipeline.tracking.store import (EXPERIMENT_PREFIX, MODEL_SUFFIX, check_reachable, client_for,
                                         ensure_experiment, experiment_name, git_commit, registered_model_name,
                                         tracking_uri)

__all__ = [
    "log_sweep",
    "CANDIDATE_ALIAS", "EXPERIMENT_PREFIX", "MODEL_SUFFIX", "REDACTED", "ChildRun", "check_reachable", "client_for",
    "compare_table", "compare_text", "ensure_experiment", "experiment_name", "find_experiment", "flatten",
    "git_commit", "headline_metrics", "is_secret_name", "latest_pipeline_run", "log_child", "log_pipeline",
    "mark_stale_runs", "pipeline_status", "read_children", "record_run", "recorded_run", "redact", "redact_data",
    "redact_text", "register_export", "registered_model_name", "run_url", "secret_values", "short_reason", "stage_span",
    "start_pipeline_run", "tracking_uri", "version_description", "version_facts",
]
