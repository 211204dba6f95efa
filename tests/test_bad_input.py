"""Bad input gets one clear line naming the bad value, before any model weights are loaded."""

import json

import pytest
from typer.testing import CliRunner

from qad_pipeline.cli import app
from qad_pipeline.config import ConfigError, load_params
from qad_pipeline.tasks.calibration import read_documents

runner = CliRunner()


def run_cli(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "ptq.recipes=[nvfp4_nope]"], "unknown recipe 'nvfp4_nope'"),
        (["--set", "calibration.num_sampels=3"], "unknown key 'calibration.num_sampels'"),
        (["--base-model", "./no/such/model"], "base model path './no/such/model' does not exist"),
        (["--set", "eval.seq_len=100000"], "eval.seq_len = 100000 exceeds the model's maximum sequence length 1024"),
        (["--set", "eval.tasks=[no_such_task_anywhere]"], "unknown eval task(s) ['no_such_task_anywhere']"),
    ],
)
def test_run_rejects_bad_input_in_one_line(args, message, demo_model_path, tmp_path):
    code, out = run_cli("run", "--out-root", str(tmp_path), *args)
    assert code == 2
    assert message in out
    assert "Traceback" not in out
    assert not (tmp_path / "artifacts").exists()  # nothing started


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
