"""The model registry: an exported checkpoint, logged into its pipeline run, becomes a new version
of `<base model>-nvfp4` with the alias `candidate` and a description of what it is and came from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.core.redaction import redact, redact_text
from qad_pipeline.results.base import read_result
from qad_pipeline.results.data import CalibrationManifest
from qad_pipeline.results.export_metrics import ExportMetrics
from qad_pipeline.results.qad_metrics import QADMetrics
from qad_pipeline.results.selection_metrics import SelectionResult
from qad_pipeline.core.stages import EXPORT
from qad_pipeline.tracking.compare import child_runs
from qad_pipeline.tracking.metrics import number
from qad_pipeline.tracking.store import (ERROR, GIT_COMMIT, RECIPE, STAGE, client_for, registered_model_name,
                                         tracking_uri)

CANDIDATE_ALIAS = "candidate"
CHECKPOINT_ARTIFACT = "checkpoint"
REGISTERED = "qad.registered_model"  # on the pipeline run: models:/<name>/<version>


def register_export(layout: Layout, params: Params, parent_run_id: str, *, uri: str | None = None,
                    alias: str = CANDIDATE_ALIAS) -> str:
    """Log artifacts/export into the pipeline (parent) run and register it; returns the new version.

    The registered model is `registered_model_name(base_model.path)`; the version's source is the
    parent run's `checkpoint/` artifact folder and its run_id the parent run, so the run page
    lists it; its description (Markdown) quotes the exported model's own recovery
    (metrics/qad.json, with its interval), the PTQ recovery it started from, the git commit and
    the fingerprints of the base checkpoint and of the calibration and eval data. `alias`
    (default `candidate`) is moved onto it, so `models:/<name>@candidate` leads back to the run.
    A run registered before keeps its version (tag `qad.registered_model`): none is added.
    """
    from mlflow.exceptions import MlflowException

    uri = uri or tracking_uri(layout.root)
    client = client_for(uri)
    parent = client.get_run(parent_run_id)
    if REGISTERED in parent.data.tags:  # registered by an earlier logging of this run: not a second version
        return parent.data.tags[REGISTERED].rsplit("/", 1)[-1]
    export_runs = [r for r in child_runs(client, parent) if r.data.tags.get(STAGE) == EXPORT.name]
    if not export_runs:
        raise ConfigError(f"pipeline run {parent_run_id} has no export run to register "
                          f"(no {layout.export_metrics} when it was logged)")
    run = export_runs[0]
    if run.info.status != "FINISHED":
        raise ConfigError(f"the export of pipeline run {parent_run_id} did not pass its checks "
                          f"({run.data.tags.get(ERROR, run.info.status)}); nothing registered")
    if not layout.export.is_dir() or not any(layout.export.iterdir()):
        raise ConfigError(f"no exported checkpoint in {layout.export} to register")

    client.log_artifacts(parent_run_id, str(layout.export), CHECKPOINT_ARTIFACT)
    name = registered_model_name(params.base_model.path)
    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(
                name, tags={"base_model.path": redact("path", params.base_model.path)},
                description=f"NVFP4 exports of {redact('path', params.base_model.path)} by qad-pipeline",
            )
        except MlflowException:
            client.get_registered_model(name)  # created meanwhile; anything else raises here
    facts = version_facts(layout, parent, run)
    version = client.create_model_version(
        name, source=f"{parent.info.artifact_uri.rstrip('/')}/{CHECKPOINT_ARTIFACT}", run_id=parent_run_id,
        tags={k: redact(k, v) for k, v in facts.items() if v is not None},
        description=redact_text(version_description(facts)),
    )
    client.set_registered_model_alias(name, alias, version.version)
    where = f"models:/{name}/{version.version}"
    client.set_tag(run.info.run_id, "registered_model", where)
    client.set_tag(parent_run_id, REGISTERED, where)
    return str(version.version)


def version_facts(layout: Layout, parent: Any, export_run: Any) -> dict[str, Any]:
    """What a registered version records about itself, from the files and the runs' tags: the
    exported model's own recovery (the QAD student's, or a PTQ export's row of the selection table)."""
    export = read_result(layout.export_metrics, ExportMetrics, missing_ok=True)
    source = export.source if export is not None else "qad"
    manifest = read_result(layout.data / "manifest.json", CalibrationManifest, missing_ok=True)
    m = export_run.data.metrics
    if source == "qad":
        qad = read_result(layout.qad_metrics, QADMetrics, missing_ok=True)
        recipe, recovery = qad and qad.recipe, qad and qad.median_recovery
        ci = qad.median_recovery_ci if qad is not None else (None, None)
        ptq_recovery, kl = qad and qad.ptq_median_recovery, qad and qad.kl_divergence
    else:
        selection = read_result(layout.selection_metrics, SelectionResult, missing_ok=True)
        recipe = source.removeprefix("ptq/")
        row = next((r for r in (selection.table if selection else []) if r.name == recipe), None)
        recovery = ptq_recovery = row and row.median_recovery
        ci = (row and row.median_recovery_ci) or (None, None)
        kl = row and row.kl_divergence
    return {
        "recipe": export_run.data.tags.get(RECIPE) or recipe or parent.data.tags.get("qad.selected"),
        "exported": source,
        "pipeline_run_id": parent.info.run_id,
        "median_recovery": recovery,
        "median_recovery_ci_low": ci[0], "median_recovery_ci_high": ci[1],
        "ptq_median_recovery": ptq_recovery,
        "kl_divergence": kl,
        "effective_bpe": m.get("effective_bpe"),
        "size_bytes": None if m.get("size_bytes") is None else int(m["size_bytes"]),
        "git_commit": parent.data.tags.get(GIT_COMMIT),
        "base_model.path": parent.data.tags.get("base_model.path"),
        "base_model.sha256": parent.data.tags.get("base_model.sha256"),
        "calibration.fingerprint": manifest and manifest.calibration.fingerprint,
        "eval.fingerprint": manifest and manifest.eval.fingerprint,
    }


