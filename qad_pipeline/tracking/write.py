"""Writing runs into the store: one redacted batch of params, tags and metrics, artifact files, a
parent run with the configuration and provenance, a child run from its `ChildRun`, and ending a
run FAILED after an error. `runs` (a pipeline run) and `sweep` (a BPE sweep) are built from these."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from qad_pipeline.core.config import Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.core.redaction import flatten, redact, redact_data, redact_text
from qad_pipeline.tracking.children import ChildRun
from qad_pipeline.tracking.compare import child_runs
from qad_pipeline.tracking.datasets import log_inputs
from qad_pipeline.tracking.metrics import metric_key
from qad_pipeline.tracking.stale import process_tags
from qad_pipeline.tracking.store import (COMPLETE, FLOW_RUN_ID, GIT_COMMIT, KIND, LOGGED_AT, LOGGING_ERROR, PARENT,
                                         RECIPE, STAGE, artifact_location, client_for, ensure_experiment,
                                         experiment_name, tracking_uri)

if TYPE_CHECKING:  # mlflow is imported where it is used: importing it takes seconds
    from mlflow import MlflowClient


def log_batch(client: MlflowClient, run_id: str, *, params: Mapping[str, Any] | None = None,
              tags: Mapping[str, Any] | None = None, metrics: Mapping[str, float] | None = None,
              timestamp_ms: int | None = None, steps: Iterable[tuple[str, float, int, int]] = ()) -> None:
    """One log_batch; every param and tag value passes through redact. MLflow splits it into
    batches within its limits and truncates param and tag values that are too long."""
    from mlflow.entities import Metric, Param, RunTag

    ts = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
    p = [Param(k, redact(k, v)) for k, v in (params or {}).items()]
    t = [RunTag(k, redact(k, v)) for k, v in (tags or {}).items() if v is not None]
    m = [Metric(metric_key(k), float(v), ts, 0) for k, v in (metrics or {}).items()
         if v is not None and not (isinstance(v, float) and math.isnan(v))]
    m += [Metric(metric_key(k), float(v), ms, step) for k, v, ms, step in steps]
    client.log_batch(run_id, metrics=m, params=p, tags=t)


def log_files(client: MlflowClient, run_id: str, dicts: Mapping[str, Any], texts: Mapping[str, str]) -> None:
    """JSON (`dicts`) and text (`texts`) artifacts, by file name, secrets scrubbed."""
    for name, data in dicts.items():
        client.log_dict(run_id, redact_data(data), name)
    for name, text in texts.items():
        client.log_text(run_id, redact_text(text), name)


def end_quietly(client: MlflowClient, run_id: str, status: str, error: BaseException | None = None) -> None:
    """End a run after an error without hiding that error (the store may be what failed); the
    error, when given, as the tag `qad.logging_error`."""
    if error is not None:
        try:
            client.set_tag(run_id, LOGGING_ERROR, redact_text(f"{type(error).__name__}: {error}")[:5000])
        except Exception:  # noqa: BLE001 (the run still ends below, if the store lets it)
            pass
    try:
        client.set_terminated(run_id, status)
    except Exception:  # noqa: BLE001 (left RUNNING: mark_stale_runs ends it later)
        pass


def start_parent_run(layout: Layout, params: Params, *, kind: str, prefix: str, flow_run_id: str | None,
                     git_commit: str | None, uri: str | None = None, start_ms: int | None = None) -> str:
    """Create a parent run (RUNNING) in the base model's experiment: tagged `qad.kind=<kind>`,
    named `<prefix><start time>`, with the configuration as params (and `config/params.json`),
    the base model's path and revision, the git commit and the Prefect flow run. A failure after
    the run exists ends it FAILED (and raises): no half-made run stays RUNNING."""
    from mlflow.tracking.context.git_context import GitRunContext
    from mlflow.tracking.context.registry import resolve_tags

    uri = uri or tracking_uri(layout.root)
    client = client_for(uri)
    exp_id = ensure_experiment(client, experiment_name(params.base_model.path), artifact_location(uri, layout.root))
    start_ms = start_ms if start_ms is not None else int(time.time() * 1000)
    name = prefix + time.strftime("%Y%m%d-%H%M%S", time.localtime(start_ms / 1000))
    run = client.create_run(exp_id, start_time=start_ms, run_name=name, tags={KIND: kind, **process_tags()})
    run_id = run.info.run_id
    try:
        # Path and revision now; the content hash is tagged by `log_pipeline` from this run's baseline
        # (a baseline.json already in the out root may belong to an earlier run and another model).
        identity = {"path": params.base_model.path, "revision": params.base_model.revision}
        # MLflow's run context (mlflow.user, mlflow.source.*), but the caller's git commit: MLflow's
        # git context reads the entry script's repository and never says "-dirty".
        tags = resolve_tags({
            LOGGED_AT: f"{int(time.time() * 1000):015d}",
            "qad.out_root": str(layout.root),
            **{f"base_model.{k}": v for k, v in identity.items()},
            FLOW_RUN_ID: flow_run_id,
            GIT_COMMIT: git_commit,
            "git_commit": git_commit,
        }, ignore=[GitRunContext])
        config = params.model_dump(mode="json")
        log_batch(client, run_id, params=flatten(config), tags=tags, timestamp_ms=start_ms)
        client.log_dict(run_id, redact_data(config), "config/params.json")
    except BaseException as err:
        end_quietly(client, run_id, "FAILED", err)
        raise
    return run_id


def log_child(client: MlflowClient, experiment_id: str, parent_run_id: str, child: ChildRun) -> str:
    """Log one ChildRun under the parent and end it with its status; returns its run id."""
    tags = {PARENT: parent_run_id, KIND: "stage", STAGE: child.stage, **process_tags()}
    if child.recipe:
        tags[RECIPE] = child.recipe
    run = client.create_run(experiment_id, start_time=child.start_ms, run_name=child.name, tags=tags)
    run_id = run.info.run_id
    try:
        log_batch(client, run_id, params=child.params, tags=child.tags, metrics=child.metrics,
                  timestamp_ms=child.end_ms, steps=child.steps)
        log_inputs(client, run_id, child.datasets)
        log_files(client, run_id, child.dicts, child.texts)
    except BaseException as err:
        end_quietly(client, run_id, "FAILED", err)
        raise
    client.set_tag(run_id, COMPLETE, "true")
    client.set_terminated(run_id, child.status, end_time=max(child.end_ms, child.start_ms))
    return run_id


def log_children(client: MlflowClient, parent: Any, children: list[ChildRun]) -> dict[str, str]:
    """Log each child under `parent` once: a child an earlier, cut-short logging already logged
    whole (tag `qad.complete`) is kept; one it left half-logged is deleted and logged again."""
    before = {r.info.run_name: r for r in child_runs(client, parent)}
    ids = {}
    for child in children:
        prior = before.get(child.name)
        if prior is not None and prior.data.tags.get(COMPLETE) == "true":
            ids[child.name] = prior.info.run_id
            continue
        if prior is not None:
            client.delete_run(prior.info.run_id)
        ids[child.name] = log_child(client, parent.info.experiment_id, parent.info.run_id, child)
    return ids
