"""Secrets never reach the tracking store (qad_pipeline/core/redaction.py as tracking uses it)."""

from __future__ import annotations

import json

import pytest

from qad_pipeline import tracking
from tests.tracking_fakes import AWS_SECRET, HF_TOKEN, MLFLOW_PASSWORD, logged_store


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The shared store with two logged pipeline runs (tracking_fakes.logged_store)."""
    return logged_store(tmp_path_factory)


def test_secrets_never_reach_params_tags_or_artifacts(logged):
    client, root = logged["client"], logged["root"]
    secrets = (HF_TOKEN, AWS_SECRET, MLFLOW_PASSWORD)
    exp_id = client.get_run(logged["runs"][0]["run_id"]).info.experiment_id
    runs = client.search_runs([exp_id], max_results=1000)
    assert len(runs) == 2 * 10  # parent + 9 children, twice
    for run in runs:
        for key, value in [*run.data.params.items(), *run.data.tags.items()]:
            assert not any(s in value for s in secrets), (run.info.run_name, key)
        for d in run.inputs.dataset_inputs:
            assert not any(s in d.dataset.source + (d.dataset.profile or "") for s in secrets)
    parent = client.get_run(logged["runs"][0]["run_id"])
    assert parent.data.params["base_model.revision"] == "***"  # value of a secret env var
    assert parent.data.params["calibration.dataset_config"] == "***"
    artifacts = [p for p in (root / "mlartifacts").rglob("*") if p.is_file()]
    assert any(p.name == "baseline.log" for p in artifacts) and any(p.name == "params.json" for p in artifacts)
    for path in [*artifacts, root / "mlflow.db"]:
        data = path.read_bytes()
        assert not any(s.encode() in data for s in secrets), path
    for mv in client.search_model_versions():
        assert not any(s in json.dumps([mv.tags, mv.description, mv.source]) for s in secrets)


@pytest.mark.parametrize("name", ["HF_TOKEN", "hf_token", "api_token", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD",
                                  "accessToken",
                                  "AWS_SECRET_ACCESS_KEY", "aws_access_key_id", "api_key", "apiKey", "APIKEY",
                                  "db.Password", "passwd", "client_secret", "google_credentials", "GITHUB_TOKEN2"])
def test_secret_names_are_masked(name):
    assert tracking.is_secret_name(name)
    assert tracking.redact(name, "some-value") == "***"


@pytest.mark.parametrize("name", ["tokenizer", "calibration.tokenizer", "TOKENIZERS_PARALLELISM", "tokens_per_step",
                                  "keyframes", "base_model.path", "kv_cache", "monkeys"])
def test_names_that_only_contain_a_secret_word_are_not_masked(name, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "falsey-value")  # not a secret: its value is not scrubbed
    assert not tracking.is_secret_name(name)
    assert tracking.redact(name, "demo/model") == "demo/model"
    assert "falsey-value" not in tracking.secret_values()


def test_redact_rules(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    assert tracking.redact("HF_TOKEN", "anything") == "***"
    assert tracking.redact("aws_secret_access_key", "x" * 20) == "***"
    assert tracking.redact("db.Password", "hunter2") == "***"
    assert tracking.redact("api_key", "k") == "***"
    assert tracking.redact("tokens_per_step", 2048) == "2048"  # numbers are not secrets
    assert tracking.redact("base_model.revision", f"main-{HF_TOKEN}") == "main-***"
    assert tracking.redact("uri", "https://user:pa55@host/x") == "https://***@host/x"
    assert tracking.redact("qad.lr", 1e-4) == "0.0001"
    flat = tracking.flatten({"env": {"HF_TOKEN": HF_TOKEN, "n": 1}, "a": [1, 2]})
    assert {k: tracking.redact(k, v) for k, v in flat.items()} == {"env.HF_TOKEN": "***", "env.n": "1", "a": "[1, 2]"}
    nested = {"nested": [{"password": "p"}, f"x{AWS_SECRET}"]}
    assert tracking.redact_data(nested) == {"nested": [{"password": "***"}, "x***"]}


def test_the_shells_working_directory_is_no_password(monkeypatch, tmp_path):
    """$PWD is named like a password (pwd); a path under it in a param is neither refused nor scrubbed."""
    from qad_pipeline.core.config import PROJECT_PARAMS, load_params

    monkeypatch.setenv("PWD", str(tmp_path))
    monkeypatch.setenv("DB_PWD", "hunter2-secret")
    assert str(tmp_path) not in tracking.secret_values() and "hunter2-secret" in tracking.secret_values()
    assert tracking.redact("base_model.path", f"{tmp_path}/model") == f"{tmp_path}/model"
    load_params(PROJECT_PARAMS, [f"qad.source={tmp_path}/text"])  # refused before: "holds the value of $PWD"