def version_description(facts: Mapping[str, Any]) -> str:
    """A registered version's description (Markdown, values rounded) from `version_facts`."""
    def pct(key: str) -> str:
        return "–" if number(facts.get(key)) is None else f"{100 * facts[key]:.2f} %"

    interval = ("" if number(facts.get("median_recovery_ci_low")) is None else
                f" (CI {100 * facts['median_recovery_ci_low']:.2f}–{100 * facts['median_recovery_ci_high']:.2f} %)")
    bits = "–" if number(facts.get("effective_bpe")) is None else f"{facts['effective_bpe']:.3f}"
    kl = "–" if number(facts.get("kl_divergence")) is None else f"{facts['kl_divergence']:.4f}"
    qad = facts.get("exported", "qad") == "qad"
    lines = [
        f"NVFP4 export of `{facts.get('base_model.path')}`, recipe `{facts.get('recipe')}` "
        + ("after QAD." if qad else "(PTQ, no QAD)."),
        "",
        "| model | median recovery vs BF16 | bits/elem | KL vs BF16 |",
        "|---|---|---|---|",
        f"| this export ({'QAD' if qad else 'PTQ'}) | {pct('median_recovery')}{interval} | {bits} | {kl} |",
        *([f"| PTQ before QAD | {pct('ptq_median_recovery')} | {bits} | – |"] if qad else []),
        "",
        f"- pipeline run: `{facts.get('pipeline_run_id')}`",
        f"- git commit: `{facts.get('git_commit') or 'unknown'}`",
        f"- base checkpoint sha256: `{facts.get('base_model.sha256') or 'unknown'}`",
        f"- calibration data fingerprint: `{facts.get('calibration.fingerprint') or 'unknown'}`",
        f"- eval data fingerprint: `{facts.get('eval.fingerprint') or 'unknown'}`",
    ]
    return "\n".join(lines) + "\n"
