"""Bad input gets one clear line naming the bad value, before any model weights are loaded.

Each refusal: exit status 2, one line naming the bad thing, no traceback, nothing written under the
out-root (so no stage process started: its log would be there). Most cases call the `qad-pipeline`
command in this process (its preflight is what runs); a few run the real `qad-pipeline run` process.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from qad_pipeline import tracking
from qad_pipeline.core.calibration_data import read_documents
from qad_pipeline.cli import app
from qad_pipeline.core.config import PROJECT_ROOT, ConfigError, load_params
from tests.http_stub import serve

runner = CliRunner()
GOOD_RECIPE = "nvfp4_max-mamba_fp8-kv_fp8"


def run_cli(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def refused(out_root, *args, env=None):
    """`qad-pipeline run` in this process: (one-line message) after asserting the refusal's shape."""
    out_root.mkdir(exist_ok=True)
    code, out = run_cli("run", "--out-root", str(out_root), *args)
    assert code == 2, out
    assert "Traceback" not in out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert not any(out_root.iterdir()), f"written: {list(out_root.iterdir())}"
    return lines[0]


def refused_process(out_root, *args, env=None):
    """The real `qad-pipeline run` process: (its one error line) after asserting the refusal's shape."""
    out_root.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "qad_pipeline", "run", "--out-root", str(out_root), *args],
                          capture_output=True, text=True, cwd=PROJECT_ROOT, env={**os.environ, **(env or {})},
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert not any(out_root.iterdir()), f"written: {list(out_root.iterdir())}"
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "ptq.recipes=[nvfp4_nope]"], "unknown recipe 'nvfp4_nope'"),
        (["--set", "calibration.num_sampels=3"], "unknown key 'calibration.num_sampels'"),
        (["--base-model", "./no/such/model"], "base model path './no/such/model' does not exist"),
        (["--set", "eval.seq_len=100000"], "eval.seq_len = 100000 exceeds the model's maximum sequence length 1024"),
        (["--set", "eval.tasks=[no_such_task_anywhere]"], "unknown eval task(s) ['no_such_task_anywhere']"),
        (["--set", "export.source=ptq/nvfp4_nope"], "export.source 'ptq/nvfp4_nope' is not a candidate of this run"),
        (["--set", "export.source=latest"], "export.source 'latest' is not auto, qad, none or ptq/<recipe>"),
        (["--set", "ptq.layerwise=true", "--set", "ptq.recipes=[nvfp4_max-mamba_fp8-kv_fp8, autoquant_4o6-fp8-kv_fp8]"],
         "ptq.layerwise: recipe autoquant_4o6-fp8-kv_fp8 is an AutoQuantize recipe"),
        (["--set", "versioning.remote={url: s3://Bad_Bucket}"], "versioning.remote.url = 's3://Bad_Bucket'"),
    ],
)
def test_run_rejects_bad_input_in_one_line(args, message, demo_model_path, tmp_path):
    code, out = run_cli("run", "--out-root", str(tmp_path), *args)
    assert code == 2
    assert message in out
    assert "Traceback" not in out
    assert not (tmp_path / "artifacts").exists()  # nothing started


