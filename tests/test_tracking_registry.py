"""The model registry (qad_pipeline/tracking/registry.py): each export a new version with the
alias `candidate`, described from the run's files."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from qad_pipeline import tracking
from tests.tracking_fakes import children, fp, logged_store, markdown_tables


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The shared store with two logged pipeline runs (tracking_fakes.logged_store)."""
    return logged_store(tmp_path_factory)


def test_export_registered_with_candidate_alias_that_moves_to_the_newer_version(logged, monkeypatch):
    client, (first, second) = logged["client"], logged["runs"]
    name = tracking.registered_model_name(logged["params"].base_model.path)
    assert "/" not in name and name.endswith("-nvfp4")
    assert (first["version"], second["version"]) == ("1", "2")
    candidate = client.get_model_version_by_alias(name, "candidate")
    assert str(candidate.version) == "2"
    assert candidate.run_id == second["run_id"]  # the pipeline run: its page lists the version
    assert candidate.source.startswith(client.get_run(second["run_id"]).info.artifact_uri)
    assert client.get_model_version(name, "1").run_id == first["run_id"]
    export_run = children(client, second["run_id"])["export"]
    assert export_run.data.tags["registered_model"] == f"models:/{name}/2"
    # models:/<name>@candidate leads to the run's checkpoint artifacts
    monkeypatch.setenv("MLFLOW_TRACKING_URI", logged["uri"])  # models:/ resolves through the default registry
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{name}@candidate"))
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "hf_quant_config.json", "model.safetensors"]
    assert json.loads((local / "config.json").read_text())["t0"] == second["t0"]


def test_registered_version_describes_the_exported_model(logged):
    client, second = logged["client"], logged["runs"][1]
    name = tracking.registered_model_name(logged["params"].base_model.path)
    version = client.get_model_version(name, second["version"])
    qad = second["qad"]
    assert f"{100 * qad['median_recovery']:.2f} %" in version.description
    assert f"{100 * qad['ptq_median_recovery']:.2f} %" in version.description
    assert "1" * 40 in version.description  # the git commit of the second run
    assert second["manifest"]["calibration"]["fingerprint"] in version.description
    assert second["manifest"]["eval"]["fingerprint"] in version.description
    assert fp("model") in version.description
    assert float(version.tags["median_recovery"]) == pytest.approx(qad["median_recovery"])
    assert version.tags["git_commit"] == "1" * 40
    assert version.tags["eval.fingerprint"] == second["manifest"]["eval"]["fingerprint"]
    rows = markdown_tables(version.description)[0]
    assert [len(r) for r in rows] == [4, 4, 4]