def test_a_dvc_remote_the_run_could_not_push_to_is_refused_before_it(demo_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("QAD_DVC_REMOTE", "s3://qad-dvc/runs")
    monkeypatch.setenv("QAD_DVC_ENDPOINT_URL", "minio:9000")
    assert "QAD_DVC_ENDPOINT_URL='minio:9000': 'minio:9000' is not an http(s):// URL" in refused(tmp_path / "a")
    monkeypatch.setenv("QAD_DVC_ENDPOINT_URL", "http://minio:9000")
    (tmp_path / "image").mkdir()
    (tmp_path / "image" / "dvc.yaml").write_text("stages: {}\n")  # the image's folder: a dvc.yaml, no .dvc/
    code, out = run_cli("run", "--out-root", str(tmp_path / "image"))
    assert code == 2 and "holds a dvc.yaml but is no DVC project" in out and "runs/<name>" in out, out
    assert not (tmp_path / "image" / "artifacts").exists()


def test_not_a_causal_lm(tmp_path):
    folder = tmp_path / "encoder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    code, out = run_cli("run", "--out-root", str(tmp_path), "--base-model", str(folder))
    assert code == 2
    assert "is not a causal LM" in out and "bert" in out


def test_calibration_shorter_than_asked(demo_model_path, tmp_path):
    code, out = run_cli(
        "stage", "calibration", "--out-root", str(tmp_path), "--set", "calibration.num_samples=100000"
    )
    assert code == 2
    assert "fewer than the 100000 asked" in out
    assert not (tmp_path / "artifacts" / "calibration").exists()


def test_empty_calibration_source(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    params = load_params(overrides={"calibration.source": str(empty)})
    with pytest.raises(ConfigError, match="holds no .txt files"):
        read_documents(params.calibration)
    (empty / "a.txt").write_text("   \n")
    with pytest.raises(ConfigError, match="0 non-empty document"):
        read_documents(params.calibration)


def test_ptq_stage_needs_a_listed_recipe(tmp_path):
    code, out = run_cli("stage", "ptq", "nvfp4_nope", "--out-root", str(tmp_path))
    assert code == 2 and "unknown recipe 'nvfp4_nope'" in out


# -- params and overrides: YAML syntax, value ranges across keys ---------------------------------


def test_yaml_error_in_params_names_the_file_line_and_column(tmp_path):
    params = tmp_path / "params.yaml"
    text = (PROJECT_ROOT / "params.yaml").read_text()
    params.write_text(re.sub(r"(?m)^  band: \[0.95, 0.99\].*$", "  band: [0.95, 0.99", text))  # its comment too
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.startswith("  ptq_final_min:"))  # where the
    # unclosed list is found out
    message = refused_process(tmp_path / "out", "--params", str(params))
    assert f"{params}: invalid YAML at line {line}, column 16" in message


def test_yaml_error_in_a_set_value_names_the_item_and_column(tmp_path):
    message = refused(tmp_path / "out", "--set", "ptq.recipes=[a, b")
    assert "--set 'ptq.recipes=[a, b': invalid YAML at line 1, column 18" in message


@pytest.mark.parametrize(
    "item, message",
    [
        ("selection.band=[0.95, 1.2]", "band must be [low, high] with 0 < low <= high <= 1, got [0.95, 1.2]"),
        ("selection.band=[0.99, 0.95]", "band must be [low, high] with 0 < low <= high <= 1, got [0.99, 0.95]"),
        ("selection.band=[0, 0.9]", "band must be [low, high] with 0 < low <= high <= 1"),
        ("selection.ptq_final_min=1.5", "selection.ptq_final_min = 1.5: Input should be less than or equal to 1"),
        ("ptq.gpus_per_recipe=0", "gpus_per_recipe must be 'auto' or a positive integer, got 0"),
        ("ptq.layerwise=maybe", "layerwise must be true, false or 'auto', got 'maybe'"),
        ("qad.offload=true", "qad.offload = true needs more than one process, and qad.num_gpus auto has 0 GPU(s)"),
        ("qad.batch_size=0", "qad.batch_size = 0: Value error, must be auto or a positive integer, got 0"),
        ("qad.batch_size=big", "qad.batch_size = 'big': Value error, must be auto or a positive integer, got 'big'"),
        ("qad.num_gpus=-2", "qad.num_gpus = -2: Value error, must be auto or a positive integer, got -2"),
        ("eval.batch_size=1.5", "eval.batch_size = 1.5: Value error, must be auto or a positive integer, got 1.5"),
        ("qad.grad_accum=4", "qad.grad_accum = 4: Value error, must be auto with qad.batch_size auto"),
        ("qad.rdzv_endpoint=head-node", "qad.rdzv_endpoint = 'head-node': String should match pattern"),
        ("race.fractions=[0.5, 0.25, 1.0]",
         "race.fractions = [0.5, 0.25, 1.0]: Value error, fractions must rise strictly within (0, 1] and end at 1.0"),
        ("race.fractions=[0.25, 0.5]", "fractions must rise strictly within (0, 1] and end at 1.0 (every item), "
                                       "got [0.25, 0.5]"),
        ("race.confidence=1", "race.confidence = 1: Input should be less than 1"),
        ("race.enabled=maybe", "race.enabled = 'maybe': Input should be a valid boolean"),
    ],
)
def test_ranges_across_keys(item, message, tmp_path):
    assert message in refused(tmp_path / "out", "--set", item)


def test_empty_base_model_is_refused_not_ignored(tmp_path):
    message = refused_process(tmp_path / "out", "--base-model", "")
    assert "--base-model is empty" in message
    with pytest.raises(ConfigError, match="base_model.path is empty"):
        load_params(overrides=["base_model.path=' '"])


# -- recipes: loaded and validated by Model Optimizer before any stage ---------------------------


@pytest.mark.parametrize(
    "text, problem",
    [
        ("metadata: [\n", "invalid YAML at line 2, column 1"),
        ("metadata:\n  recipe_type: ptq\n", "must contain 'quantize'"),
        ("quantize:\n  algorithm: max\n", "must contain a 'metadata.recipe_type' field"),
        ("metadata:\n  recipe_type: ptq\nquantize:\n  algorithm: max\n  quant_cfg:\n"
         "    - quantizer_name: '*weight_quantizer'\n      cfg:\n        num_bits: [9, 9]\n",
         "Supported FPx quantization formats"),
        ("metadata:\n  recipe_type: ptq\nquantize:\n  algorithm: max\n  quant_cfg:\n"
         "    - $import: nvfp5\nimports:\n  nvfp5: configs/numerics/nvfp5\n", "configs/numerics/nvfp5"),
    ],
    ids=["invalid-yaml", "no-quantize-section", "no-recipe-type", "unknown-format", "unknown-unit"],
)
def test_a_bad_recipe_is_refused_naming_its_file(text, problem, tmp_path):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    shutil.copy(PROJECT_ROOT / "recipes" / f"{GOOD_RECIPE}.yaml", recipes)
    (recipes / "bad.yaml").write_text(text)
    message = refused(tmp_path / "out", "--set", f"ptq.recipe_dir={recipes}",
                      "--set", f"ptq.recipes=[{GOOD_RECIPE}, bad]")
    assert f"recipe {recipes / 'bad.yaml'}" in message and problem in message


def test_a_stage_by_itself_checks_every_recipe_first(tmp_path):
    """`dvc repro` runs `qad-pipeline stage ...` one by one: the first stage already refuses a bad recipe."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "bad.yaml").write_text("metadata:\n  recipe_type: ptq\n")
    code, out = run_cli("stage", "calibration", "--out-root", str(tmp_path / "out"),
                        "--set", f"ptq.recipe_dir={recipes}", "--set", "ptq.recipes=[bad]")
    assert code == 2 and "must contain 'quantize'" in out and "Traceback" not in out
    assert not (tmp_path / "out" / "artifacts").exists()


# -- the model folder: weight files against their headers and index, no tensor loaded ------------


def copy_of_demo_model(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(PROJECT_ROOT / "demo" / "model", folder)
    return folder


def test_truncated_weights_are_refused(tmp_path):
    model = copy_of_demo_model(tmp_path)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    message = refused_process(tmp_path / "out", "--base-model", str(model))
    assert f"model weights {weights}" in message and "truncated" in message


def test_weights_missing_from_their_index_are_refused(tmp_path):
    from safetensors import safe_open

    model = copy_of_demo_model(tmp_path)
    with safe_open(str(model / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    weight_map = {name: "model.safetensors" for name in names}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(tmp_path / "ok", "--base-model", str(model), "--set", "calibration.num_samples=100000")  # gets past it
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    message = refused(tmp_path / "out", "--base-model", str(model))
    assert f"model weights {model / 'model-00002-of-00002.safetensors'} are missing" in message
    weight_map[names[0]] = "model.safetensors"
    weight_map["model.layers.99.extra.weight"] = "model.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    message = refused(tmp_path / "out", "--base-model", str(model))
    assert "lack 1 tensor(s)" in message and "model.layers.99.extra.weight" in message


def test_a_folder_without_weights_is_refused(tmp_path):
    model = copy_of_demo_model(tmp_path)
    (model / "model.safetensors").unlink()
    assert "holds no weight files" in refused(tmp_path / "out", "--base-model", str(model))


# a hub model the stages could not download (more cases: tests/test_hub_access.py); the second
# ships a config for planning offline (profiles/configs), which once let it through
@pytest.mark.parametrize("hub_id", ["org/not-cached-model", "meta-llama/Llama-3.1-8B"])
def test_a_hub_model_offline_and_not_cached_is_refused(hub_id, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert refused(tmp_path / "out", "--base-model", hub_id) == (
        f"error: base_model.path {hub_id!r} is a hub id, HF_HUB_OFFLINE is set and its weights are not in the local "
        f"cache: give a local folder as base_model.path, or download it into the Hugging Face cache "
        f"{tmp_path / 'empty-cache'} (`hf download {hub_id}`), or unset HF_HUB_OFFLINE")


# -- the calibration source: exists, decodes, yields the samples asked for -----------------------


def test_calibration_source_problems_are_refused_before_any_stage(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (str(tmp_path / "missing"), "does not exist"),
        (str(empty), "holds no .txt files"),
    ]
    for source, problem in cases:
        message = refused(tmp_path / "out", "--set", f"calibration.source={source}")
        assert f"calibration.source {source!r}" in message and problem in message
    message = refused(tmp_path / "out", "--set", "calibration.num_samples=100000")
    assert "fewer than the 100000 asked" in message


def test_undecodable_calibration_text_names_the_file_and_byte(tmp_path):
    source = tmp_path / "docs"
    shutil.copytree(PROJECT_ROOT / "data" / "heldout", source)
    bad = source / "2002-Bush-spoken.txt"
    good = bad.read_bytes()
    bad.write_bytes(good[:1234] + b"\xff\xfe" + good[1234:])
    message = refused(tmp_path / "out", "--set", f"calibration.source={source}")
    assert f"calibration.source file {bad}: byte 1234 (0xff) is not UTF-8" in message


def test_undecodable_qad_text_is_refused_too(tmp_path):
    bad = tmp_path / "train.txt"
    bad.write_bytes(b"first paragraph\n\nsecond \x80 paragraph\n")
    message = refused(tmp_path / "out", "--set", f"qad.source={bad}")
    assert f"file {bad}: byte 24 (0x80) is not UTF-8" in message


# -- the tracking store: reachable and really MLflow ---------------------------------------------


def http_server(status: int, body: bytes, content_type: str = "text/html"):
    return serve(lambda headers: (status, body, content_type))


def test_a_tracking_uri_that_answers_but_is_not_mlflow_is_refused(tmp_path):
    server, uri = http_server(404, b"<html>Not Found</html>")
    try:
        message = refused_process(tmp_path / "out", env={"MLFLOW_TRACKING_URI": uri})
    finally:
        server.shutdown()
    assert f"MLflow tracking server {uri} answers but is not an MLflow tracking server (HTTP 404" in message


def test_what_counts_as_an_mlflow_server(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.mlflow/credentials
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_AUTH"):
        monkeypatch.delenv(name, raising=False)
    for status, body, refused in [
        (200, b'{"experiments": [{"experiment_id": "0", "name": "Default"}]}', None),
        (401, b"", "asks for credentials"),  # an authenticating front, and no MLFLOW_TRACKING_* credentials set
        (200, b"<html>a web page</html>", "is not an MLflow tracking server"),
        (500, b"", "is not an MLflow tracking server"),
    ]:
        server, uri = http_server(status, body, "application/json")
        try:
            if refused is None:
                tracking.check_reachable(uri)
            else:
                with pytest.raises(ConfigError, match=refused):
                    tracking.check_reachable(uri)
        finally:
            server.shutdown()


FAKE_TOKEN = "hf_fake0123456789abcdef"


def test_a_secret_in_a_parameter_is_refused_without_being_printed(demo_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    line = refused(tmp_path / "a", "--set", f"calibration.source={FAKE_TOKEN}")
    assert "calibration.source holds the value of $HF_TOKEN" in line and FAKE_TOKEN not in line
    line = refused(tmp_path / "b", "--set", "calibration.source=https://bob:hunter2-pw@example.com/data")
    assert "credentials in a URL" in line and "hunter2" not in line
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "leaky.yaml").write_text((PROJECT_ROOT / "recipes" / f"{GOOD_RECIPE}.yaml").read_text()
                                        + f"\n# {FAKE_TOKEN}\n")
    line = refused(tmp_path / "c", "--set", f"ptq.recipe_dir={recipes}", "--set", "ptq.recipes=[leaky]")
    assert "leaky.yaml holds the value of $HF_TOKEN" in line and FAKE_TOKEN not in line


@pytest.mark.parametrize("name, secret", [
    ("HF_TOKEN", True), ("AWS_SECRET_ACCESS_KEY", True), ("api_key", True), ("apiKey", True), ("db.password", True),
    ("AWS_SESSION_TOKEN", True), ("tokenizer", False), ("token_count", False), ("tokens_per_step", False),
    ("monkey", False), ("keyframes", False),
])
def test_secret_names(name, secret):
    from qad_pipeline.core.redaction import is_secret_name

    assert is_secret_name(name) is secret


def test_debug_shows_the_traceback_of_a_refusal():
    code, out = run_cli("--debug", "plan", "--set", "calibration.num_sampels=3")
    assert code == 2 and "Traceback" in out and out.strip().splitlines()[-1].startswith("error: unknown key")


@pytest.mark.parametrize("broken, message", [
    ("not json", "It looks like the config file at '{folder}/config.json' is not a valid JSON file"),
    ("remote code", "The repository {folder} contains custom code which must be executed to correctly load the "
                    "model. You can inspect the repository content at {folder}; set base_model.trust_remote_code: "
                    "true if you trust that code"),
])
def test_a_model_folder_whose_config_cannot_be_read_is_one_line_naming_it(broken, message, demo_model_path, tmp_path):
    """A config.json that is not JSON, or needs remote code: one line naming the folder (not transformers' raw error)."""
    folder = tmp_path / "model"
    shutil.copytree(demo_model_path, folder)
    if broken == "not json":
        (folder / "config.json").write_text("{not json")
    else:
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type="my_custom_type", auto_map={"AutoConfig": "custom.MyConfig"})
        (folder / "config.json").write_text(json.dumps(config))
    line = refused(tmp_path / "out", "--base-model", str(folder))
    assert line == f"error: cannot read a model config from '{folder}': " + message.format(folder=folder)
